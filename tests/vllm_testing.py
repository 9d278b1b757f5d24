"""vLLM's verification inputs built on CPU, as an engine step would hand them to its rejection
sampler: for the greedy-verification tests and benchmarks/verify_cost.py (which puts tests/ on its
path). vLLM 0.32's classes, used directly: the package reaches vLLM only through compat.py, its
tests and benchmarks may build vLLM's objects themselves.
"""

from __future__ import annotations

import torch


def spec_decode_metadata(drafts: list[list[int]]):
    """vLLM's ``SpecDecodeMetadata`` of a step that verifies ``drafts`` (one list per request),
    on CPU (vLLM's ``make_dummy`` leaves the row indices at 0): request i's logits rows are its
    draft positions, then its bonus position."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    counts = [len(d) for d in drafts]
    starts = [sum(counts[:i]) + i for i in range(len(counts))]
    i32 = dict(dtype=torch.int32)
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor([t for d in drafts for t in d], **i32),
        num_draft_tokens=counts,
        cu_num_draft_tokens=torch.tensor(counts, **i32).cumsum(0, dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor([n + 1 for n in counts], **i32).cumsum(
            0, dtype=torch.int32
        ),
        target_logits_indices=torch.tensor(
            [s + j for s, n in zip(starts, counts) for j in range(n)], **i32
        ),
        bonus_logits_indices=torch.tensor([s + n for s, n in zip(starts, counts)], **i32),
        logits_indices=torch.arange(sum(counts) + len(counts), **i32),
    )


def greedy_sampling_metadata(num_reqs: int):
    """vLLM's ``SamplingMetadata`` of ``num_reqs`` greedy requests with no penalties, logits
    processors or logprobs, on CPU."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=None,
        all_greedy=True,
        all_random=False,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(num_reqs),
        presence_penalties=torch.zeros(num_reqs),
        repetition_penalties=torch.ones(num_reqs),
        output_token_ids=[[] for _ in range(num_reqs)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
        spec_token_ids=[[] for _ in range(num_reqs)],
    )


def cpu_rejection_sampler():
    """vLLM's ``RejectionSampler`` over its ``Sampler``, with the CPU build's C++ stand-ins for
    its Triton kernels registered as an engine registers them."""
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    if current_platform.is_cpu():
        current_platform.register_triton_kernel_overrides()
    return RejectionSampler(Sampler())


def logit_bias_processors(biases: dict[int, dict[int, float]]):
    """vLLM's ``LogitsProcessors`` holding one built-in logit_bias processor with ``biases``
    (batch row -> token -> bias)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor

    proc = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
    proc.biases = biases
    return LogitsProcessors([proc])


def cuda_inplace_add_rmsnorm(monkeypatch) -> dict:
    """vLLM's fused add + RMSNorm as its CUDA kernel runs it: the normed output written over
    ``x`` and the sum over ``residual``, both returned (the CPU's native implementation returns
    new tensors). A partial forward that keeps a reference to a tensor a later norm overwrites
    passes every CPU test, and fails on a GPU, unless the tests run with this."""
    from vllm import ir

    op = ir.ops.fused_add_rms_norm
    native = op.impls["native"].impl_fn
    calls = {"n": 0}

    def in_place(x, residual, weight, epsilon, variance_size=None):
        out, res = native(x, residual, weight, epsilon, variance_size)
        x.copy_(out)
        residual.copy_(res)
        calls["n"] += 1
        return x, residual

    monkeypatch.setattr(op, "maybe_inplace", in_place)
    return calls

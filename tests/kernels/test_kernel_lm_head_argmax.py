"""The shadow-token LM-head Triton kernel against its PyTorch reference.

Each test taking ``kernel`` runs twice (``kernels_testing``): in Triton's interpreter, in a child
process started with ``TRITON_INTERPRET=1`` (``triton_interpreter_worker.py`` says why: with triton
3.9.0 the variable must be set before the process first imports triton, not just before the kernel
module is imported), and compiled on a CUDA GPU where there is one; the parent compares their
results with the reference computed here on the CPU.

Interpreter limits found with triton 3.9.0: ``tl.dot`` on bfloat16 operands multiplies the raw uint16
bit patterns (triton-lang/triton#11584), and float32 -> bfloat16 casts truncate instead of rounding
to nearest even. bfloat16 weights are therefore only tested on a GPU (``test_bf16_on_gpu``); float16
weights exercise the same rounded-input low-precision dot under the interpreter.

Tolerances: argmax ids must be equal (inputs are random normal with a fixed seed, no near-ties,
plus dedicated exact-tie cases); probabilities within rtol 2e-5, atol 1e-7 (both paths use float32
logits and differ only in summation order; the observed relative error is about 4e-6). One
exception: the compiled kernel on the GPU against the reference on the CPU, with a norm and a
16-bit weight. Both normalise with ``lm_head_input``, but PyTorch's float32 ``rsqrt(mean(x^2) +
eps)`` on the GPU and on the CPU differ in the last bit for some rows, and a normalised element next
to a rounding boundary of the weight dtype then rounds to the neighbouring 16-bit value, moving
the row's logits by ~|w| x one 16-bit ulp (measured on an H100: the reference itself on GPU vs CPU
up to 7.6e-4 apart in bfloat16; the kernel vs the reference on rows normalised beforehand, 1e-5).
There probabilities are compared within that dtype's epsilon (``_prob_tol``); ``test_bf16_on_gpu``
takes its reference on the GPU and keeps a tight tolerance.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from vllm_selfspec.kernels import lm_head_argmax as lm

from kernels_testing import RUNNERS, kernel_runner

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

PROB_TOL = dict(rtol=2e-5, atol=1e-7)


@pytest.fixture(scope="module", params=RUNNERS)
def kernel(request):
    """The kernels in Triton's interpreter, then compiled on a CUDA GPU (``kernels_testing``)."""
    run = kernel_runner(request.param, "kernel_is_interpreted")
    yield run
    run.close()


def triton_impl(kernel):
    """``lm_head_argmax_triton`` as run by ``kernel``."""
    return lambda *args, **kwargs: kernel("lm_head_argmax_triton", *args, **kwargs)


def _inputs(n: int, v: int, d: int, seed: int = 0, dtype=torch.float32):
    """Random normal hidden rows and an LM head scaled so logits have std ~3 (peaked, not one-hot)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).to(dtype)
    weight = (torch.randn(v, d, generator=g) * (3 / d**0.5)).to(dtype)
    norm_weight = (torch.rand(d, generator=g) + 0.5).to(dtype)
    subset = torch.randperm(v, generator=g)[: max(1, v // 3)]  # unsorted, as a subset may be
    return hidden, weight, norm_weight, subset


def _token_ids(hidden, weight, subset, use_subset: bool):
    """Row tokens mixing the argmax (large probability), random tokens and, for a subset, tokens
    outside it (probability 0)."""
    (n, v), device = (hidden.shape[0], weight.shape[0]), hidden.device
    tokens = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1)).to(device)
    tokens[::3] = lm.lm_head_argmax_reference(hidden, weight)[0][::3]
    if use_subset:
        outside = torch.ones(v, dtype=torch.bool, device=device)
        outside[subset] = False
        out_ids = outside.nonzero()[:, 0]
        rows = torch.arange(n, device=device)
        tokens[1::3] = subset[rows[1::3] % subset.numel()]
        tokens[2::3] = out_ids[rows[2::3] % out_ids.numel()]
    return tokens


def _prob_tol(compiled: bool, weight, norm_weight) -> dict:
    """``PROB_TOL``, or within the weight dtype's epsilon where the GPU's and the CPU's norm may
    round a few normalised elements to neighbouring 16-bit values (the module docstring)."""
    if compiled and norm_weight is not None and weight.element_size() < 4:
        return dict(rtol=torch.finfo(weight.dtype).eps, atol=1e-6)
    return PROB_TOL


def _assert_same(got, want, tol=PROB_TOL):
    ids, max_prob, token_prob = got
    ref_ids, ref_max_prob, ref_token_prob = want
    assert ids.dtype == torch.int64 and max_prob.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(max_prob, ref_max_prob, **tol)
    if ref_token_prob is None:
        assert token_prob is None
    else:
        assert token_prob.dtype == torch.float32
        torch.testing.assert_close(token_prob, ref_token_prob, **tol)


SHAPES = [
    (1, 1000, 64),  # one row: the vocabulary is split across programs
    (37, 5000, 576),  # SmolLM2's d (not a power of two); BLOCK_V=128 does not divide V
    (130, 300, 96),  # several row blocks, last one partial; d not a multiple of BLOCK_D
]


@pytest.mark.parametrize("use_subset", [False, True], ids=["full-vocab", "subset"])
@pytest.mark.parametrize("use_norm", [False, True], ids=["normed-input", "fused-norm"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}-V{}-d{}".format(*s))
def test_kernel_matches_reference(kernel, shape, use_norm, use_subset):
    hidden, weight, norm_weight, subset = _inputs(*shape)
    kwargs = dict(
        norm_weight=norm_weight if use_norm else None,
        vocab_index=subset if use_subset else None,
        token_ids=_token_ids(hidden, weight, subset, use_subset),
    )
    want = lm.lm_head_argmax_reference(hidden, weight, **kwargs)
    _assert_same(triton_impl(kernel)(hidden, weight, **kwargs), want)
    if use_subset:  # ids are original vocabulary ids; tokens outside the subset have probability 0
        assert torch.isin(want[0], subset).all()
        outside = ~torch.isin(kwargs["token_ids"], subset)
        assert outside.any() and (want[2][outside] == 0).all()


@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["one-split", "3-splits", "auto"])
def test_split_v_paths_agree(kernel, num_splits):
    """One program per row block over all of V, a forced split and the heuristic's split."""
    hidden, weight, norm_weight, _ = _inputs(20, 1000, 64, seed=2)
    want = lm.lm_head_argmax_reference(hidden, weight, norm_weight=norm_weight)
    got = triton_impl(kernel)(hidden, weight, norm_weight=norm_weight, num_splits=num_splits)
    _assert_same(got, want)


def test_launch_config_splits_small_batches():
    block_n, splits, chunk = lm.launch_config(1, 1000, target_programs=8)[:3]
    assert (block_n, splits, chunk) == (16, 8, 128)
    _, splits, chunk = lm.launch_config(1, 49152, target_programs=264)[:3]
    assert splits > 1 and chunk % lm.BLOCK_V == 0 and (splits - 1) * chunk < 49152 <= splits * chunk
    assert (
        lm.launch_config(1000, 49152, target_programs=8).splits == 1
    )  # enough row blocks: no split


@pytest.mark.parametrize("num_splits", [1, 4], ids=["one-split", "4-splits"])
@pytest.mark.parametrize("use_subset", [False, True], ids=["full-vocab", "subset"])
def test_exact_ties_pick_lowest_index(kernel, num_splits, use_subset):
    """Integer inputs make every logit exact, so maxima tie exactly (also across tiles and splits);
    the lowest index (position in the subset) must win, as with torch.argmax."""
    g = torch.Generator().manual_seed(3)
    n, v, d = 24, 1000, 32
    hidden = torch.randint(-1, 2, (n, d), generator=g).float()
    weight = torch.randint(-1, 2, (v, d), generator=g).float()
    weight[900] = weight[5]  # row 0 points at the duplicated rows 5 and 900: a planted tie
    hidden[0] = weight[5]
    vocab_index = torch.randperm(v, generator=g) if use_subset else None

    want = lm.lm_head_argmax_reference(hidden, weight, vocab_index=vocab_index)
    got = triton_impl(kernel)(hidden, weight, vocab_index=vocab_index, num_splits=num_splits)
    _assert_same(got, want)

    logits = hidden @ (weight if vocab_index is None else weight[vocab_index]).T
    assert ((logits == logits.max(dim=1, keepdim=True).values).sum(dim=1) > 1).sum() >= n // 4
    if vocab_index is None:
        assert got[0][0] == 5


@pytest.mark.parametrize("use_norm", [False, True], ids=["normed-input", "fused-norm"])
def test_float16_weights(kernel, use_norm):
    """Low-precision path: the normalised hidden is rounded to the weight dtype before the dot."""
    hidden, weight, norm_weight, _ = _inputs(20, 700, 96, seed=4, dtype=torch.float16)
    kwargs = dict(token_ids=torch.arange(20) * 31, norm_weight=norm_weight if use_norm else None)
    want = lm.lm_head_argmax_reference(hidden, weight, **kwargs)
    tol = _prob_tol(kernel.compiled, weight, kwargs["norm_weight"])
    _assert_same(triton_impl(kernel)(hidden, weight, **kwargs), want, tol)


def test_bf16_hidden_fp32_weight_and_strided_rows(kernel):
    """bfloat16 residual rows (loads and casts work in the interpreter) taken as a strided view."""
    hidden, weight, norm_weight, _ = _inputs(40, 500, 80, seed=5)
    rows = hidden.bfloat16()[::2]
    assert not rows.is_contiguous()
    want = lm.lm_head_argmax_reference(rows, weight, norm_weight=norm_weight)
    _assert_same(triton_impl(kernel)(rows, weight, norm_weight=norm_weight), want)


def test_reference_is_the_plain_formula():
    """The reference itself against a literal transcription of the spec (no chunking, no subset
    bookkeeping), with a chunk size that does not divide V."""
    hidden, weight, norm_weight, subset = _inputs(9, 301, 48, seed=6)
    tokens = torch.tensor([0, 300, 5, 7, 9, 11, 13, 15, 17])
    ids, max_prob, token_prob = lm.lm_head_argmax_reference(
        hidden, weight, norm_weight=norm_weight, token_ids=tokens, vocab_index=subset, chunk_v=64
    )

    x = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
    probs = torch.softmax(x @ weight[subset].T, dim=-1)
    assert torch.equal(ids, subset[probs.argmax(-1)])
    torch.testing.assert_close(max_prob, probs.max(-1).values)
    for row, token in enumerate(tokens.tolist()):
        hit = (subset == token).nonzero()
        expected = probs[row, hit[0, 0]] if hit.numel() else torch.tensor(0.0)
        torch.testing.assert_close(token_prob[row], expected)


def test_empty_batch_and_bad_shapes(kernel):
    hidden, weight, _, _ = _inputs(0, 300, 64)
    for impl in (lm.lm_head_argmax_reference, triton_impl(kernel)):
        ids, max_prob, token_prob = impl(hidden, weight)
        assert ids.shape == max_prob.shape == (0,) and token_prob is None
        with pytest.raises(ValueError, match="hidden size"):
            impl(torch.zeros(2, 63), weight)


def test_dispatcher_uses_reference_on_cpu(monkeypatch):
    monkeypatch.delenv(lm.FORCE_TRITON_ENV, raising=False)

    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton kernel must not run for CPU tensors by default")

    monkeypatch.setattr(lm, "lm_head_argmax_triton", no_triton)
    hidden, weight, norm_weight, _ = _inputs(5, 200, 32)
    assert not lm.use_triton(hidden)
    got = lm.lm_head_argmax(hidden, weight, norm_weight=norm_weight)
    _assert_same(got, lm.lm_head_argmax_reference(hidden, weight, norm_weight=norm_weight))


def test_dispatcher_forced_triton_runs_the_kernel(kernel):
    hidden, weight, _, _ = _inputs(5, 200, 32)
    tokens = torch.arange(5)
    got, launches = kernel("forced_dispatch", hidden, weight, token_ids=tokens)
    assert launches == 1
    _assert_same(got, lm.lm_head_argmax_reference(hidden, weight, token_ids=tokens))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton)")
@pytest.mark.parametrize(
    "shape",
    [(150, 49152, 576), (288, 32000, 4096), (1, 128256, 4096)],
    ids=lambda s: "N{}-V{}-d{}".format(*s),
)
def test_bf16_on_gpu(shape):
    """The compiled kernel on bfloat16 model-like shapes (SmolLM2, Llama-sized d)."""
    hidden, weight, norm_weight, subset = _inputs(*shape)
    hidden, weight, norm_weight = (t.cuda().bfloat16() for t in (hidden, weight, norm_weight))
    subset = subset.cuda()
    tokens = _token_ids(hidden, weight, subset, use_subset=True)
    for kwargs in (
        dict(token_ids=tokens),
        dict(norm_weight=norm_weight, token_ids=tokens, vocab_index=subset),
    ):
        want = lm.lm_head_argmax_reference(hidden, weight, **kwargs)
        assert lm.use_triton(hidden)
        got = lm.lm_head_argmax(hidden, weight, **kwargs)
        # bf16 products are exact in float32 and both paths normalise on this device with the
        # same ops (lm_head_input), so only the summation order differs
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-6)

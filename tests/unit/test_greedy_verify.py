"""engine/greedy_verify.py against vLLM's own rejection sampler, on random verifying steps."""

import random
from dataclasses import replace

import pytest
import torch

from vllm_selfspec.engine.greedy_verify import GreedyVerification
from vllm_selfspec.engine.stats import EngineStats
from vllm_testing import (
    cpu_rejection_sampler,
    greedy_sampling_metadata,
    logit_bias_processors,
    spec_decode_metadata,
)

VOCAB = 1000


@pytest.fixture(scope="module")
def vllm_sampler():
    return cpu_rejection_sampler()


def _step(rng: random.Random, num_reqs: int, max_drafts: int):
    """A verifying step: per request 0..max_drafts drafts (one request at least one), each a
    prefix of the rows' argmax then a miss (a placeholder -1 sometimes); ties in some rows."""
    counts = [rng.randint(0, max_drafts) for _ in range(num_reqs)]
    counts[rng.randrange(num_reqs)] = rng.randint(1, max_drafts)
    logits = torch.randn(
        sum(counts) + num_reqs,
        VOCAB,
        generator=torch.Generator().manual_seed(rng.randrange(1 << 30)),
    )
    for row in rng.sample(range(logits.shape[0]), k=logits.shape[0] // 3):
        a, b = rng.sample(range(VOCAB), 2)  # two equal maxima: the first index wins
        logits[row, a] = logits[row, b] = logits[row].max() + 1
    drafts, row = [], 0
    for n in counts:
        hits = rng.randint(0, n)
        ids = []
        for j in range(n):
            best = int(logits[row + j].argmax())
            if j < hits:
                ids.append(best)
            else:
                ids.append(-1 if rng.random() < 0.2 else (best + rng.randint(1, VOCAB - 1)) % VOCAB)
        drafts.append(ids)
        row += n + 1
    return spec_decode_metadata(drafts), logits


@pytest.mark.parametrize("num_reqs, max_drafts", [(1, 1), (1, 6), (3, 2), (8, 4), (9, 7), (16, 12)])
def test_greedy_verification_emits_vllms_tokens(vllm_sampler, num_reqs, max_drafts):
    rng = random.Random(num_reqs * 100 + max_drafts)
    stats = EngineStats()
    fast = GreedyVerification(vllm_sampler, stats)
    for _ in range(20):
        metadata, logits = _step(rng, num_reqs, max_drafts)
        md = greedy_sampling_metadata(num_reqs)
        want = vllm_sampler(metadata, None, logits.clone(), md).sampled_token_ids
        got = fast(metadata, None, logits.clone(), md)
        assert got.logprobs_tensors is None
        assert got.sampled_token_ids.dtype == want.dtype
        assert torch.equal(got.sampled_token_ids, want)
    assert stats.greedy_verifications == 20 and stats.sampled_verifications == 0


def test_the_example_of_the_module_docstring(vllm_sampler):
    metadata = spec_decode_metadata([[5, 7, 9], [4]])
    logits = torch.zeros(6, 10)
    for row, best in enumerate([5, 7, 2, 8, 4, 6]):
        logits[row, best] = 1.0
    out = GreedyVerification(vllm_sampler, EngineStats()).verify(metadata, logits)
    assert out.tolist() == [[5, 7, 2, -1], [4, 6, -1, -1]]


def test_bf16_logits_take_their_float32_argmax(vllm_sampler):
    metadata, logits = _step(random.Random(3), 4, 3)
    logits = logits.bfloat16()
    md = greedy_sampling_metadata(4)
    want = vllm_sampler(metadata, None, logits.clone(), md).sampled_token_ids
    got = GreedyVerification(vllm_sampler, EngineStats())(metadata, None, logits.clone(), md)
    assert torch.equal(got.sampled_token_ids, want)


def _with_logit_bias(md, biases):
    return replace(md, logitsprocs=logit_bias_processors(biases))


@pytest.mark.parametrize(
    "change",
    [
        lambda md: replace(
            md, all_greedy=False, temperature=torch.zeros(md.repetition_penalties.shape[0])
        ),
        lambda md: replace(md, no_penalties=False),
        lambda md: replace(md, bad_words_token_ids={0: [[3]]}),
        lambda md: replace(md, max_num_logprobs=2),
        lambda md: _with_logit_bias(md, {0: {3: 5.0}}),
    ],
    ids=["not-all-greedy", "penalties", "bad-words", "logprobs", "logit-bias"],
)
def test_what_may_move_an_argmax_goes_to_vllms_sampler(change):
    calls = []

    class Recorder:
        synthetic_mode = False

        def __call__(self, *args):
            calls.append(args)
            return "vllm's"

    stats = EngineStats()
    fast = GreedyVerification(Recorder(), stats)
    md = greedy_sampling_metadata(2)
    assert fast(None, None, None, change(md)) == "vllm's"
    assert len(calls) == 1 and stats.sampled_verifications == 1 and stats.greedy_verifications == 0


def test_idle_builtin_processors_keep_the_fast_path(vllm_sampler):
    metadata, logits = _step(random.Random(5), 3, 3)
    # a logit_bias processor that no request uses
    md = _with_logit_bias(greedy_sampling_metadata(3), {})
    stats = EngineStats()
    GreedyVerification(vllm_sampler, stats)(metadata, None, logits, md)
    assert stats.greedy_verifications == 1

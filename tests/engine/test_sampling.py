"""Temperature > 0: self-spec keeps the target's output distribution (small-vocabulary case).

A tiny random-weight Llama (vocab 32, peaked logits) samples N continuations of one prompt with
vanilla vLLM and with a shallow-exit drafter (exit after 1 of 4 layers, 3 drafts; the draft
distribution q is far from the target's). Per output position, a chi-square two-sample test
compares the token histograms. Greedy requests run in the same batch and must stay token-identical.

The same with a reduced draft vocabulary (8 of the 32 tokens): drafts are drawn from the
distribution renormalised over the 8 tokens, which is what the rejection sampler must be given.

Negative control (shows the test can fail): the same run with the draft probabilities handed to
vLLM's rejection sampler replaced by the same distribution shifted by one token — no longer the distribution the drafts
were drawn from — must be detected as a different distribution at the same significance level.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency
from vllm import SamplingParams

import vllm_selfspec
from selfspec_testing import engine, save_built_heads, save_tiny_model
from vllm_selfspec.engine.proposer import SelfSpecProposer

pytestmark = pytest.mark.engine
VOCAB, N, MAX_TOKENS = 32, 2000, 4
ALPHA = 1e-3  # significance level of the chi-square tests
PROMPT = {"prompt_token_ids": [1, 5, 9, 2, 7]}
SPEC = {"method": "layerskip", "exit_layer": 1, "num_speculative_tokens": 3}
KW = dict(skip_tokenizer_init=True, max_model_len=256, max_num_seqs=64)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    # peaked, position-dependent distributions
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), VOCAB, lm_head_scale=60.0)


def _sample(llm, temperature: float = 1.0) -> tuple[np.ndarray, list[list[int]]]:
    sp = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [PROMPT] * N + [{"prompt_token_ids": [3, i % VOCAB, 4]} for i in range(8)]
    params = [sp] * N + [greedy] * 8
    outs = llm.generate(prompts, params, use_tqdm=False)
    sampled = np.array([o.outputs[0].token_ids for o in outs[:N]])
    return sampled, [list(o.outputs[0].token_ids) for o in outs[N:]]


def _min_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Smallest chi-square p-value over output positions 1.. (position 0 comes from prefill)."""
    ps = []
    for pos in range(1, MAX_TOKENS):
        table = np.stack(
            [np.bincount(a[:, pos], minlength=VOCAB), np.bincount(b[:, pos], minlength=VOCAB)]
        )
        table = table[:, table.sum(0) > 0]
        ps.append(chi2_contingency(table)[1])
    return min(ps)


@pytest.fixture(scope="module")
def vanilla(tiny_model):
    with engine(tiny_model, **KW) as llm:
        return _sample(llm)


def _assert_drafted(stats) -> None:
    assert stats["drafted_tokens"] > 100, "few drafts: the distribution test would be vacuous"
    assert 0 < stats["accepted_tokens"] < stats["drafted_tokens"]
    # steps with sampled requests are verified by vLLM's rejection sampler (greedy_verify.py
    # takes all-greedy steps only)
    assert stats["sampled_verifications"] > 0


def test_sampling_keeps_target_distribution(tiny_model, vanilla):
    with engine(tiny_model, speculative_config=SPEC, **KW) as llm:
        sampled, greedy = _sample(llm)
        _assert_drafted(vllm_selfspec.get_stats(llm))
    assert greedy == vanilla[1], "greedy requests in a sampled batch changed"
    p = _min_pvalue(vanilla[0], sampled)
    assert p > ALPHA, f"self-spec sampling distribution differs from vanilla (p={p:.2e})"


def test_sampling_with_a_reduced_draft_vocabulary(tiny_model, vanilla, tmp_path):
    from vllm_selfspec.vocab import identity_from_checkpoint, save_vocab

    # the map ranks the tokens the peaked target emits least first: many drafts cannot match
    counts = torch.bincount(torch.from_numpy(vanilla[0]).flatten(), minlength=VOCAB)
    vocab = save_vocab(tmp_path / "vocab", -counts, identity_from_checkpoint(tiny_model), {})
    spec = {**SPEC, "draft_vocab_size": 8, "draft_vocab": str(vocab)}
    with engine(tiny_model, speculative_config=spec, **KW) as llm:
        sampled, greedy = _sample(llm)
        _assert_drafted(vllm_selfspec.get_stats(llm))
    assert greedy == vanilla[1], "greedy requests in a sampled batch changed"
    p = _min_pvalue(vanilla[0], sampled)
    assert p > ALPHA, f"reduced-vocabulary drafts changed the distribution (p={p:.2e})"


def test_wrong_draft_probs_are_detected(tiny_model, vanilla, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # patch reaches the worker
    orig = SelfSpecProposer.draft_probs

    def shifted_probs(self, req_ids, spec_decode_metadata):
        q = orig(self, req_ids, spec_decode_metadata)
        return None if q is None else torch.roll(q, shifts=1, dims=-1)

    monkeypatch.setattr(SelfSpecProposer, "draft_probs", shifted_probs)
    with engine(tiny_model, speculative_config=SPEC, **KW) as llm:
        sampled, _ = _sample(llm)
    p = _min_pvalue(vanilla[0], sampled)
    assert p < ALPHA, f"a wrong draft distribution went undetected (p={p:.2e})"


def test_drafts_verified_steps_later_keep_their_q(tiny_model):
    """A token budget that fits 3 of 12 running drafting requests per step: most requests are verified
    steps after they drafted, and their q must still reach the rejection sampler (without it the
    drafts are verified as point masses: exact, but accepted less)."""
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=None)
    prompts = [{"prompt_token_ids": [3, i % VOCAB, 4]} for i in range(24)]
    kw = {**KW, "max_num_seqs": 12, "max_num_batched_tokens": 12}
    with engine(tiny_model, speculative_config=SPEC, **kw) as llm:
        llm.generate(prompts, [sp] * len(prompts), use_tqdm=False)
        stats = vllm_selfspec.get_stats(llm)
    assert stats["drafted_tokens"] > 100
    assert stats["draft_probs_missing"] == 0


def test_a_request_padded_at_admission_keeps_the_batchs_q(tiny_model):
    """vLLM's scheduler gives a request admitted with one token left to compute, beside running
    decodes, k placeholder drafts (-1) it never drafted. The other requests' q must still reach
    the rejection sampler (vLLM's own lookup by request id dropped every q of that step, with
    "Missing cached draft probabilities"), and the placeholders are not counted as drafts."""
    sp = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    short = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    # two slots: the one-token prompts are admitted one by one as the short requests finish,
    # each beside the long request's decodes
    prompts = [{"prompt_token_ids": [3, 1, 4]}]
    params = [sp]
    for i in range(6):
        prompts += [{"prompt_token_ids": [5, i + 1]}, {"prompt_token_ids": [i + 7]}]
        params += [short, short]
    kw = {**KW, "max_num_seqs": 2}
    with engine(tiny_model, speculative_config={**SPEC, "goodput": False}, **kw) as llm:
        llm.generate(prompts, params, use_tqdm=False)
        stats = vllm_selfspec.get_stats(llm)
    assert stats["placeholder_drafts"] > 0, "no request was padded: the test proves nothing"
    assert stats["draft_probs_missing"] == 0
    assert stats["drafted_tokens"] > 0


def _sampled_like_vanilla(tiny_model, spec, name: str) -> dict:
    """Sample at T = 0.6 with vanilla and with ``spec``; the sampled tokens must follow the same
    distribution per position and the greedy rows of the batch stay identical. The stats."""
    with engine(tiny_model, **KW) as llm:
        want, want_greedy = _sample(llm, temperature=0.6)
    with engine(tiny_model, speculative_config=spec, **KW) as llm:
        got, greedy = _sample(llm, temperature=0.6)
        stats = vllm_selfspec.get_stats(llm)
    assert stats["drafted_tokens"] > 0, f"{name} never drafted: the test would be vacuous"
    assert greedy == want_greedy, "greedy requests in a sampled batch changed"
    p = _min_pvalue(want, got)
    assert p > ALPHA, f"{name} sampling at T=0.6 differs from vanilla (p={p:.2e})"
    return stats


def test_del_sampling_at_temperature_0_6(tiny_model):
    """DEL's adaptive drafts (per-request exit and length, confidence stop) at T = 0.6."""
    spec = {"method": "del", "exit_layers": [1, 2], "shadow_every": 1, "capture_tokens": 4}
    _sampled_like_vanilla(tiny_model, spec, "DEL")


def test_adadecode_sampling_at_temperature_0_6(tiny_model, tmp_path):
    """AdaDecode's early tokens are drawn from the exit head's softmax(logits / T) and verified
    with min(1, p/q) (the q handed to vLLM's rejection sampler); their deep layers finish in the
    verifying forward."""
    path = save_built_heads(tiny_model, tmp_path / "heads", "adadecode", (1, 2))
    spec = {"method": "adadecode", "heads": path, "threshold": 0.5, "num_speculative_tokens": 3}
    stats = _sampled_like_vanilla(tiny_model, spec, "AdaDecode")
    assert stats["drafted_tokens"] > 100, "AdaDecode rarely drafted: the test would be weak"
    assert stats["accepted_tokens"] < stats["drafted_tokens"]


def test_feature_sampling_at_temperature_0_6(tiny_model, tmp_path):
    """Feature heads' drafts are drawn from the head's softmax(logits / T) over the embedding and
    the final layer's output, and that q goes to the rejection sampler."""
    path = save_built_heads(tiny_model, tmp_path / "heads", "feature", (0,))
    spec = {"method": "feature", "heads": path, "num_speculative_tokens": 3}
    stats = _sampled_like_vanilla(tiny_model, spec, "feature")
    assert stats["drafted_tokens"] > 100, "the feature head rarely drafted: the test would be weak"
    assert stats["accepted_tokens"] < stats["drafted_tokens"]


#: context lookup on the tiny model (a match of one token drafts up to 4), sampled at
#: T = 1.5 where the target's p(x) of a lookup draft is far from 1. Half the requests have a
#: prompt holding every token (a lookup draft every step), half the usual short one (mostly
#: self-drafts), in the same batches: steps mix lookup point masses with self-drafts' q. A
#: random-weight model does not continue its context, so measured costs and acceptance would
#: rightly pick the self-drafts; the tests take a lookup draft wherever there is one.
# the request's own context only: other requests' outputs (the same prompt, sampled again and
# again) would match nearly every step, and no self-draft would be left to mix with
LOOKUP_SPEC = {**SPEC, "lookup": {"max_spec_factor": 4.0, "shared": False}}
HOT = 1.5
EVERY_TOKEN = {"prompt_token_ids": [1] + [(7 * i) % VOCAB for i in range(VOCAB)]}


def _sample_two(llm) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    sp = SamplingParams(temperature=HOT, max_tokens=MAX_TOKENS, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    half = N // 2
    prompts = (
        [EVERY_TOKEN] * half
        + [PROMPT] * half
        + [{"prompt_token_ids": [3, i % VOCAB, 4]} for i in range(8)]
    )
    outs = llm.generate(prompts, [sp] * N + [greedy] * 8, use_tqdm=False)
    tokens = np.array([o.outputs[0].token_ids for o in outs[:N]])
    return tokens[:half], tokens[half:], [list(o.outputs[0].token_ids) for o in outs[N:]]


@pytest.fixture(scope="module")
def vanilla_hot(tiny_model):
    with engine(tiny_model, **KW) as llm:
        return _sample_two(llm)


def _lookup_pvalue(want, got) -> float:
    return min(_min_pvalue(want[0], got[0]), _min_pvalue(want[1], got[1]))


def _always_lookup(monkeypatch) -> None:
    from vllm_selfspec.engine import proposer

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # patches reach the worker
    monkeypatch.setattr(proposer, "prefer_free", lambda free, paid, v1: free.max_tokens > 0)


def test_sampling_with_lookup_drafts_mixed_in(tiny_model, vanilla_hot, monkeypatch):
    """Lookup drafts are point masses: they reach the rejection sampler as one-hot q (accept
    with p(x)) beside self-drafts' softmax q in the same step, and as no q at all (vLLM's own
    point-mass reading) in steps with lookup drafts only."""
    _always_lookup(monkeypatch)
    with engine(tiny_model, speculative_config=LOOKUP_SPEC, **KW) as llm:
        got = _sample_two(llm)
        stats = vllm_selfspec.get_stats(llm)
    lookup = stats["lookup_drafted_tokens"]
    # the short-prompt requests also find repeats after a few tokens: self-drafts are fewer
    assert lookup > 1000 and stats["drafted_tokens"] - lookup > 50, stats["token_sources"]
    assert got[2] == vanilla_hot[2], "greedy requests in a sampled batch changed"
    p = _lookup_pvalue(vanilla_hot, got)
    assert p > ALPHA, f"lookup drafts changed the sampling distribution (p={p:.2e})"


def test_lookup_drafts_passed_off_as_sampled_drafts_are_detected(
    tiny_model, vanilla_hot, monkeypatch
):
    """Negative control: drafts handed over as if they had been drawn from a spread distribution
    (uniform q instead of the point mass a lookup draft is) are accepted far too often
    (min(1, p/q)), which the chi-square test must catch. (A q of 0 at the drafted token would
    not be a distribution error in vLLM 0.32: its rejection sampler then always rejects and
    samples the target's p.)"""
    _always_lookup(monkeypatch)

    def spread(self, req_ids, spec_decode_metadata):
        n = len(spec_decode_metadata.draft_token_ids)
        return torch.full((n, self.info.vocab_size), 1.0 / self.info.vocab_size) if n else None

    monkeypatch.setattr(SelfSpecProposer, "draft_probs", spread)
    with engine(tiny_model, speculative_config=LOOKUP_SPEC, **KW) as llm:
        got = _sample_two(llm)
    p = _lookup_pvalue(vanilla_hot, got)
    assert p < ALPHA, f"lookup drafts with a wrong q went undetected (p={p:.2e})"


#: top-k, top-p and penalties at T = 1.5 (where the peaked tiny model spreads its mass), each on
#: a prompt of its own so that the histograms of one position are of one parameter set. Drafts
#: are drawn from softmax(logits / T) over the whole vocabulary, without the truncation or the
#: penalties: vLLM's rejection sampler applies both to the target's p, so drafts outside the top
#: k (or p) are always rejected and the output follows the truncated, penalised distribution.
FILTERED = {
    "top_k": (dict(top_k=2), [1, 5, 9, 2, 7]),
    "top_p": (dict(top_p=0.6), [2, 8, 4, 11]),
    "penalties": (
        dict(repetition_penalty=1.8, presence_penalty=1.0, frequency_penalty=0.5),
        [6, 3, 12, 1],
    ),
}


def _sample_filtered(llm, control: bool = False) -> dict[str, np.ndarray]:
    """N samples of each ``FILTERED`` case (``control``: and of its prompt without the case's
    parameters, under "<name>/plain")."""
    prompts, params, names = [], [], []
    for name, (kw, ids) in FILTERED.items():
        cases = [(name, kw)] + ([(f"{name}/plain", {})] if control else [])
        for case, extra in cases:
            sp = SamplingParams(temperature=HOT, max_tokens=MAX_TOKENS, ignore_eos=True, **extra)
            prompts += [{"prompt_token_ids": ids}] * N
            params += [sp] * N
            names.append(case)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = np.array([o.outputs[0].token_ids for o in outs])
    return {name: tokens[i * N : (i + 1) * N] for i, name in enumerate(names)}


def test_top_k_top_p_and_penalties_keep_the_target_distribution(tiny_model):
    with engine(tiny_model, **KW) as llm:
        want = _sample_filtered(llm, control=True)
    for name in FILTERED:  # each parameter changes the distribution: dropping it would show
        p = _min_pvalue(want[name], want[f"{name}/plain"])
        assert p < ALPHA, f"{name} barely changes the distribution here (p={p:.2e})"
    with engine(tiny_model, speculative_config={**SPEC, "goodput": False}, **KW) as llm:
        got = _sample_filtered(llm)
        _assert_drafted(vllm_selfspec.get_stats(llm))
    for name in FILTERED:
        p = _min_pvalue(want[name], got[name])
        assert p > ALPHA, f"{name}: self-spec sampling differs from vanilla (p={p:.2e})"

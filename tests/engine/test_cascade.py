"""Cascade on the embedded model: the lossless drafter keeps vanilla vLLM's greedy output token
for token; the opt-in lossy sampler emits every confident draft unverified (and says so).

The heads here are built, not trained (CascadeHead at initialisation: the adapter is the identity,
so the exit reads the raw LM head at its layer; the estimator is random), saved in the real
format with thresholds that make the exits fire, so the test is fast and covers the wiring;
training is covered by tests/unit/test_heads.py and the trained heads by the benchmarks.
"""

from __future__ import annotations

import logging

import pytest
import torch
from vllm import SamplingParams

import vllm_selfspec
from selfspec_testing import engine, save_passthrough_top, selfspec_log, token_ids
from vllm_selfspec.heads import HeadSet, identity_from_hf, make_head, save_heads

pytestmark = pytest.mark.engine
PROMPTS = [
    "def fibonacci(n):",
    "The three primary colours are",
    "Write a haiku about rain.",
    "import numpy as np\n\ndef normalise(x):",
]
K = 3


@pytest.fixture(scope="module")
def model_path(model_path, tmp_path_factory):
    """The embedded model with layers 24-29 passing the residual stream through: exit 24 then
    names the model's own next token, so the drafter's parity test has drafts accepted (untrained
    adapters at exit 12 rarely agree with the final layer)."""
    return save_passthrough_top(model_path, tmp_path_factory.mktemp("cascade-model"), keep=24)


@pytest.fixture(scope="module")
def cascade_heads(model_path, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    identity = identity_from_hf(hf)
    torch.manual_seed(0)
    heads = {layer: make_head("cascade", identity.hidden_size) for layer in (12, 24)}
    for head in heads.values():
        head.threshold = 0.0  # overridden per test
    return save_heads(
        tmp_path_factory.mktemp("cascade") / "heads",
        HeadSet("cascade", heads, identity),
        training={"built": "test"},
    )


@pytest.fixture(scope="module")
def vanilla(model_path):
    sp = SamplingParams(temperature=0, max_tokens=40)
    with engine(model_path, max_num_seqs=4) as llm:
        return token_ids(llm.generate(PROMPTS, sp, use_tqdm=False))


def _run(model_path, spec):
    sp = SamplingParams(temperature=0, max_tokens=40)
    with engine(model_path, max_num_seqs=4, speculative_config=spec) as llm:
        out = token_ids(llm.generate(PROMPTS, sp, use_tqdm=False))
        return out, vllm_selfspec.get_stats(llm)


@pytest.mark.parametrize("adaptive", [False, True])
def test_cascade_drafter_keeps_parity(model_path, cascade_heads, vanilla, adaptive):
    # exit 12 fires for some tokens, 24 for the rest it is tried on (its threshold is 0)
    spec = {
        "method": "cascade",
        "heads": str(cascade_heads),
        "num_speculative_tokens": K,
        "thresholds": {"12": 0.5, "24": 0.0},
        "adaptive": adaptive,
    }
    got, stats = _run(model_path, spec)
    assert got == vanilla
    exits = stats["cascade_exits"]
    assert exits["12"]["drafted"] > 0, exits
    if not adaptive:  # every token may walk to 24 (adaptive walks stop where it does not pay)
        assert exits["24"]["drafted"] > 0, exits
    assert stats["accepted_tokens"] == sum(e["accepted"] for e in exits.values())
    assert stats["accepted_tokens"] > 0, "no draft was accepted: parity proved nothing"
    assert stats["policy"]["lossy"] is False and stats["unverified_tokens"] == 0


def test_lossy_sampler_emits_drafts_unverified(model_path, cascade_heads, vanilla, caplog):
    # one exit that always fires: every round drafts K tokens, all emitted without verification
    spec = {
        "method": "cascade",
        "heads": str(cascade_heads),
        "num_speculative_tokens": K,
        "exit_layers": [12],
        "lossy": True,
    }
    with selfspec_log(caplog, logging.WARNING):
        got, stats = _run(model_path, spec)
    assert "LOSSY MODE" in caplog.text
    assert stats["drafted_tokens"] > 0
    assert stats["accepted_tokens"] == stats["drafted_tokens"] == stats["unverified_tokens"]
    assert sum(stats["unverified_tokens_by_request"].values()) == stats["unverified_tokens"]
    assert [len(t) for t in got] == [len(t) for t in vanilla]
    # a 12-layer raw exit disagrees with the full model often: the output changed (this is why
    # the mode is opt-in), while each round's first token is still the full model's
    assert got != vanilla
    assert [t[0] for t in got] == [t[0] for t in vanilla]

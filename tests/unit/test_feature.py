"""Feature heads' drafting (policies/feature.py, engine/drafters/feature.py) without an engine:
which of vLLM's logits rows holds each request's final-layer feature, and the policy's checks."""

from __future__ import annotations

import random

import pytest

from vllm_selfspec.engine.drafters.feature import feature_rows
from vllm_selfspec.plans import LM_HEAD
from vllm_selfspec.policies import FeaturePolicy, ModelInfo

MODEL = ModelInfo(num_layers=30, hidden_size=576, vocab_size=49152, architecture="Llama")


def test_feature_rows_worked_example():
    # A verified 3 drafts, accepted 1 ([d1, bonus]); B verified none; C sampled nothing
    assert feature_rows([[11, 12], [13], []], [3, 0, 0]) == [1, 4, -1]
    # a step that verified nothing: one logits row per request
    assert feature_rows([[5], [6], []], None) == [0, 1, -1]


def test_feature_rows_match_a_layout_of_the_logits_rows():
    """Brute force: lay the logits rows out one by one (a request's verified drafts, then its
    bonus row) and find the row that sampled each request's last token."""
    g = random.Random(0)
    for _ in range(200):
        n = g.randint(1, 8)
        drafts = [g.randint(0, 5) for _ in range(n)]
        sampled, layout = [], []
        for i, d in enumerate(drafts):
            for r in range(d + 1):
                layout.append((i, r))  # request i's r-th logits row
            if g.random() < 0.15:  # a prefill chunk: nothing sampled
                sampled.append([])
            else:
                accepted = g.randint(0, d)
                sampled.append([100 + r for r in range(accepted + 1)])
        want = [layout.index((i, len(s) - 1)) if s else -1 for i, s in enumerate(sampled)]
        assert feature_rows(sampled, drafts) == want
        if not any(drafts):
            assert feature_rows(sampled, None) == want


def _heads(layers):
    return {"kind": "feature", "layers": layers}


def test_policy_drafts_at_the_embeddings_through_its_head():
    policy = FeaturePolicy({"heads": "/h"}, MODEL, 3, _heads([0]))
    decision = policy.propose(policy.new_state())
    assert decision.num_tokens == 3
    assert decision.plan.exit_layer == 0 and decision.plan.layer_cost == 0
    assert decision.plan.head == "heads@0" != LM_HEAD
    assert policy.drafter == "feature" and policy.head_kind == "feature"


def test_policy_refuses_heads_without_an_exit_at_the_embeddings():
    with pytest.raises(ValueError, match="exit 0 only"):
        FeaturePolicy.validate({"heads": "/h"}, MODEL, _heads([8, 12]))
    with pytest.raises(ValueError, match="resolved to a directory"):
        FeaturePolicy({"heads": "auto"}, MODEL, 3, None)

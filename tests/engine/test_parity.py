"""Greedy output parity with real vanilla vLLM on the embedded model, same engine settings.

Settings shared by every engine here: max_num_seqs 8, prefix caching on, chunked prefill with a
128-token budget (the long prompt below spans several chunks). "bs 1" submits the prompts one at
a time; "bs 8" submits them together. Plans: the full model (canary: 100% acceptance), a shallow
exit, a sub-layer skip set, and DEL's per-request choices.
"""

from __future__ import annotations

import pytest

import vllm_selfspec
from selfspec_testing import engine, greedy_one_by_one_and_together

pytestmark = pytest.mark.engine

SHARED_PREFIX = (
    "You are a careful assistant. Answer in one short paragraph and do not repeat the question. "
)
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    SHARED_PREFIX + "Why is the sky blue?",
    SHARED_PREFIX + "What does a compiler do?",
    "List three prime numbers:",
    'import numpy as np\n\ndef softmax(x):\n    """Numerically stable softmax."""\n',
    # longer than one 128-token prefill chunk
    "Summarise the following text.\n"
    + " ".join(
        f"Paragraph {i}: the quick brown fox jumps over the lazy dog near the river bank."
        for i in range(30)
    ),
    "Once upon a time",
]
SETTINGS = dict(
    max_num_seqs=8,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
    max_num_batched_tokens=128,
)
MAX_TOKENS = 32
CONFIGS = {
    "full": {"method": "layerskip", "exit_layer": 30, "num_speculative_tokens": 3},
    "shallow": {"method": "layerskip", "exit_layer": 6, "num_speculative_tokens": 4},
    "skip": {
        "method": "layerskip",
        "skip_attn": [3, 7, 11, 15, 19],
        "skip_mlp": [5, 9, 13],
        "num_speculative_tokens": 3,
    },
    # DEL with the raw LM head: shadow tokens every round; it drafts only when an exit pays off,
    # which deep exits do where the text repeats (the long prompt below)
    "del": {"method": "del", "shadow_every": 1, "exit_layers": [16, 20, 24, 28]},
    # the full model drafting through the reduced vocabulary (the embedded model's cached map)
    "vocab": {
        "method": "layerskip",
        "exit_layer": 30,
        "num_speculative_tokens": 3,
        "draft_vocab_size": 4096,
    },
}


def _run(llm) -> dict[str, list[list[int]]]:
    return greedy_one_by_one_and_together(llm, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def vanilla(model_path):
    with engine(model_path, **SETTINGS) as llm:
        return _run(llm)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_parity(model_path, vanilla, name):
    with engine(model_path, speculative_config=CONFIGS[name], **SETTINGS) as llm:
        out = _run(llm)
        stats = vllm_selfspec.get_stats(llm)
    for bs in ("bs1", "bs8"):
        for i, (want, got) in enumerate(zip(vanilla[bs], out[bs])):
            assert got == want, f"{name} {bs} prompt {i}: tokens differ from vanilla vLLM"
    if name == "del":
        # every request's prefill rows were projected at its 4 exit layers (later rounds back off)
        assert stats["shadow_rows"] >= 4 * 2 * len(PROMPTS) * 4
    assert stats["drafted_tokens"] > 0, "the drafter never ran"
    assert stats["accepted_tokens"] > 0, "no draft was accepted: parity proved nothing"
    # every request is greedy: each verifying step took the one-argmax path (greedy_verify.py)
    assert stats["greedy_verifications"] > 0 and stats["sampled_verifications"] == 0
    if name == "vocab":
        # full-depth drafts miss only where the target's token is outside the 4096 (and the
        # drafts after it); a wrong column -> token mapping would reject nearly everything
        assert stats["accepted_tokens"] >= 0.5 * stats["drafted_tokens"]
    elif name == "full":
        # the full model drafting for itself must be accepted every time
        assert stats["accepted_tokens"] == stats["drafted_tokens"]
    elif name != "del":  # shallow drafts: some must be rejected
        assert stats["accepted_tokens"] < stats["drafted_tokens"]

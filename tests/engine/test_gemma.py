"""Greedy parity with vanilla vLLM on a second real model: Gemma-3-270M (base, 18 layers, real
weights; ``vllm-selfspec prepare-model --model gemma3-270m``, ``make model-gemma``).

What it adds to the embedded model's parity tests (``test_parity.py``): Gemma 3's layer form
(``layouts.GemmaLayout``) and its KV cache in six KV-cache groups (five sliding-window layers, 512
tokens, to each full-attention layer), on trained weights. Same settings as ``test_parity.py``:
prefix caching on, chunked prefill with a 128-token budget (the long prompt spans several chunks),
the prompts one at a time ("bs1") and all together ("bs8").

The suite runs the full model drafting for itself, 16 tokens per prompt (every draft must be
accepted: a draft step that read another group's KV, or a layer form off by one norm, is not).
``SELFSPEC_ALL_METHODS=1`` runs 32 tokens per prompt and adds a shallow exit (real drafts, some
rejected) and every other method (AdaDecode's and Cascade's heads built, not trained: each exit
reads the model's own LM head); about 21 minutes here.
"""

from __future__ import annotations

import os

import pytest

import vllm_selfspec
from selfspec_testing import engine, greedy_one_by_one_and_together, save_built_heads

pytestmark = pytest.mark.engine

SHARED_PREFIX = "You are a careful assistant. Answer in one short paragraph. "
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    SHARED_PREFIX + "Why is the sky blue?",
    SHARED_PREFIX + "What does a compiler do?",
    "List three prime numbers:",
    'import numpy as np\n\ndef softmax(x):\n    """Numerically stable softmax."""\n',
    # longer than one 128-token prefill chunk
    "Summarise the following text.\n"
    + " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(30)),
    "Once upon a time",
]
SETTINGS = dict(
    max_num_seqs=8,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
    max_num_batched_tokens=128,
)
ALL = os.environ.get("SELFSPEC_ALL_METHODS") == "1"
#: a step of this model takes ~0.3 s here (its 262k-token LM head): the suite runs 16 tokens
MAX_TOKENS = 32 if ALL else 16
CONFIGS = {
    "full": {"method": "layerskip", "exit_layer": 18, "num_speculative_tokens": 3},
    "shallow": {"method": "layerskip", "exit_layer": 12, "num_speculative_tokens": 3},
    "del": {"method": "del", "shadow_every": 1, "exit_layers": [10, 12, 14, 16]},
    "knapspec": {"method": "knapspec", "num_speculative_tokens": 3, "interval": 8},
    "adadecode": {"method": "adadecode", "threshold": 0.5, "num_speculative_tokens": 3},
    "cascade": {"method": "cascade", "num_speculative_tokens": 3},
    "auto": {"method": "auto"},
}
RUN = list(CONFIGS) if ALL else ["full"]
HEAD_LAYERS = (10, 12, 14, 16)


@pytest.fixture(scope="module")
def gemma_path() -> str:
    from vllm_selfspec.checkpoints import prepare_model

    return str(prepare_model("gemma3-270m", progress=False))


@pytest.fixture(scope="module")
def vanilla(gemma_path):
    with engine(gemma_path, **SETTINGS) as llm:
        return greedy_one_by_one_and_together(llm, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("name", RUN)
def test_gemma3_greedy_parity(gemma_path, vanilla, name, tmp_path):
    spec = dict(CONFIGS[name])
    if name in ("adadecode", "cascade"):
        spec["heads"] = save_built_heads(gemma_path, tmp_path / "heads", name, HEAD_LAYERS)
    with engine(gemma_path, speculative_config=spec, **SETTINGS) as llm:
        out = greedy_one_by_one_and_together(llm, PROMPTS, MAX_TOKENS)
        stats = vllm_selfspec.get_stats(llm)
    for bs in ("bs1", "bs8"):
        for i, (want, got) in enumerate(zip(vanilla[bs], out[bs])):
            assert got == want, f"{name} {bs} prompt {i}: tokens differ from vanilla vLLM"
    if name == "knapspec":  # its search ran on the model (it may find no skip set that pays)
        assert stats["optimisations"] > 0, stats
        return
    assert stats["drafted_tokens"] > 0, "the drafter never ran"
    assert stats["accepted_tokens"] > 0, "no draft was accepted: parity proved nothing"
    if name == "full":  # the full model drafting for itself is accepted every time
        assert stats["accepted_tokens"] == stats["drafted_tokens"], stats
    elif name == "shallow":
        assert stats["accepted_tokens"] < stats["drafted_tokens"], "no draft was rejected"

"""Model families beside Llama, each for what it adds to the engine:

* Qwen2 (biased q/k/v projections) and Qwen3 (RMSNorms on q and k) keep vLLM's Llama
  decoder-layer form (``layouts.LlamaLayout``);
* Mistral with a sliding window on every layer: one KV-cache group with a window;
* Gemma 2 and 3 (``layouts.GemmaLayout``): a norm after each sub-layer, scaled embeddings,
  sliding-window and full-attention layers interleaved, so vLLM keeps their KV in several
  KV-cache groups (``engine/kv_groups.py``); Gemma 2 soft-caps attention and final logits, and
  vLLM's Gemma models have no EAGLE-3 hook (DEL's capture goes through the layout's forward).

Tiny random-weight models (4 layers, 4 heads / 2 KV heads, window 16 where there is one; prompts
and outputs run past it), with layers 2 and 3 passing the residual stream through, so an exit at
layer 2 names the model's own next token: drafts are made and accepted by construction. Greedy
output must equal vanilla vLLM's one request at a time and as a batch. LayerSkip's exit-2 drafts
must all be accepted: a draft step that read or wrote another KV-cache group's blocks is not
(that bug keeps the output, which verification rewrites, and loses most acceptance: 17 of 23
accepted on Gemma 3 when every group was given group 0's block table).
"""

from __future__ import annotations

import pytest

import vllm_selfspec
from selfspec_testing import (
    engine,
    greedy_one_by_one_and_together,
    save_built_heads,
    save_passthrough_top,
    save_tiny_model,
)

pytestmark = pytest.mark.engine
VOCAB = 512
KW = dict(
    skip_tokenizer_init=True,
    max_model_len=256,
    max_num_seqs=8,
    kv_cache_memory_bytes=1 << 27,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
)
PROMPTS = [
    {"prompt_token_ids": [(7 * i + 3 * j) % VOCAB for j in range(3 + 5 * i)]} for i in range(6)
]
MAX_TOKENS = 24


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    """Engine core and worker in the test process: a tiny model's engine then starts in ~10 s
    instead of ~30 s (no process imports vLLM anew)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _model(family: str, tmp_path) -> str:
    random = save_tiny_model(tmp_path / "random", VOCAB, family)
    return save_passthrough_top(random, tmp_path / "passthrough", keep=2)


def _spec(method: str, model: str, tmp_path) -> dict:
    if method == "layerskip":
        return {"method": "layerskip", "exit_layer": 2, "num_speculative_tokens": 3}
    if method == "del":
        return {"method": "del", "exit_layers": [1, 2], "shadow_every": 1, "capture_tokens": 4}
    # identity heads read the model's own LM head at their layer; a threshold below 1/VOCAB
    # makes every head confident (exit 2 is exact, exit 1 mostly rejected)
    heads = save_built_heads(model, tmp_path / "heads", "adadecode", (1, 2))
    return {"method": "adadecode", "heads": heads, "threshold": 0.001, "num_speculative_tokens": 3}


# one method per family keeps the suite short: all run the partial forward over the paged KV
# cache; AdaDecode's rounds are also resumed by the target forward's finishing pass, DEL
# captures hidden states during verification
@pytest.mark.parametrize(
    "family,method",
    [
        ("qwen2", "layerskip"),
        ("qwen3", "adadecode"),
        ("mistral", "layerskip"),
        ("gemma2", "del"),
        ("gemma3", "layerskip"),
    ],
)
def test_greedy_parity_on_another_family(family, method, tmp_path):
    model = _model(family, tmp_path)
    with engine(model, **KW) as llm:
        vanilla = greedy_one_by_one_and_together(llm, PROMPTS, MAX_TOKENS)
    with engine(model, speculative_config=_spec(method, model, tmp_path), **KW) as llm:
        got = greedy_one_by_one_and_together(llm, PROMPTS, MAX_TOKENS)
        stats = vllm_selfspec.get_stats(llm)
    assert got == vanilla
    assert stats["drafted_tokens"] > 0, "the drafter never ran"
    assert stats["accepted_tokens"] > 0, "no draft was accepted: parity proved nothing"
    if method == "layerskip":  # exit 2 is exact by construction
        assert stats["accepted_tokens"] >= 0.95 * stats["drafted_tokens"], stats
    if method == "del":  # its shadow tokens come from the hidden states verification captured
        assert stats["shadow_rows"] > 0, stats

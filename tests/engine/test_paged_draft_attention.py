"""The drafter's own paged attention (engine/draft_attention.py, ``VLLM_SELFSPEC_DRAFT_ATTENTION=
paged``), on the CPU: the kernel's PyTorch reference, with the interface the Triton kernels have
on CUDA, reading and writing vLLM's CPU cache through strided views (``compat.paged_kv_views``).

For each draft forward that runs attention (sub-layers, whole layers and row subsets of mixed
plans, KnapSpec's read-only search, AdaDecode's deferred rounds): greedy output equals
vanilla vLLM's, drafts were made and accepted, every draft forward's attention was the kernel's,
and the drafts are as good as with vLLM's own attention. The last check is what catches a misread
cache: parity holds whatever the drafts are (the target verifies them), but attention over the
wrong keys drafts tokens the target rejects."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

import vllm_selfspec
from selfspec_testing import engine, rotate_layerskip_plans, save_built_heads, token_ids
from vllm_selfspec import compat
from vllm_selfspec.engine import draft_attention

pytestmark = pytest.mark.engine

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "List three uses of copper:",
    "import os\n\nfor name in os.listdir('.'):\n",
]
MAX_TOKENS = 32


def sub_layers(monkeypatch, model_path, tmp_path) -> dict:
    """Attention and MLP sub-layers one at a time, some skipped."""
    return {
        "method": "layerskip",
        "exit_layer": 30,
        "skip_attn": [3, 9],
        "skip_mlp": [5],
        "num_speculative_tokens": 3,
    }


def mixed_plans(monkeypatch, model_path, tmp_path) -> dict:
    """Three plans in one forward: attention of row subsets, and whole layers (each layer's
    two sub-layers around the kernel) where every row runs both."""
    rotate_layerskip_plans(monkeypatch)
    return {"method": "layerskip", "exit_layer": 30, "num_speculative_tokens": 3}


def knapspec(monkeypatch, model_path, tmp_path) -> dict:
    """KnapSpec: its search reads the cache and writes nothing; its latency model times the
    kernel."""
    return {"method": "knapspec", "interval": 8, "num_speculative_tokens": 4}


def adadecode(monkeypatch, model_path, tmp_path) -> dict:
    """AdaDecode: deferred rounds of several rows per request, finished in the target's
    forward (whose own rows keep vLLM's attention)."""
    heads = save_built_heads(model_path, tmp_path / "heads", "adadecode", (8, 16, 24))
    return {"method": "adadecode", "heads": heads, "threshold": 0.4, "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def vanilla(model_path):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with engine(model_path, max_num_seqs=4) as llm:
        return token_ids(llm.generate(PROMPTS, params, use_tqdm=False))


def _run(model_path, spec, monkeypatch, mode: str):
    """(tokens, stats, kernel calls) of an engine whose draft attention is ``mode``."""
    calls = {"n": 0}
    kernel = draft_attention.paged_attention

    def counted(*args, **kwargs):
        calls["n"] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setenv(compat.DRAFT_ATTENTION_ENV, mode)
    monkeypatch.setattr(draft_attention, "paged_attention", counted)  # the engine is in-process
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with engine(model_path, max_num_seqs=4, speculative_config=spec) as llm:
        out = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
        return out, vllm_selfspec.get_stats(llm), calls["n"]


@pytest.mark.parametrize(
    "setup",
    [sub_layers, mixed_plans, knapspec, adadecode],
    ids=["sub-layers", "mixed-plans", "knapspec", "adadecode"],
)
def test_paged_draft_attention_drafts_as_vllms_attention(
    model_path, vanilla, monkeypatch, tmp_path, setup
):
    spec = setup(monkeypatch, model_path, tmp_path)
    got, stats, calls = _run(model_path, spec, monkeypatch, "paged")
    assert got == vanilla, "paged draft attention changed the output"
    assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] > 0, stats
    assert calls > 0, "no draft forward ran the paged kernel"
    _, backend, backend_calls = _run(model_path, spec, monkeypatch, "backend")
    assert backend_calls == 0
    rate = stats["accepted_tokens"] / stats["drafted_tokens"]
    backend_rate = backend["accepted_tokens"] / backend["drafted_tokens"]
    assert rate >= 0.8 * backend_rate, (
        f"drafts through the kernel are accepted at {rate:.2f}, through vLLM's attention at "
        f"{backend_rate:.2f}: the kernel does not read what vLLM's attention reads"
    )


def test_paged_mode_refuses_what_the_kernel_cannot_serve(tmp_path, monkeypatch):
    """``paged`` on a model the kernel cannot serve (Gemma 3: q/k norms, sliding windows) fails
    at start-up, naming why; ``auto`` there keeps vLLM's attention."""
    from selfspec_testing import save_tiny_model

    gemma = save_tiny_model(tmp_path / "gemma", vocab=256, family="gemma3")
    spec = {"method": "layerskip", "exit_layer": 2, "num_speculative_tokens": 2}
    kw = dict(skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=1 << 27)
    monkeypatch.setenv(compat.DRAFT_ATTENTION_ENV, "paged")
    with pytest.raises(Exception, match="paged kernel cannot serve this model"):
        with engine(gemma, speculative_config=spec, **kw):
            pass
    monkeypatch.setenv(compat.DRAFT_ATTENTION_ENV, "auto")
    with engine(gemma, speculative_config=spec, **kw) as llm:  # vLLM's attention: it serves
        out = llm.generate([{"prompt_token_ids": [1, 5, 9]}], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4

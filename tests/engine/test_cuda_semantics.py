"""What CUDA does differently from the CPU, run on the CPU: greedy parity of the drafters with
vLLM's fused add + RMSNorm writing in place, as its CUDA kernel does."""

from __future__ import annotations

import pytest

import vllm_selfspec
from selfspec_testing import engine, rotate_layerskip_plans, token_ids
from vllm_testing import cuda_inplace_add_rmsnorm

pytestmark = pytest.mark.engine

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "List three uses of copper:",
]
MAX_TOKENS = 24


def exit_plan(monkeypatch) -> dict:
    """Whole layers to an exit, then the model's final norm and head."""
    return {"method": "layerskip", "exit_layer": 28, "num_speculative_tokens": 3}


def sub_layers(monkeypatch) -> dict:
    """Attention and MLP sub-layers one at a time, some skipped."""
    return {
        "method": "layerskip",
        "exit_layer": 30,
        "skip_attn": [3, 9],
        "skip_mlp": [5],
        "num_speculative_tokens": 3,
    }


def mixed_plans(monkeypatch) -> dict:
    """Requests of three plans in one forward: each layer's norm on a subset of the rows."""
    rotate_layerskip_plans(monkeypatch)
    return {"method": "layerskip", "exit_layer": 30, "num_speculative_tokens": 3}


@pytest.mark.parametrize(
    "setup", [exit_plan, sub_layers, mixed_plans], ids=["exit", "sub-layers", "mixed-plans"]
)
def test_parity_with_add_rmsnorm_in_place(model_path, monkeypatch, setup):
    spec = setup(monkeypatch)
    calls = cuda_inplace_add_rmsnorm(monkeypatch)  # the engines run in this process
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with engine(model_path) as llm:
        want = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
    with engine(model_path, speculative_config=spec) as llm:
        got = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
        stats = vllm_selfspec.get_stats(llm)
    assert calls["n"] > 0, "the in-place norm never ran"
    assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] > 0
    assert got == want

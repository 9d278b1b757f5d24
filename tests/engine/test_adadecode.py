"""AdaDecode on the embedded model: early predictions with deferred deep layers keep vanilla
vLLM's greedy output token for token, under continuous batching and under a token budget that
makes the scheduler verify requests steps after they drafted; and the finishing pass really
resumes the early tokens (their shallow layers are not computed again).

The heads here are built, not trained (AdaDecode heads at their identity initialisation: each
exit reads the model's own LM head at that layer), saved in the real format, with a threshold
low enough that they predict early often and are rejected often, so the test is fast and covers
the wiring and the schedule; training is covered by tests/unit/test_heads.py and the trained
heads by the benchmarks (docs/performance.md).
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams

import vllm_selfspec
from selfspec_testing import engine, save_built_heads, save_tiny_model, token_ids
from vllm_selfspec.config import SelfSpecConfigError

pytestmark = pytest.mark.engine
PROMPTS = [
    "def fibonacci(n):",
    "The three primary colours are",
    "Write a haiku about rain.",
    "import numpy as np\n\ndef normalise(x):",
    "List three uses of a paperclip:",
    "class Stack:\n    def __init__(self):",
]
MAX_TOKENS = 40
L = 30


def build_heads(model_path: str, out, kind: str = "adadecode", layers=(8, 16, 24)) -> str:
    return save_built_heads(model_path, out, kind, layers)


@pytest.fixture(scope="module")
def ada_heads(model_path, tmp_path_factory):
    return str(build_heads(model_path, tmp_path_factory.mktemp("adadecode") / "heads"))


@pytest.fixture(scope="module")
def vanilla(model_path):
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with engine(model_path, max_num_seqs=4) as llm:
        return token_ids(llm.generate(PROMPTS, sp, use_tqdm=False))


def _run(model_path, spec, **kw):
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with engine(model_path, speculative_config=spec, **{"max_num_seqs": 4, **kw}) as llm:
        out = token_ids(llm.generate(PROMPTS, sp, use_tqdm=False))
        return out, vllm_selfspec.get_stats(llm)


def test_adadecode_keeps_parity_and_computes_deep_layers_once(model_path, ada_heads, vanilla):
    spec = {
        "method": "adadecode",
        "heads": ada_heads,
        "threshold": 0.4,
        "num_speculative_tokens": 4,
    }
    got, stats = _run(model_path, spec)
    assert got == vanilla
    # the schedule was exercised: early predictions at several heads, accepted and rejected
    early = stats["early_predictions"]
    assert sum(1 for k in ("8", "16", "24") if early.get(k, {}).get("predicted")) >= 2, early
    assert "cascade_exits" not in stats
    assert 0 < stats["accepted_tokens"] < stats["drafted_tokens"]
    assert max(stats["draft_length_hist"]) >= 2
    lc = stats["layer_computations"]
    # the finishing pass resumed the rows: fewer (token, layer) computations than running every
    # verified row through all layers, and the draft steps' layers are not repeated
    assert lc["verify"] < lc["verified_rows"] * L
    assert lc["per_token"] < lc["draft_then_verify_per_token"]
    assert lc["rounds_dropped"] == 0  # every round was verified in the very next step
    assert stats["policy"]["threshold"] == 0.4


def test_adadecode_parity_when_verified_steps_after_drafting(tmp_path):
    """A token budget of 12 for 12 running requests that draft (a tiny 4-layer model, so that
    prefills are short and all requests run at once): the scheduler verifies some requests steps
    after they drafted (their round then runs from layer 0 again) and some with fewer drafts
    than proposed (only the rows that match resume)."""
    model = save_tiny_model(tmp_path / "tiny", 32, lm_head_scale=60.0)
    heads = build_heads(model, tmp_path / "heads", layers=(1, 2))
    prompts = [{"prompt_token_ids": [3, i % 32, 4]} for i in range(24)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(
        skip_tokenizer_init=True, max_model_len=256, max_num_seqs=12, max_num_batched_tokens=12
    )
    with engine(model, **kw) as llm:
        want = token_ids(llm.generate(prompts, sp, use_tqdm=False))
    spec = {
        "method": "adadecode",
        "heads": str(heads),
        "threshold": 0.5,
        "num_speculative_tokens": 3,
    }
    with engine(model, speculative_config=spec, **kw) as llm:
        got = token_ids(llm.generate(prompts, sp, use_tqdm=False))
        stats = vllm_selfspec.get_stats(llm)
    assert got == want
    lc = stats["layer_computations"]
    assert stats["accepted_tokens"] > 0 and lc["rounds_resumed"] > 0 and lc["rounds_dropped"] > 0


def test_adadecode_config_errors_before_serving(model_path, ada_heads, tmp_path):
    cascade = build_heads(model_path, tmp_path / "cascade", kind="cascade", layers=(8,))
    cases = [
        ({"heads": str(cascade)}, "kind 'cascade'"),
        ({"heads": str(tmp_path / "nope")}, "train-heads --kind adadecode"),
        ({"heads": ada_heads, "threshold": 1.5}, "threshold"),
        ({"heads": ada_heads, "exit_layers": [9]}, "exit_layers"),
    ]
    for extra, msg in cases:
        spec = {"method": "adadecode", **extra}
        with pytest.raises(SelfSpecConfigError, match=msg):
            with engine(model_path, speculative_config=spec):
                pass

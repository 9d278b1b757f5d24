"""vLLM's default mode, compiled (``enforce_eager=False``), as people run it: greedy parity with
compiled vanilla vLLM for every drafter kind and ``auto``, the sampled distribution kept, and the
start-up path compiled mode takes.

Compiled, vLLM's start-up runs its warm-up (``profile_run``: the model's dummy run, then the
rejection sampler twice on dummy spec-decode metadata, the second time all-greedy, which reaches
``GreedyVerification``), and selfspec compiles its draft forwards (``PlanExecutor.warm_up``);
draft steps then run through the compiled layer functions. The other engine tests run eagerly
(each compiled engine start costs a minute or more here); these check what compiling changes.

Models: the embedded one for the full-model canary (the compiled draft layers must agree with
the compiled target, over the real KV cache); the tiny pass-through Llama of ``test_feature.py``
(every layer passes the residual stream through, so any exit names the model's next token:
drafts are accepted on any machine) for the other drafter kinds and ``auto`` (each compile of the
embedded model costs minutes here; the demo and the benchmarks run compiled ``auto`` on it); the
tiny peaked Llama of ``test_sampling.py`` for the distribution test.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
from vllm import SamplingParams

import vllm_selfspec
from selfspec_testing import (
    engine,
    greedy_one_by_one_and_together,
    save_built_heads,
    save_passthrough_top,
    save_tiny_model,
    selfspec_log,
    token_ids,
)
from vllm_selfspec import compat

pytestmark = pytest.mark.engine
COMPILED = {"enforce_eager": False}


def _sibling(name: str):
    """The test module ``tests/engine/<name>.py`` (its models, settings and checks)."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"compiled_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the embedded model ------------------------------------------------------------------------
PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "Summarise the following text.\n"
    + " ".join(f"Paragraph {i}: the river rises in the hills and flows." for i in range(12)),
    "The capital of France is",
]
SETTINGS = dict(max_num_seqs=4, max_num_batched_tokens=128, **COMPILED)
MAX_TOKENS = 32


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    """Engine core and worker in the test process (``selfspec_testing.engine``'s default), the
    draft forwards compiled as the target (compat.compiles_drafts' default)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.delenv(compat.COMPILE_DRAFTS_ENV, raising=False)


@pytest.fixture(scope="module")
def vanilla(model_path):
    with engine(model_path, **SETTINGS) as llm:
        return greedy_one_by_one_and_together(llm, PROMPTS, MAX_TOKENS)


def _parity(want, got, name) -> None:
    for bs in ("bs1", "bs8"):
        for i, (a, b) in enumerate(zip(want[bs], got[bs])):
            assert b == a, f"{name} {bs} prompt {i}: tokens differ from compiled vanilla vLLM"


def test_full_model_canary_compiled(model_path, vanilla, caplog):
    """The plan drafter through all 30 compiled layers: its drafts are the compiled target's own
    tokens (a wrong KV slot, metadata or layer function would reject them), and the start-up
    ran vLLM's compiled warm-up through selfspec's verification and compiled the drafts."""
    spec = {"method": "layerskip", "exit_layer": 30, "num_speculative_tokens": 3}
    with selfspec_log(caplog, logging.INFO):
        with engine(model_path, speculative_config=spec, **SETTINGS) as llm:
            started = vllm_selfspec.get_stats(llm, reset=True)
            out = greedy_one_by_one_and_together(llm, PROMPTS, MAX_TOKENS)
            stats = vllm_selfspec.get_stats(llm)
    # profile_run's all-greedy dummy call of the rejection sampler went through
    # GreedyVerification (drafts [[0]] per dummy request), before any request
    assert started["greedy_verifications"] >= 1 and started["generated_tokens"] == 0, started
    assert "compiled its draft forwards" in caplog.text
    _parity(vanilla, out, "full")
    assert stats["drafted_tokens"] > 0, "the drafter never ran"
    # compiled regionally, a draft layer's arithmetic may differ from the target's whole-model
    # graph in the last bits: near-ties may flip, nothing more
    assert stats["accepted_tokens"] >= 0.95 * stats["drafted_tokens"], stats


# ---- every drafter kind and auto, on a tiny pass-through model -----------------------------------
FEATURE = _sibling("test_feature")  # its tiny model's settings and prompts
TINY = {**FEATURE.KW, **COMPILED}


@pytest.fixture(scope="module")
def passthrough(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compiled-model")
    random = save_tiny_model(tmp / "random", FEATURE.VOCAB)
    return save_passthrough_top(random, tmp / "bigram", keep=0)


@pytest.fixture(scope="module")
def tiny_vanilla(passthrough):
    return _tiny_run(passthrough, None)[0]


def _tiny_run(model, spec):
    sp = SamplingParams(temperature=0, max_tokens=24)
    with engine(model, speculative_config=spec, **TINY) as llm:
        out = token_ids(llm.generate(FEATURE.PROMPTS, sp, use_tqdm=False))
        return out, None if spec is None else vllm_selfspec.get_stats(llm)


#: one config per drafter kind (engine/proposer.py's DRAFTERS); {heads}: built heads of the kind
DRAFTER_KINDS = {
    # plan drafter, a sub-layer skip set: the compiled attention and MLP sub-layer functions
    "plan": {"method": "layerskip", "skip_attn": [1], "skip_mlp": [2], "exit_layer": 3},
    "cascade": {"method": "cascade", "heads": "{heads}", "thresholds": {"1": 0.0, "2": 0.0}},
    # deferred rounds, finished by a layer-by-layer target forward of compiled layers; a
    # threshold under 1 / VOCAB makes every head confident (test_families.py)
    "deferred": {"method": "adadecode", "heads": "{heads}", "threshold": 0.001},
    "feature": {"method": "feature", "heads": "{heads}"},
}
HEAD_LAYERS = {"cascade": (1, 2), "adadecode": (1, 2), "feature": (0,)}


@pytest.mark.parametrize("kind", list(DRAFTER_KINDS))
def test_drafter_kinds_compiled(passthrough, tiny_vanilla, kind, tmp_path):
    spec = {**DRAFTER_KINDS[kind], "num_speculative_tokens": 3, "draft_vocab_size": None}
    if spec.get("heads"):
        method = spec["method"]
        spec["heads"] = save_built_heads(
            passthrough, tmp_path / "heads", method, HEAD_LAYERS[method]
        )
    got, stats = _tiny_run(passthrough, spec)
    assert got == tiny_vanilla, f"{kind}: tokens differ from compiled vanilla vLLM"
    assert stats["drafted_tokens"] > 0, f"{kind} never drafted"
    assert stats["accepted_tokens"] > 0, f"{kind}: no draft accepted, parity proved nothing"


def test_auto_compiled(passthrough, tiny_vanilla):
    """``auto`` under its goodput controller, compiled: lookup drafts made and accepted (the
    tiny model's greedy text falls into cycles that its context repeats)."""
    got, stats = _tiny_run(passthrough, {"method": "auto", "goodput": True})
    assert got == tiny_vanilla, "auto: tokens differ from compiled vanilla vLLM"
    assert stats["lookup_drafted_tokens"] > 0 and stats["token_sources"]["lookup"] > 0, stats


def test_paged_draft_attention_compiled(passthrough, tiny_vanilla, monkeypatch):
    """The drafter's paged attention inside the compiled layer functions: an opaque op (as
    vLLM's attention), one graph for every layer, the kernel run by every draft forward."""
    from vllm_selfspec.engine import draft_attention

    calls = {"n": 0}
    kernel = draft_attention.paged_attention

    def counted(*args, **kwargs):
        calls["n"] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(draft_attention, "paged_attention", counted)
    monkeypatch.setenv(compat.DRAFT_ATTENTION_ENV, "paged")
    spec = {**DRAFTER_KINDS["plan"], "num_speculative_tokens": 3, "draft_vocab_size": None}
    got, stats = _tiny_run(passthrough, spec)
    assert got == tiny_vanilla, "paged draft attention, compiled: tokens differ"
    assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] > 0, stats
    assert calls["n"] > 0, "the compiled draft forwards never ran the paged kernel"


# ---- sampling keeps the target distribution ------------------------------------------------------
def test_gemma_capture_compiled(tmp_path):
    """Gemma 3 with DEL: vLLM's Gemma has no EAGLE-3 hook, so capturing hidden states replaces
    the model's forward (``GemmaLayout.set_capture_layers``) by a loop over the compiled layer
    function. Test_families' tiny Gemma 3 (layers 2 and 3 pass the stream through)."""
    t = _sibling("test_families")
    model = t._model("gemma3", tmp_path)
    kw = {**t.KW, **COMPILED}
    with engine(model, **kw) as llm:
        want = greedy_one_by_one_and_together(llm, t.PROMPTS, t.MAX_TOKENS)
    with engine(model, speculative_config=t._spec("del", model, tmp_path), **kw) as llm:
        got = greedy_one_by_one_and_together(llm, t.PROMPTS, t.MAX_TOKENS)
        stats = vllm_selfspec.get_stats(llm)
    assert got == want, "tokens differ from compiled vanilla vLLM"
    assert stats["shadow_rows"] > 0, "nothing was captured"
    assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] > 0, stats


def test_sampling_keeps_target_distribution_compiled(tmp_path):
    """test_sampling.py's shallow-exit drafter at T = 1, both engines compiled."""
    t = _sibling("test_sampling")
    model = save_tiny_model(tmp_path / "tiny", t.VOCAB, lm_head_scale=60.0)
    with engine(model, **t.KW, **COMPILED) as llm:
        want, want_greedy = t._sample(llm)
    with engine(model, speculative_config=t.SPEC, **t.KW, **COMPILED) as llm:
        got, greedy = t._sample(llm)
        t._assert_drafted(vllm_selfspec.get_stats(llm))
    assert greedy == want_greedy, "greedy requests in a sampled batch changed"
    p = t._min_pvalue(want, got)
    assert p > t.ALPHA, f"compiled self-spec sampling differs from compiled vanilla (p={p:.2e})"

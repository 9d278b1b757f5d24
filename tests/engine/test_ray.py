"""selfspec with Ray:

* vLLM's own Ray executor (``distributed_executor_backend="ray"``), TP=2: vLLM-CPU refuses it by a
  platform check only, which ``tests/ray_cpu/sitecustomize.py`` lifts for the test (two patches,
  said there); greedy output equals vanilla vLLM's under the same executor, and drafts are made
  and accepted;
* an ``LLM`` with a selfspec config in a Ray actor, the way Ray Serve hosts vLLM;
* the worker class that vLLM's Ray executor resolves by qualname imports and pickles in a Ray
  worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec_testing import save_passthrough_top, save_tiny_model
from vllm_selfspec import compat

ray = pytest.importorskip("ray", reason="ray is in the [test] extra")
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
    done = subprocess.run(
        [sys.executable, str(script), model, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["selfspec"] == res["vanilla"]
    assert res["stats"]["drafted_tokens"] > 0 and res["stats"]["accepted_tokens"] > 0
    assert "Worker_TP1" in done.stdout + done.stderr, "not two TP ranks"
    assert "RayWorkerProc" in done.stdout + done.stderr, "not vLLM's Ray executor"


@pytest.fixture(scope="module")
def ray_local():
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20
    )
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class LLMHost:
    """What a Ray Serve replica does: own a vllm.LLM and answer calls."""

    def __init__(self, model: str, spec: dict, engine_kw: dict) -> None:
        from vllm import LLM

        self.llm = LLM(model=model, speculative_config=spec, **engine_kw)

    def generate(self, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams

        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompt_ids],
            SamplingParams(temperature=0, max_tokens=max_tokens),
            use_tqdm=False,
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    def stats(self) -> dict:
        import vllm_selfspec

        return vllm_selfspec.get_stats(self.llm)

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def test_selfspec_llm_in_a_ray_actor(ray_local, model_path, vanilla_refs):
    from vllm_selfspec.loadtest import ENGINE_KW, MAX_TOKENS

    spec = {"method": "layerskip", "exit_layer": 24, "num_speculative_tokens": 3, "goodput": False}
    host = LLMHost.remote(model_path, spec, ENGINE_KW)
    try:
        got = ray.get(
            host.generate.remote([r["prompt"] for r in vanilla_refs], MAX_TOKENS), timeout=900
        )
        stats = ray.get(host.stats.remote())
        ray.get(host.shutdown.remote())
    finally:
        ray.kill(host)
    assert got == [r["output"] for r in vanilla_refs]
    assert stats["drafted_tokens"] > 0 and stats["live_requests"] == 0


@ray.remote(num_cpus=0)
def _resolve_in_ray_worker(qualname: str, proposer_qualname: str) -> tuple[str, str, bool]:
    import cloudpickle
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from vllm_selfspec import compat as c

    worker_cls = resolve_obj_by_qualname(qualname)
    proposer_cls = resolve_obj_by_qualname(proposer_qualname)
    by_reference = cloudpickle.loads(cloudpickle.dumps(worker_cls)) is worker_cls
    return (
        issubclass(worker_cls, c.base_worker_class()) and worker_cls.__name__,
        proposer_cls.__name__,
        by_reference,
    )


def test_worker_class_resolves_and_pickles_in_ray_workers(ray_local):
    name, proposer, by_ref = ray.get(
        _resolve_in_ray_worker.remote(compat.WORKER_CLS, compat.PROPOSER_CLS), timeout=300
    )
    assert (name, proposer, by_ref) == ("SelfSpecWorker", "SelfSpecProposer", True)

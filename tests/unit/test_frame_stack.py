"""The frame-stack chunk cache (vllm_selfspec/frame_stack.py): a loop of calls across a chunk's end
stops mapping a chunk per call once it is installed; the bench names it for its engines."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from vllm_selfspec import frame_stack

needs_compiler = pytest.mark.skipif(
    frame_stack.unsupported() is not None
    or shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is None,
    reason="needs CPython 3.11-3.14 and a C compiler",
)

#: a child process: finds a recursion depth whose innermost call crosses a chunk's end (a page
#: fault per call), then counts the page faults and reused chunks of as many calls, before and
#: after installing the cache
CROSSINGS = textwrap.dedent(
    """
    import json, resource, sys
    from vllm_selfspec import frame_stack

    def deep(n):
        return 0 if n == 0 else deep(n - 1)

    def faults(depth, calls):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(calls):
            deep(depth)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    depth = next(d for d in range(20, 2000) if faults(d, 200) >= 200)
    calls = 2000
    without = faults(depth, calls)
    path = sys.argv[1]
    before = frame_stack.installed(path)
    installed = frame_stack.install(path)
    again = frame_stack.install(path)
    print(json.dumps({"depth": depth, "calls": calls, "without": without,
                      "with": faults(depth, calls), "reused": frame_stack.chunks_reused(path),
                      "installed": installed, "again": again, "before": before,
                      "after": frame_stack.installed(path)}))
    """
)


def test_it_applies_to_this_interpreter_or_says_why():
    reason = frame_stack.unsupported()
    if (3, 11) <= sys.version_info[:2] <= (3, 14) and sys.implementation.name == "cpython":
        assert reason is None or "free-threaded" in reason
    else:
        assert reason


@needs_compiler
def test_calls_across_a_chunk_end_stop_faulting_once_installed(tmp_path):
    path = frame_stack.build(tmp_path)
    assert frame_stack.build(tmp_path) == path  # built once per source and interpreter
    done = subprocess.run(
        [sys.executable, "-c", CROSSINGS, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    r = json.loads(done.stdout.strip().splitlines()[-1])
    calls = r["calls"]
    assert r["without"] >= calls, r  # each call maps a fresh chunk: at least a fault per call
    assert r["with"] < calls // 20, r  # the cached chunk is reused
    assert r["reused"] >= calls - 1, r  # all but the first crossing after installing
    assert (r["installed"], r["again"]) == (True, False), r  # installed once per process
    assert (r["before"], r["after"]) == (False, True), r


@needs_compiler
def test_the_bench_names_the_cache_for_its_engines_or_clears_it(monkeypatch, tmp_path):
    from vllm_selfspec.tools import bench

    monkeypatch.setenv("VLLM_SELFSPEC_HOME", str(tmp_path))
    monkeypatch.setenv(frame_stack.ENV, "/elsewhere/stale.so")
    with bench.frame_stack_cache(False) as state:
        assert state == "off (--no-frame-stack-cache)"
        assert frame_stack.ENV not in os.environ
    with bench.frame_stack_cache(True) as state:
        assert state == "on"
        assert os.path.exists(os.environ[frame_stack.ENV])
        assert os.environ[frame_stack.ENV].startswith(str(tmp_path))
    assert os.environ[frame_stack.ENV] == "/elsewhere/stale.so"  # the environment as it was


def test_a_library_that_cannot_load_is_logged_not_raised(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(frame_stack.ENV, str(tmp_path / "missing.so"))
    if frame_stack.unsupported() is None:
        with caplog.at_level("WARNING", logger="vllm.selfspec"):
            assert frame_stack.install_from_env() is False
        assert "could not be installed" in caplog.text
    monkeypatch.delenv(frame_stack.ENV)
    assert frame_stack.install_from_env() is False

"""The bench's handle on a method's worker process (vllm_selfspec/tools/bench.py, ``_Engine``)."""

import os
import subprocess
import sys
import time

import pytest

from vllm_selfspec.tools.bench import _Engine

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


def test_a_groups_engines_load_together_and_warm_up_one_at_a_time(tmp_path, monkeypatch):
    """A cost model that learnt its prices while the other engines' warm-ups competed for the
    cores carried them into the timed runs (docs/performance.md, "How a figure is made")."""
    from vllm_selfspec.tools import bench

    calls = []

    class FakeEngine:
        def __init__(self, name, spec, log, tmp):
            self.name = name
            calls.append(("start", name))

        def ready(self):
            calls.append(("loaded", self.name))

        def warm_up(self):
            calls.append(("warm", self.name))

        def run(self, start, stop, fresh):
            calls.append(("run", self.name))
            return {"wall_s": 1.0, "tokens": 10, "full_s": 0.5, "full_tokens": 6, "steps": 5}

        def finish(self):
            return {}

        def kill(self):
            pass

    monkeypatch.setattr(bench, "_Engine", FakeEngine)
    configs = {"vanilla": None, "a": {"method": "a"}, "b": {"method": "b"}}
    base = {"prompts": ["p"] * 4, "batch_size": 2}
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)
    bench.run_interleaved(configs, base, 1, 2, tmp_path, tmp_path)
    kinds = [k for k, _ in calls]
    names = ["vanilla", "a", "b"]
    assert calls[:9] == [
        *(("start", n) for n in names),
        *(("loaded", n) for n in names),
        *(("warm", n) for n in names),
    ]
    assert set(kinds[9:]) == {"run"}


def test_full_batch_decode_counts_decode_steps_while_the_batch_is_full():
    """Decode throughput at a standing concurrency: a closed batch's tail (its last requests
    decoding in a thinning batch) and the prefill steps are left out; a run whose requests keep
    in lockstep counts whole but for its prefills."""
    from vllm_selfspec.tools.bench import full_batch_decode

    # 8 requests at batch 4 in lockstep: prefilled at steps 1 and 11, finished at 10 and 20
    lockstep = [
        (0.1 * s, 4, 4 if s in (10, 20) else 0, 4 if s in (1, 11) else 0) for s in range(1, 21)
    ]
    seconds, tokens = full_batch_decode(lockstep, 8, 4)
    assert (round(seconds, 6), tokens) == (1.8, 72)
    # staggered: after step 4, 4 requests are left (still a full batch: step 5 counts); after
    # step 5, 3 (step 6 does not); step 3 prefilled the requests that took the finished ones'
    # places
    steps = [(1.0, 4, 0, 4), (2.0, 4, 1, 0), (3.0, 4, 2, 3), (4.0, 4, 1, 0), (5.0, 4, 1, 0)]
    steps.append((6.0, 3, 3, 0))
    assert full_batch_decode(steps, 8, 4) == (3.0, 12)
    assert full_batch_decode(steps, 3, 4) == (0.0, 0)  # never a full batch
    assert full_batch_decode([], 4, 4) == (0.0, 0)


def _fake_engines(bench, monkeypatch, run) -> None:
    """``bench._Engine`` replaced by a stand-in whose timed runs ``run(name, start, stop, fresh)``
    answers (no process, no pause between runs)."""

    class FakeEngine:
        def __init__(self, name, spec, log, tmp):
            self.name = name

        def ready(self):
            pass

        def warm_up(self):
            pass

        def run(self, start, stop, fresh):
            return run(self.name, start, stop, fresh)

        def finish(self):
            return {}

        def kill(self):
            pass

    monkeypatch.setattr(bench, "_Engine", FakeEngine)
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)


def test_full_batch_speedups_are_same_repeat_ratios_and_repeats_rotate_the_order(
    tmp_path, monkeypatch
):
    from vllm_selfspec.tools import bench

    # tokens/s (whole run, full batch): "a" loses in its closed tail what it gains at full batch
    speed = {"vanilla": (10.0, 10.0), "a": (9.0, 12.0)}
    runs = []

    def run(name, start, stop, fresh):
        runs.append(name)
        whole, full = speed[name]
        steps = 10 if name == "vanilla" else 9
        return {
            "wall_s": 10 / whole,
            "tokens": 10,
            "full_s": 6 / full,
            "full_tokens": 6,
            "steps": steps,
        }

    _fake_engines(bench, monkeypatch, run)
    configs = {"vanilla": None, "a": {"method": "a"}}
    raw, ratios = bench.run_interleaved(
        configs, {"prompts": ["p"] * 4, "batch_size": 2}, 3, 1, tmp_path, tmp_path
    )
    assert ratios["a"] == pytest.approx([0.9] * 3)
    assert raw["a"]["full_batch_ratios"] == pytest.approx([1.2] * 3)
    assert [r["steps"] for r in raw["a"]["runs"]] == [9] * 3  # engine steps, summed per repeat
    # one slice a repeat here; each repeat starts with the next engine (none always runs first)
    assert runs == ["vanilla", "a", "a", "vanilla", "vanilla", "a"]


def test_each_slice_is_a_paired_ratio_and_the_summary_gives_their_interval(tmp_path, monkeypatch):
    """Slice by slice, the method's tokens/s over vanilla's on the same slice (one repeat, two
    slices: 1.25 and 0.8 here, where the repeat's ratio over both slices is 1.0); the summary
    gives their median and a bootstrap interval of it, and the table shows them."""
    from vllm_selfspec.tools import bench

    def run(name, start, stop, fresh):
        wall = {("vanilla", 0): 1.0, ("a", 0): 0.8, ("vanilla", 4): 0.8, ("a", 4): 1.0}
        return {
            "wall_s": wall[name, start],
            "tokens": 10,
            "full_s": 0,
            "full_tokens": 0,
            "steps": 1,
        }

    _fake_engines(bench, monkeypatch, run)
    configs = {"vanilla": None, "a": {"method": "a"}}
    base = {"prompts": ["p"] * 8, "batch_size": 2}
    raw, ratios = bench.run_interleaved(configs, base, 1, 1, tmp_path, tmp_path)
    assert raw["a"]["slice_ratios"] == pytest.approx([1.25, 0.8])
    assert raw["vanilla"]["slice_ratios"] == [1.0, 1.0]
    assert ratios["a"] == pytest.approx([1.0])
    counters = dict.fromkeys(("drafts", "draft_tokens", "accepted_tokens"), 0)
    common = {"token_ids": [[1]], "counters": counters, "selfspec_stats": None}
    common["deterministic"] = True
    a, ref = {**raw["a"], **common}, {**raw["vanilla"], **common}
    out = bench.summarize({"method": "a"}, a, ref, 30, ratios["a"])
    assert out["slice_speedup"] == pytest.approx(1.025)
    assert out["slice_speedup_interval"] == pytest.approx((0.8, 1.25))
    assert "| 1.02x [0.80, 1.25] |" in bench.markdown_table({"a": out})
    # a second vanilla engine (an A/A control, config None) gets its interval; the reference not
    assert bench.summarize(None, a, ref, 30, ratios["a"])["slice_speedup_interval"] is not None
    assert bench.summarize(None, ref, ref, 30, ratios["vanilla"])["slice_speedup_interval"] is None


def test_the_median_interval_is_seeded_and_narrows_with_more_slices():
    from vllm_selfspec.tools.bench import median_interval

    assert median_interval([0.98, 1.02, 1.00, 1.04]) == pytest.approx((0.99, 1.03))  # docstring
    assert median_interval([0.97]) == (0.97, 0.97)
    noisy = [1.0 + 0.05 * ((7 * i) % 11 - 5) / 5 for i in range(44)]  # 0.95 .. 1.05
    few, many = median_interval(noisy[:8]), median_interval(noisy)
    assert few == median_interval(noisy[:8])  # the same values, the same interval
    assert few[0] <= 1.0 <= few[1] and many[0] <= 1.0 <= many[1]
    assert many[1] - many[0] < few[1] - few[0]


def test_summary_gives_engine_steps_against_vanillas():
    """A closed batch gains only where drafts remove engine steps: the summary and its table
    give each method's steps per repeat and their ratio to vanilla's."""
    from vllm_selfspec.tools.bench import markdown_table, summarize

    counters = {"drafts": 4, "draft_tokens": 8, "accepted_tokens": 4}

    def raw(steps):
        runs = [{"wall_s": 1.0, "tokens": 20, "steps": s} for s in steps]
        return {
            "runs": runs,
            "token_ids": [[1, 2]],
            "counters": counters,
            "selfspec_stats": None,
            "deterministic": True,
        }

    ref = raw([20, 21, 20])
    out = summarize({"method": "ngram"}, raw([16, 18, 17]), ref, 30, [1.1, 1.2, 1.0])
    assert out["engine_steps"] == 17
    assert out["engine_steps_ratio"] == pytest.approx(17 / 20)
    assert "| 17 (0.85) |" in markdown_table({"ngram": out})


def test_slices_are_twice_the_batch_unless_given():
    from vllm_selfspec.tools.bench import chunks

    assert chunks(20, 4) == [(0, 8), (8, 16), (16, 20)]
    assert chunks(20, 4, 20) == [(0, 20)]  # one slice: a standing queue until the last wave
    assert chunks(20, 4, 7) == [(0, 7), (7, 14), (14, 20)]


def test_every_engine_runs_the_slices_of_the_given_size(tmp_path, monkeypatch):
    from vllm_selfspec.tools import bench

    ran = []

    def run(name, start, stop, fresh):
        ran.append((name, start, stop, fresh))
        return {"wall_s": 1.0, "tokens": 1, "full_s": 0.0, "full_tokens": 0, "steps": 1}

    _fake_engines(bench, monkeypatch, run)
    base = {"prompts": ["p"] * 10, "batch_size": 2, "slice_size": 6}
    bench.run_interleaved({"vanilla": None, "a": {"method": "a"}}, base, 1, 1, tmp_path, tmp_path)
    assert ran == [
        ("vanilla", 0, 6, True),
        ("a", 0, 6, True),
        ("vanilla", 6, 10, False),
        ("a", 6, 10, False),
    ]

"""selfspec's Prometheus metrics: stats -> metric families, and the collector's RPC pull from a
thread (as vLLM's /metrics handler runs) and from the event loop (last snapshot)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from vllm_selfspec.engine.stats import EngineStats
from vllm_selfspec.metrics import SelfSpecCollector, families
from vllm_selfspec.plans import LayerPlan
from vllm_selfspec.tools.serving import parse_metrics

LABELS = {"model_name": "m", "method": "layerskip"}
L = 6


def _stats() -> dict:
    st = EngineStats()
    st.drafted_tokens, st.accepted_tokens, st.generated_tokens = 10, 4, 20
    st.draft_length_hist.update({0: 1, 2: 3, 3: 1})
    st.plans[LayerPlan.prefix(L, 4)] += 3
    st.plans[LayerPlan.skip(L, skip_attn=[1], skip_mlp=[1, 2])] += 2
    st.seconds.update(draft=1.0, policy=0.5, shadow=0.5, step=4.0)
    d = st.as_dict()
    d["live_requests"] = 2
    return d


class _Static:
    def __init__(self, fams):
        self.fams = fams

    def collect(self):
        return self.fams


def _scrape(collector) -> dict[str, float]:
    reg = CollectorRegistry()
    reg.register(collector)
    return parse_metrics(generate_latest(reg).decode())


def test_stats_histograms():
    d = _stats()
    assert d["exit_layer_hist"] == {4: 3, 6: 2}
    assert d["skipped_sublayer_hist"] == {"attn": {1: 2}, "mlp": {1: 2, 2: 2}}


def test_families():
    m = _scrape(_Static(families(_stats(), LABELS, num_layers=L, max_draft=3)))
    lab = 'method="layerskip",model_name="m"'
    assert m[f"vllm:selfspec_drafted_tokens_total{{{lab}}}"] == 10
    assert m[f"vllm:selfspec_accepted_tokens_total{{{lab}}}"] == 4
    assert m[f"vllm:selfspec_acceptance_rate{{{lab}}}"] == pytest.approx(0.4)
    assert m[f"vllm:selfspec_live_requests{{{lab}}}"] == 2
    # draft length histogram: cumulative buckets 0..3, sum = 2*3 + 3
    assert [
        m[f'vllm:selfspec_draft_length_bucket{{le="{b}",{lab}}}']
        for b in ("0.0", "1.0", "2.0", "3.0", "+Inf")
    ] == [1, 1, 4, 5, 5]
    assert m[f"vllm:selfspec_draft_length_sum{{{lab}}}"] == 9
    assert m[f'vllm:selfspec_exit_layer_bucket{{le="4.0",{lab}}}'] == 3
    assert m[f'vllm:selfspec_exit_layer_bucket{{le="6.0",{lab}}}'] == 5
    assert m[f'vllm:selfspec_skipped_sublayer_rounds_total{{layer="2",{lab},sublayer="mlp"}}'] == 2
    assert m[f'vllm:selfspec_time_seconds_total{{{lab},part="verify"}}'] == 2.0
    assert m[f'vllm:selfspec_time_share{{{lab},part="draft"}}'] == 0.25
    assert families({}, LABELS, L, 3) == []


class _Engine:
    def __init__(self, stats):
        self.stats, self.calls = stats, 0

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method == "selfspec_stats"
        self.calls += 1
        return [dict(self.stats, steps=self.calls), {"ignored": "rank 1"}]


@pytest.fixture
def loop():
    """An event loop running in a thread of its own, as the API server's is."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_collector_pulls_from_a_thread_and_snapshots_on_the_loop(loop):
    engine = _Engine(_stats())
    col = SelfSpecCollector()
    col.follow(engine, loop, LABELS, L, 3)
    col.max_age_s = 0.0  # no coalescing here (test_concurrent_scrapes_share_one_rpc)
    key = 'vllm:selfspec_steps_total{method="layerskip",model_name="m"}'
    assert _scrape(col)[key] == 1  # off the loop: a fresh RPC per scrape, rank 0's stats
    assert _scrape(col)[key] == 2

    async def on_loop():
        first = col.refresh()  # cannot wait on its own loop: the snapshot, refresh scheduled
        await asyncio.sleep(0.05)
        return first, col.refresh()

    first, second = asyncio.run_coroutine_threadsafe(on_loop(), loop).result(5)
    assert first["steps"] == 2 and second["steps"] == 3


def test_cascade_families():
    st = EngineStats()
    st.exit_drafted.update({8: 5, 16: 2, "none": 3})
    st.exit_accepted.update({8: 4})
    st.unverified_tokens = 7
    d = st.as_dict()
    assert "early_predictions" not in d and "unconfident_walks" not in d
    assert list(d["cascade_exits"]) == ["8", "16", "none"]  # by layer, "none" last
    assert d["cascade_exits"]["8"] == {"drafted": 5, "accepted": 4, "acceptance": 0.8}
    m = _scrape(_Static(families(d, {"model_name": "m", "method": "cascade"}, L, 3)))
    lab = 'method="cascade",model_name="m"'
    assert m[f"vllm:selfspec_unverified_tokens_total{{{lab}}}"] == 7
    assert m[f'vllm:selfspec_cascade_exit_tokens_total{{exit="8",{lab},outcome="accepted"}}'] == 4
    assert m[f'vllm:selfspec_cascade_exit_tokens_total{{exit="none",{lab},outcome="drafted"}}'] == 3


def test_adadecode_families():
    from vllm_selfspec.engine.stats import layer_computations

    st = EngineStats()
    st.draft_token_layers, st.verify_token_layers, st.verify_rows = 300, 60, 10
    st.decode_tokens, st.rounds_resumed, st.rounds_dropped = 12, 9, 1
    st.early_predicted.update({16: 4, 8: 5})
    st.early_accepted.update({8: 4})
    st.unconfident_walks = 3
    d = {**st.as_dict(), "layer_computations": layer_computations(st, L)}
    assert "cascade_exits" not in d
    assert list(d["early_predictions"]) == ["8", "16"]  # by head layer
    assert d["early_predictions"]["8"] == {"predicted": 5, "accepted": 4, "acceptance": 0.8}
    lc = d["layer_computations"]
    assert lc["per_token"] == 30.0 and lc["draft_then_verify_per_token"] == (300 + 10 * L) / 12
    m = _scrape(_Static(families(d, {"model_name": "m", "method": "adadecode"}, L, 3)))
    lab = 'method="adadecode",model_name="m"'
    assert m[f'vllm:selfspec_token_layer_computations_total{{{lab},phase="draft"}}'] == 300
    assert m[f'vllm:selfspec_token_layer_computations_total{{{lab},phase="verify"}}'] == 60
    assert m[f'vllm:selfspec_deferred_rounds_total{{{lab},outcome="dropped"}}'] == 1
    early = "vllm:selfspec_early_prediction_tokens_total"
    assert m[f'{early}{{layer="8",{lab},outcome="accepted"}}'] == 4
    assert m[f'{early}{{layer="16",{lab},outcome="predicted"}}'] == 4
    assert m[f"vllm:selfspec_unconfident_walks_total{{{lab}}}"] == 3


def test_statistics_leave_the_engine_as_python_types():
    """vLLM's msgpack encoder refuses numpy types (``builtin`` converts them): one numpy float in
    the controller's state killed the engine's output thread and hung its caller."""
    import msgspec
    import numpy as np

    from vllm_selfspec.engine.stats import builtin

    stats = {"costs": {"line": (np.float64(0.05), 0.002), "draft": np.array([1.0, 2.0])}}
    stats["hist"] = [np.int64(3), "x", None]
    out = builtin(stats)
    assert out == {"costs": {"line": (0.05, 0.002), "draft": [1.0, 2.0]}, "hist": [3, "x", None]}
    assert type(out["costs"]["line"][0]) is float and type(out["hist"][0]) is int
    msgspec.msgpack.encode(out)
    with pytest.raises(TypeError):
        msgspec.msgpack.encode(stats)


class _SlowEngine(_Engine):
    async def collective_rpc(self, method, timeout=None):
        await asyncio.sleep(0.2)  # an RPC waits for the engine's step to end
        return await super().collective_rpc(method, timeout)


def test_concurrent_scrapes_share_one_rpc(loop):
    """50 scrapes at once cost the engine one stats RPC, and scrapes within the snapshot's
    age none: a scrape flood cannot put calls between every engine step."""
    from concurrent.futures import ThreadPoolExecutor

    engine = _SlowEngine(_stats())
    col = SelfSpecCollector()
    col.follow(engine, loop, LABELS, L, 3)
    with ThreadPoolExecutor(50) as pool:
        got = list(pool.map(lambda _: col.refresh()["steps"], range(50)))
    assert engine.calls == 1 and got == [1] * 50
    assert col.refresh()["steps"] == 1 and engine.calls == 1  # within max_age_s
    col.max_age_s = 0.0
    assert col.refresh()["steps"] == 2 and engine.calls == 2  # past it: pulled again


def test_the_workers_stats_rpc_does_not_walk_the_frozen_heap(monkeypatch):
    """``gc.get_freeze_count()`` walks every frozen object (~0.15 s for the worker's start-up
    heap): a stats RPC, which every /metrics scrape may send, must report the start-up count
    instead of stalling the engine for it."""
    import gc
    import types

    from vllm_selfspec.engine.proposer import SelfSpecProposer
    from vllm_selfspec.engine.worker import SelfSpecWorker

    drafter = object.__new__(SelfSpecProposer)
    drafter.stats_dict = lambda: {"drafted_tokens": 1}
    worker = object.__new__(SelfSpecWorker)
    worker.model_runner = types.SimpleNamespace(drafter=drafter)
    worker.selfspec_frozen_objects = 123_456  # what compile_or_warm_up_model counted

    def walk():
        raise AssertionError("a stats RPC walked the frozen heap")

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    out = worker.selfspec_stats()
    assert out["drafted_tokens"] == 1 and out["gc_frozen_objects"] == 123_456

"""selfspec's Prometheus metrics on the OpenAI server's ``/metrics``.

The counters live in the worker processes (``engine/stats.py``). The API server pulls them when
``/metrics`` is scraped, with the same collective RPC as ``vllm_selfspec.get_stats(llm)``
(``selfspec_stats`` on every worker; TP ranks are replicas, rank 0's are used), so the offline
API and the metrics always show the same numbers. vLLM's own ``vllm:spec_decode_*`` counters are
untouched (they are counted by the scheduler).

How the pull works: the plugin registers one collector in the API server process's default
Prometheus registry (the one vLLM's ``/metrics`` serves) when an ``AsyncLLM`` with a selfspec
config is created. vLLM serves ``GET /metrics`` from a worker thread, so the collector waits there
for the RPC on the server's event loop (timeout ``RPC_TIMEOUT_S``); called on the event loop itself
it cannot wait, so it serves the last snapshot and schedules a refresh. Pulls are coalesced: a
scrape within ``SNAPSHOT_MAX_AGE_S`` of the last pull gets its snapshot, and concurrent scrapes
share one RPC, so a flood of scrapes cannot put calls between every engine step. With several API server
processes (``--api-server-count > 1``) vLLM switches to multiprocess Prometheus mode, which only
exports metrics files: selfspec's metrics are then absent (use ``get_stats`` or one API server).

``families(stats, ...)`` (stats dict -> metric families) is pure and unit-tested.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from . import compat
from .engine.stats import merge

logger = logging.getLogger(compat.LOGGER_NAME)

PREFIX = "vllm:selfspec_"
RPC_TIMEOUT_S = 10.0
#: a scrape within this many seconds of the last pull is served its snapshot: a flood of scrapes
#: costs the engine one RPC (between two steps) per this long, whatever their number
SNAPSHOT_MAX_AGE_S = 2.0
TIME_PARTS = ("draft", "verify", "policy", "lookup", "shadow", "optimise", "controller")

#: counters: stats key -> (metric name without prefix and "_total", documentation)
COUNTERS = {
    "steps": ("steps", "Runner steps that sampled at least one token."),
    "generated_tokens": ("generated_tokens", "Tokens emitted (accepted drafts + one per round)."),
    "target_rounds": ("target_rounds", "Per-request verification rounds that emitted tokens."),
    "drafted_tokens": ("drafted_tokens", "Draft tokens verified by the target."),
    "accepted_tokens": ("accepted_tokens", "Draft tokens the target accepted."),
    "draft_rounds": ("draft_rounds", "Per-request rounds that drafted at least one token."),
    "draft_layers": (
        "draft_layers",
        "Decoder layers run by draft steps, summed over requests (a sub-layer counts half).",
    ),
    "target_layers": (
        "target_layers",
        "Decoder layers run by verifications, summed over requests.",
    ),
    "shadow_rows": ("shadow_rows", "(layer, token) rows projected into shadow tokens."),
    "unverified_tokens": (
        "unverified_tokens",
        "Tokens emitted from early exits WITHOUT verification (cascade lossy mode only).",
    ),
    "invalid_draft_rows": (
        "invalid_draft_rows",
        "Draft rows with non-finite logits (NaN or inf), which drafted nothing.",
    ),
    "unconfident_walks": (
        "unconfident_walks",
        "AdaDecode: draft walks that found no confident head (each ends its round).",
    ),
    "lookup_drafted_tokens": (
        "lookup_drafted_tokens",
        "Context-lookup draft tokens verified (also in drafted_tokens).",
    ),
    "lookup_accepted_tokens": (
        "lookup_accepted_tokens",
        "Context-lookup draft tokens accepted (also in accepted_tokens).",
    ),
    "lookup_shared_accepted_tokens": (
        "lookup_shared_accepted_tokens",
        "Accepted context-lookup draft tokens the shared index proposed: other requests' "
        "outputs or the datastore (also in lookup_accepted_tokens).",
    ),
    "draft_probs_missing": (
        "draft_probs_missing",
        "Draft tokens verified whose request left no draft distribution (sampled ones go as "
        "point masses: exact, accepted less). Expected 0.",
    ),
    "placeholder_drafts": (
        "placeholder_drafts",
        "vLLM's placeholder drafts (-1) of requests padded at admission (not drafts).",
    ),
    "seeded_rounds": (
        "seeded_rounds",
        "Rounds of sampled requests with their own seed, decoded without drafts so that their "
        "output is reproducible run to run.",
    ),
    "greedy_verifications": (
        "greedy_verifications",
        "Verifying steps of greedy requests only, verified by one argmax per logits row.",
    ),
    "sampled_verifications": (
        "sampled_verifications",
        "Verifying steps that went through vLLM's rejection sampler (sampled requests, "
        "penalties, logit_bias, logprobs, ...).",
    ),
    "controller_cut_tokens": (
        "controller_cut_tokens",
        "Draft tokens the policies proposed that the goodput controller did not let run.",
    ),
    "controller_plain_steps": (
        "controller_plain_steps",
        "Steps in which the goodput controller let no request self-draft.",
    ),
    "controller_probes": (
        "controller_probes",
        "Probes of the goodput controller (one request drafts to re-measure acceptance and cost).",
    ),
}
GAUGES = {
    "acceptance_rate": ("acceptance_rate", "accepted_tokens / drafted_tokens since start."),
    "tokens_per_layer": (
        "tokens_per_layer",
        "Generated tokens per decoder layer run (vanilla: 1 / num_layers).",
    ),
    "live_requests": ("live_requests", "Requests holding selfspec policy state in the workers."),
}


def families(
    stats: dict[str, Any], labels: dict[str, str], num_layers: int, max_draft: int
) -> list:
    """Prometheus metric families from a ``get_stats`` dict (empty dict: no families)."""
    if not stats:
        return []
    names, values = list(labels), list(labels.values())
    out: list = []
    for key, (name, doc) in COUNTERS.items():
        if key in stats:
            c = CounterMetricFamily(PREFIX + name, doc, labels=names)
            c.add_metric(values, float(stats[key]))
            out.append(c)
    for key, (name, doc) in GAUGES.items():
        if stats.get(key) is not None:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            g.add_metric(values, float(stats[key]))
            out.append(g)

    out.append(
        _histogram(
            HistogramMetricFamily,
            "draft_length",
            "Draft tokens proposed per request and drafting round.",
            names,
            values,
            stats.get("draft_length_hist", {}),
            range(0, max_draft + 1),
        )
    )
    out.append(
        _histogram(
            HistogramMetricFamily,
            "exit_layer",
            "Exit layer (decoder layers the draft ran up to) per drafting round.",
            names,
            values,
            stats.get("exit_layer_hist", {}),
            range(1, num_layers + 1),
        )
    )

    skipped = CounterMetricFamily(
        PREFIX + "skipped_sublayer_rounds",
        "Drafting rounds whose plan skipped this sub-layer (0-based layer, below the exit).",
        labels=[*names, "sublayer", "layer"],
    )
    for kind, per_layer in stats.get("skipped_sublayer_hist", {}).items():
        for layer, rounds in sorted(per_layer.items(), key=lambda kv: int(kv[0])):
            skipped.add_metric([*values, kind, str(layer)], float(rounds))
    out.append(skipped)

    if stats.get("cascade_exits"):
        exits = CounterMetricFamily(
            PREFIX + "cascade_exit_tokens",
            'Cascade draft tokens by emitting exit layer ("none": no '
            "confident exit, the round ended), drafted and accepted.",
            labels=[*names, "exit", "outcome"],
        )
        for layer, row in stats["cascade_exits"].items():
            exits.add_metric([*values, str(layer), "drafted"], float(row["drafted"]))
            exits.add_metric([*values, str(layer), "accepted"], float(row["accepted"]))
        out.append(exits)

    if stats.get("early_predictions"):
        early = CounterMetricFamily(
            PREFIX + "early_prediction_tokens",
            "AdaDecode: tokens predicted early, by the layer of the head that predicted them, "
            "predicted and accepted.",
            labels=[*names, "layer", "outcome"],
        )
        for layer, row in stats["early_predictions"].items():
            early.add_metric([*values, str(layer), "predicted"], float(row["predicted"]))
            early.add_metric([*values, str(layer), "accepted"], float(row["accepted"]))
        out.append(early)

    lc = stats.get("layer_computations")
    if lc:  # AdaDecode
        comp = CounterMetricFamily(
            PREFIX + "token_layer_computations",
            "AdaDecode: (token, layer) computations of decode steps, in "
            "draft walks and in the target forwards that finish them.",
            labels=[*names, "phase"],
        )
        comp.add_metric([*values, "draft"], float(lc["draft"]))
        comp.add_metric([*values, "verify"], float(lc["verify"]))
        rounds = CounterMetricFamily(
            PREFIX + "deferred_rounds",
            "AdaDecode rounds the next target forward resumed at their "
            "depth, or ran from layer 0 again (the request was not "
            "scheduled with the round's tokens in that step).",
            labels=[*names, "outcome"],
        )
        rounds.add_metric([*values, "resumed"], float(lc["rounds_resumed"]))
        rounds.add_metric([*values, "dropped"], float(lc["rounds_dropped"]))
        out += [comp, rounds]

    times = stats.get("time_s", {})
    total = times.get("total") or 0.0
    secs = CounterMetricFamily(
        PREFIX + "time_seconds",
        "Seconds inside the model runner, by part.",
        labels=[*names, "part"],
    )
    share = GaugeMetricFamily(
        PREFIX + "time_share", "Share of the model runner's time, by part.", labels=[*names, "part"]
    )
    for part in TIME_PARTS:
        if part in times:
            secs.add_metric([*values, part], float(times[part]))
            share.add_metric([*values, part], times[part] / total if total else 0.0)
    out += [secs, share]
    return out


def _histogram(cls, name: str, doc: str, names, values, hist: dict, bounds) -> Any:
    counts = {int(k): v for k, v in hist.items()}
    buckets, cum = [], 0.0
    for b in bounds:
        cum += counts.get(b, 0)
        buckets.append((str(float(b)), cum))
    total = float(sum(counts.values()))
    buckets.append(("+Inf", total))
    h = cls(PREFIX + name, doc, labels=names)
    h.add_metric(values, buckets, sum_value=float(sum(k * v for k, v in counts.items())))
    return h


class SelfSpecCollector:
    """One per process; follows the latest selfspec AsyncLLM (held weakly)."""

    def __init__(self) -> None:
        self._engine = lambda: None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._labels: dict[str, str] = {}
        self._num_layers = self._max_draft = 0
        self._snapshot: dict[str, Any] = {}
        self._taken = -float("inf")  # time.monotonic() of the last pull (or failed attempt)
        self.max_age_s = SNAPSHOT_MAX_AGE_S
        self._refreshing = False
        self._lock = threading.Lock()
        self._pulling = threading.Lock()  # one RPC at a time; concurrent scrapes share it

    def follow(
        self,
        engine,
        loop: asyncio.AbstractEventLoop | None,
        labels: dict[str, str],
        num_layers: int,
        max_draft: int,
    ) -> None:
        with self._lock:
            self._engine = weakref.ref(engine)
            self._loop, self._labels = loop, labels
            self._num_layers, self._max_draft = num_layers, max_draft
            self._snapshot = {}
            self._taken = -float("inf")

    def _fresh(self) -> bool:
        return time.monotonic() - self._taken < self.max_age_s

    def describe(self) -> list:  # no fixed names: registering never calls collect()
        return []

    def collect(self) -> Iterator:
        stats = self.refresh()
        yield from families(stats, self._labels, self._num_layers, self._max_draft)

    def refresh(self) -> dict[str, Any]:
        """The stats: the snapshot if it is younger than ``max_age_s``; else, called off the
        event loop, a fresh pull (one at a time: concurrent scrapes wait for the one running
        and share its result); called on the loop, the snapshot, with a refresh scheduled."""
        engine, loop = self._engine(), self._loop
        if engine is None or loop is None or loop.is_closed() or self._fresh():
            return self._snapshot
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            if not self._refreshing:
                self._refreshing = True
                loop.create_task(self._refresh_async(engine))
            return self._snapshot
        with self._pulling:
            if self._fresh():  # another scrape pulled while this one waited
                return self._snapshot
            try:
                fut = asyncio.run_coroutine_threadsafe(self._pull(engine), loop)
                self._snapshot = fut.result(RPC_TIMEOUT_S + 1)
            except Exception as e:  # engine busy or gone: keep serving the last numbers
                logger.debug("vllm-selfspec: stats RPC failed (%r); serving the last snapshot", e)
            self._taken = time.monotonic()  # a failed pull, too, is not retried at once
        return self._snapshot

    @staticmethod
    async def _pull(engine) -> dict[str, Any]:
        return merge(await engine.collective_rpc("selfspec_stats", timeout=RPC_TIMEOUT_S))

    async def _refresh_async(self, engine) -> None:
        try:
            self._snapshot = await self._pull(engine)
        except Exception as e:
            logger.debug("vllm-selfspec: stats RPC failed (%r)", e)
        finally:
            self._taken = time.monotonic()
            self._refreshing = False


_COLLECTOR: SelfSpecCollector | None = None


def install(engine, vllm_config) -> SelfSpecCollector:
    """Export ``engine``'s selfspec stats on this process's default Prometheus registry."""
    global _COLLECTOR
    if _COLLECTOR is None:
        _COLLECTOR = SelfSpecCollector()
        REGISTRY.register(_COLLECTOR)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    opts = compat.selfspec_options(vllm_config) or {}
    labels = {
        "model_name": str(vllm_config.model_config.served_model_name),
        "method": str(opts.get("method", "?")),
    }
    _COLLECTOR.follow(
        engine,
        loop,
        labels,
        vllm_config.model_config.hf_text_config.num_hidden_layers,
        vllm_config.speculative_config.num_speculative_tokens,
    )
    return _COLLECTOR

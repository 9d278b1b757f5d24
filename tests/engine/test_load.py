"""Load and fault test on the served selfspec model (loopback only): 32 concurrent streaming
clients for a bounded time, random aborts mid-stream, greedy and sampled requests, prompts of a
few to a few hundred tokens. No errors; every completed greedy response equals vanilla vLLM's;
no selfspec per-request state left afterwards; the server's memory stays flat.
The longer version: benchmarks/load.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from vllm_selfspec.tools.loadtest import run_load
from vllm_selfspec.tools.serving import parse_metrics

pytestmark = pytest.mark.engine
DURATION_S, CONCURRENCY, ABORT_PROB = 50, 32, 0.25
LAB = '{method="layerskip",model_name="smollm2"}'
LIVE = f"vllm:selfspec_live_requests{LAB}"


def _drafted_accepted_missing(served) -> tuple[float, float, float]:
    m = parse_metrics(served.get("/metrics"))
    return (
        m[f"vllm:selfspec_drafted_tokens_total{LAB}"],
        m[f"vllm:selfspec_accepted_tokens_total{LAB}"],
        m[f"vllm:selfspec_draft_probs_missing_total{LAB}"],
    )


def test_load_with_aborts(served, vanilla_refs):
    before = _drafted_accepted_missing(served)
    res = asyncio.run(
        run_load(
            served.url,
            "smollm2",
            vanilla_refs,
            DURATION_S,
            CONCURRENCY,
            abort_prob=ABORT_PROB,
            seed=1,
            rss_fn=served.rss_bytes,
        )
    )
    summary = res.summary()
    print("load:", json.dumps(summary))
    log = served.log_path.read_text(errors="replace")
    assert not res.errors, (res.errors[:5], log[-6000:])
    assert "Traceback" not in log, log[log.index("Traceback") - 2000 :][:6000]
    assert not res.mismatches, res.mismatches[:3]
    assert res.greedy_checked >= 10 and res.aborted >= 3 and res.completed > res.greedy_checked
    drafted, accepted, missing = (a - b for a, b in zip(_drafted_accepted_missing(served), before))
    assert drafted > 0 and accepted > 0, "no draft accepted under load: parity proved nothing"
    # every sampled draft reached the rejection sampler with its q (requests padded at
    # admission, aborts and chunked prefills mixed in)
    assert missing == 0
    assert "Missing cached draft probabilities" not in log
    deadline = time.monotonic() + 15  # the last removals reach the workers with the next step
    while (live := parse_metrics(served.get("/metrics"))[LIVE]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert live == 0
    # memory: no growth from the first half of the run to the second (KV cache is preallocated)
    first, second = summary["rss_mib_first_half_max"], summary["rss_mib_second_half_max"]
    assert second <= first * 1.05, summary

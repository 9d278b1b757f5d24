"""`vllm serve` with a selfspec config file: greedy completions equal vanilla vLLM's, and the
selfspec metrics appear on /metrics beside vLLM's own spec-decode counters, with the same
drafted/accepted counts; bad request parameters get an OpenAI-style 400, not a 500.

The load and fault test on the same server (loopback only): 32 concurrent streaming clients for a
bounded time, random aborts mid-stream, greedy and sampled requests, prompts of a few to a few
hundred tokens. No errors; every completed greedy response equals vanilla vLLM's; no selfspec
per-request state left afterwards; the server's memory stays flat. The longer version:
benchmarks/load.py."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
from pathlib import Path

import pytest

from vllm_selfspec.tools.loadtest import PROMPTS, cli_args, engine_kw, run_load
from vllm_selfspec.tools.serving import Server, parse_metrics

pytestmark = pytest.mark.engine
#: the served engine's settings, eager as every engine test's (selfspec_testing.ENGINE_KW)
ENGINE_KW = engine_kw(eager=True)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LAB = '{method="layerskip",model_name="smollm2"}'
VLLM_LAB = '{engine="0",model_name="smollm2"}'


@pytest.fixture(scope="module")
def served(model_path, tmp_path_factory):
    """`vllm serve` (vLLM's OpenAI server) on 127.0.0.1 with examples/selfspec-layerskip.json
    and ``"goodput": false``: the metrics and load tests need drafts in every round, which the
    controller would rightly stop on this CPU."""
    tmp = tmp_path_factory.mktemp("serve")
    log = tmp / "server.log"
    config = tmp / "selfspec.json"
    spec = json.loads((EXAMPLES / "selfspec-layerskip.json").read_text())
    config.write_text(json.dumps({**spec, "goodput": False}))
    args = [
        *cli_args(ENGINE_KW),
        "--served-model-name",
        "smollm2",
        "--speculative-config",
        str(config),
    ]
    with Server(model_path, args, log_path=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def vanilla_refs(model_path):
    from selfspec_testing import engine
    from vllm_selfspec.tools.loadtest import greedy_references

    with engine(model_path, **ENGINE_KW) as llm:
        return greedy_references(llm)


def test_served_greedy_equals_vanilla(served, vanilla_refs):
    before = _counts(served)
    for i in (2, 9):  # a short prompt and one spanning two prefill chunks
        out = served.post(
            "/v1/completions",
            {
                "model": "smollm2",
                "prompt": PROMPTS[i],
                "max_tokens": 32,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        assert out["choices"][0]["token_ids"] == vanilla_refs[i]["output"]
        assert out["choices"][0]["prompt_token_ids"] == vanilla_refs[i]["prompt"]
    after = _counts(served)
    assert after["sd"] > before["sd"], "the server never drafted: parity proved nothing"
    assert after["sa"] > before["sa"], "no draft was accepted: parity proved nothing"


def _counts(srv) -> dict[str, float]:
    m = parse_metrics(srv.get("/metrics"))
    return {
        "live": m[f"vllm:selfspec_live_requests{LAB}"],
        "sd": m[f"vllm:selfspec_drafted_tokens_total{LAB}"],
        "sa": m[f"vllm:selfspec_accepted_tokens_total{LAB}"],
        "vd": m[f"vllm:spec_decode_num_draft_tokens_total{VLLM_LAB}"],
        "va": m[f"vllm:spec_decode_num_accepted_tokens_total{VLLM_LAB}"],
    }


def test_metrics_selfspec_and_vllm_counters(served):
    before = _counts(served)
    served.post(
        "/v1/chat/completions",
        {
            "model": "smollm2",
            "max_tokens": 24,
            "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
    )
    # vLLM records its counters as outputs arrive; finished requests reach the workers with
    # the engine's next step: allow a few seconds for both
    deadline = time.monotonic() + 10
    while True:
        now = _counts(served)
        d = {k: v - before[k] for k, v in now.items()}
        done = (d["sd"], d["sa"]) == (d["vd"], d["va"]) and now["live"] == 0
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert d["sd"] > 0 and (d["sd"], d["sa"]) == (d["vd"], d["va"])
    assert now["live"] == 0
    m = parse_metrics(served.get("/metrics"))
    assert 0 <= m[f"vllm:selfspec_acceptance_rate{LAB}"] <= 1
    # examples/selfspec-layerskip.json: exit layer 28, one draft token per round
    assert (
        m['vllm:selfspec_exit_layer_bucket{le="27.0",method="layerskip",model_name="smollm2"}'] == 0
    )
    rounds = m[f"vllm:selfspec_draft_rounds_total{LAB}"]
    assert (
        m['vllm:selfspec_exit_layer_bucket{le="28.0",method="layerskip",model_name="smollm2"}']
        == rounds
    )
    assert m[f"vllm:selfspec_draft_length_sum{LAB}"] == rounds
    shares = [
        m[f'vllm:selfspec_time_share{{method="layerskip",model_name="smollm2",part="{p}"}}']
        for p in ("draft", "verify", "policy", "shadow")
    ]
    assert shares[0] > 0 and shares[1] > 0 and sum(shares) == pytest.approx(1, abs=0.01)


#: request parameters the server must refuse with an OpenAI-style 400 (and go on serving):
#: vLLM's own checks, including its refusal of min_p / logit_bias under speculative decoding
BAD_REQUESTS = {
    "min_p": {"min_p": 0.1},
    "logit_bias": {"logit_bias": {"11": 5}},
    "negative temperature": {"temperature": -1},
    "top_p above 1": {"top_p": 1.5},
    "too many logprobs": {"logprobs": 1000},
    "max_tokens past the context": {"max_tokens": 100_000},
    "n of 0": {"n": 0},
    "invalid JSON schema": {"structured_outputs": {"json": {"type": "no-such-type"}}},
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_parameters_get_a_400(served, case):
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 4, **BAD_REQUESTS[case]}
    with pytest.raises(urllib.error.HTTPError) as err:
        served.post("/v1/completions", body)
    assert err.value.code == 400, err.value.read().decode()
    answer = json.loads(err.value.read())
    assert answer["error"]["code"] == 400 and answer["error"]["message"]
    ok = served.post("/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
    assert len(ok["choices"][0]["text"]) > 0


# ---- load -------------------------------------------------------------------------------------
DURATION_S, CONCURRENCY, ABORT_PROB = 50, 32, 0.25
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
            rss_fn=served.rss_by_process,
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

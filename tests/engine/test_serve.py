"""`vllm serve` with a selfspec config file: greedy completions equal vanilla vLLM's, and the
selfspec metrics appear on /metrics beside vLLM's own spec-decode counters, with the same
drafted/accepted counts; bad request parameters get an OpenAI-style 400, not a 500."""

from __future__ import annotations

import json
import time
import urllib.error

import pytest

from vllm_selfspec.tools.loadtest import PROMPTS
from vllm_selfspec.tools.serving import parse_metrics

pytestmark = pytest.mark.engine
LAB = '{method="layerskip",model_name="smollm2"}'
VLLM_LAB = '{engine="0",model_name="smollm2"}'


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

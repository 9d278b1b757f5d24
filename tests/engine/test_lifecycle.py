"""Per-request policy state: created on a request's first step, dropped when vLLM removes it,
also when the request is aborted mid-generation."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

import vllm_selfspec
from selfspec_testing import engine

pytestmark = pytest.mark.engine


def test_aborted_requests_leave_no_state(model_path):
    spec = {"method": "layerskip", "exit_layer": 10, "num_speculative_tokens": 3}
    with engine(model_path, speculative_config=spec) as llm:
        eng = llm.llm_engine
        sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        for i in range(4):
            eng.add_request(f"r{i}", f"Count from {i} to one hundred:", sp)
        for _ in range(6):
            eng.step()
        assert vllm_selfspec.get_stats(llm)["live_requests"] == 4
        eng.abort_request(["r0", "r1", "r2"])
        final = {}
        while eng.has_unfinished_requests():
            final.update({o.request_id: o for o in eng.step() if o.finished})
        assert list(final) == ["r3"]  # aborted requests end without output
        assert len(final["r3"].outputs[0].token_ids) == 64
        eng.step()  # vLLM hands the removals of the last step to the worker with the next one
        stats = vllm_selfspec.get_stats(llm)
    assert stats["live_requests"] == 0
    assert stats["drafted_tokens"] > 0

"""``engine.proposer.is_decode_step``: which steps are samples of the step-cost model."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_selfspec.engine.proposer import is_decode_step


def step(per_req, spec=None, new=()):
    return SimpleNamespace(
        num_scheduled_tokens=per_req,
        scheduled_spec_decode_tokens=spec or {},
        scheduled_new_reqs=list(new),
    )


def test_plain_and_verifying_steps_are_decode_steps():
    assert is_decode_step(step({"a": 1, "b": 1}))
    assert is_decode_step(step({"a": 4, "b": 1}, {"a": [7, 8, 9]}))


def test_a_short_prefill_chunk_is_not_counted_as_drafts():
    # "c"'s prompt is cached but for its last 9 tokens: scheduled for 9, no drafts
    assert not is_decode_step(step({"a": 4, "c": 9}, {"a": [7, 8, 9]}))
    # the same request admitted: a new request's step is not a sample either
    assert not is_decode_step(step({"a": 1, "c": 1}, new=["c"]))
    assert not is_decode_step(step({}))

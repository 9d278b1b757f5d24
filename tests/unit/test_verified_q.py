"""``engine.proposer.verified_q``: the q rows handed to vLLM's rejection sampler."""

from __future__ import annotations

import torch

from vllm_selfspec.engine.proposer import verified_q

Q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 1.0, 0.0]])
LIKE = torch.zeros(1, 4)


def test_drafts_verified_as_drafted_keep_their_q():
    assert torch.equal(verified_q(Q, torch.tensor([1, 3, 2]), LIKE), Q)
    assert torch.equal(verified_q(Q, torch.tensor([1, 3]), LIKE), Q[:2])  # vLLM cut the tail


def test_rows_vllm_padded_with_minus_one_are_zeros():
    # a structured-output grammar refused the second draft: vLLM verifies [1, -1, -1]; the
    # token sampled in place of the first -1 comes from max(p - q, 0), which must be p
    got = verified_q(Q, torch.tensor([1, -1, -1]), LIKE)
    assert torch.equal(got[0], Q[0])
    assert not got[1:].any()
    p = torch.tensor([0.1, 0.6, 0.2, 0.1])
    residual = torch.clamp(p - got[1], min=0)
    assert torch.allclose(residual / residual.sum(), p)


def test_drafts_without_q_go_as_point_masses():
    got = verified_q(None, torch.tensor([2, 0, -1]), LIKE)
    assert torch.equal(got, torch.tensor([[0.0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]))
    # a q shorter than the verified drafts is not theirs: point masses too
    assert torch.equal(
        verified_q(Q[:1], torch.tensor([2, 0]), LIKE)[1], torch.tensor([1.0, 0, 0, 0])
    )

"""``engine/shadow.py``: shadow projections in bounded chunks give what one projection gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_selfspec.engine import shadow
from vllm_selfspec.plans import LM_HEAD


def projector(tp_size: int) -> shadow.ShadowProjector:
    torch.manual_seed(0)
    d, vocab = 16, 50
    head = torch.randn(vocab, d)
    norm = torch.nn.RMSNorm(d, eps=1e-6)
    norm.variance_epsilon = 1e-6  # vLLM's RMSNorm's name for it
    layout = SimpleNamespace(
        logit_soft_cap=None,
        logit_scale=1.0,
        model=SimpleNamespace(lm_head=SimpleNamespace(weight=head)),
        final_norm_scale=lambda: norm.weight,
        norm=norm,
    )
    ex = SimpleNamespace(
        layout=layout, vocab_ids=None, heads={}, project=lambda x: x @ head.T, vocab_weight=None
    )
    return shadow.ShadowProjector(ex, vocab, tp_size)


@pytest.mark.parametrize("tp_size", [1, 2], ids=["fused", "per-layer"])
@pytest.mark.parametrize("rows", [1, 255, 256, 257, 700])
def test_chunked_projection_equals_one_projection(monkeypatch, tp_size, rows):
    p = projector(tp_size)
    hidden = torch.randn(3, rows, 16)
    chunked = p.project(hidden, [LM_HEAD] * 3)
    monkeypatch.setattr(shadow, "CHUNK_ROWS", 10_000)
    whole = p.project(hidden, [LM_HEAD] * 3)
    assert chunked[0].shape == (3, rows) and torch.equal(chunked[0], whole[0])
    assert torch.allclose(chunked[1], whole[1])


def test_no_projection_holds_more_than_a_chunk_of_logits(monkeypatch):
    p, seen = projector(2), []
    project = p.executor.project
    p.executor.project = lambda x: (seen.append(x.shape[0]), project(x))[1]
    p.project(torch.randn(2, 700, 16), [LM_HEAD] * 2)
    assert max(seen) == shadow.CHUNK_ROWS and sum(seen) == 2 * 700

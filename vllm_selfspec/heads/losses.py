"""Distillation losses against the stored top-k form of the final distribution (see ``data``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import TEMPERATURES


def kl_topk(
    head_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logits: torch.Tensor,
    final_lse: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-row KL(final_T ‖ head_T) over the final top-k tokens plus one "tail" bucket.

    ``final_lse`` is logsumexp(final_logits / T) over the full vocabulary, so the final top-k
    probabilities are exact and the tail holds the rest of its mass. This is the KL of both
    distributions coarsened to (top-k tokens, rest): a lower bound on the full KL that equals it
    when the final distribution's tail is negligible; it still pushes the head's mass off every
    other token. The head's tail mass is 1 − Σ top-k (floored at 1e-6): half the cost of a
    logsumexp over the ~V non-top-k logits, and the floor only matters where the head already
    puts < 1e-6 outside the final top-k. Needs k < vocabulary size (a non-empty tail)."""
    logq = torch.log_softmax(head_logits / temperature, dim=-1)
    logp_k = topk_logits / temperature - final_lse[:, None]
    p_k = logp_k.exp()
    p_tail = (1.0 - p_k.sum(-1)).clamp(min=0.0)
    logq_k = logq.gather(1, topk_ids)
    q_tail = (1.0 - logq_k.exp().sum(-1)).clamp(min=1e-6)
    return (p_k * (logp_k - logq_k)).sum(-1) + torch.xlogy(p_tail, p_tail) - p_tail * q_tail.log()


def adadecode_loss(head_logits, topk_ids, topk_logits, lse) -> torch.Tensor:
    """AdaDecode §2.1: KL(final ‖ head) at temperature 1, batch mean."""
    return kl_topk(head_logits, topk_ids, topk_logits, lse[:, TEMPERATURES.index(1.0)]).mean()


def cascade_loss(
    head_logits, topk_ids, topk_logits, lse, alpha: float = 0.5, temperature: float = 2.0
) -> torch.Tensor:
    """CascadeExit §3.2: α·CE(head, y) + (1−α)·T²·KL(final_T ‖ head_T), batch mean.

    The label ``y`` is the final top-1: in self-distillation the model's own greedy token is the
    ground truth (on generated positions it is exactly the next token). The paper writes the KL
    with the exit first; we use the standard distillation direction (teacher first), the
    same as AdaDecode's. ``temperature`` must be one of ``data.TEMPERATURES``."""
    ce = F.cross_entropy(head_logits, topk_ids[:, 0])
    lse_t = lse[:, TEMPERATURES.index(temperature)]
    kl = kl_topk(head_logits, topk_ids, topk_logits, lse_t, temperature).mean()
    return alpha * ce + (1.0 - alpha) * temperature**2 * kl

"""What the goodput controller chooses among (a ``Candidate`` per request) and what it chooses (a
``Choice``: every request's draft length with the step's predictions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Candidate:
    """One request's draft options this step."""

    max_tokens: int  # the policy's draft length (0: the policy does not draft)
    #: P(first j drafts all accepted), j = 1..max_tokens, non-increasing: a list of floats (a
    #: step builds, scales and ranks a few per request, where numpy's per-call cost would be
    #: most of the work); any sequence of floats is read alike
    accept: Sequence[float]
    row_seconds: float = 0.0  # marginal draft seconds per draft step of this row
    plan_seconds: float = 0.0  # fixed seconds of a draft step of this row's plan
    free: bool = False  # drafts that cost no draft step (context lookup): only verification


def prefer_free(free: Candidate, paid: Candidate, verify_seconds: float) -> bool:
    """A request's option for a step when it has both a free draft (context lookup) and a paid
    one (its self-drafter): the free one where its first token is expected to yield at least as
    many tokens per second of cost. A free token costs its verification; a paid one also its
    share of a draft step, counted whole, as a lone drafting row pays it."""
    if paid.max_tokens <= 0:
        return True
    if free.max_tokens <= 0:
        return False
    paid_cost = verify_seconds + paid.row_seconds + paid.plan_seconds
    return float(free.accept[0]) * paid_cost >= float(paid.accept[0]) * verify_seconds


@dataclass(slots=True)
class Choice:
    tokens: list[int]  # draft length per candidate
    expected_tokens: float  # expected emitted tokens of the next step
    expected_seconds: float  # its predicted seconds (draft steps + target forward)
    plain_seconds: float  # the plain step's predicted seconds
    probe: bool = False  # a probe or a trial after a back-off
    kind: str = ""  # "paid" (some self-drafts), "free" (lookup drafts only), "" (none)
    #: the time calibration its seconds were predicted with (its kind's): the record divides it
    #: out, so the calibration compares with the model's own predictions, not with itself
    scale: float = 1.0

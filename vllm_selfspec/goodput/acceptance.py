"""Acceptance: per request and draft position (or lookup slot), P(draft accepted | the
drafts before it accepted), decayed and shrunk towards the batch-wide figure."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class _Rates:
    tried: np.ndarray
    accepted: np.ndarray
    #: ``AcceptanceTracker.conditional`` of these rates, as of the tracker's observation
    #: ``version`` (a step without verified drafts reads every request's again unchanged)
    cond: np.ndarray | None = None
    version: int = -1


class AcceptanceTracker:
    """P(a draft token is accepted | the drafts before it were), per request and *slot*, from
    verification outcomes: decayed per request, shrunk towards the batch-wide figure of the slot,
    itself shrunk towards the batch-wide overall rate. A slot is the draft position (1..k) for
    self-drafts, the slot (``lookup.slot``: source, match length, estimate) for context-lookup drafts."""

    def __init__(
        self, slots: int, decay: float = 0.9, weight: float = 2.0, prior: float = 0.5
    ) -> None:
        self.k, self.decay, self.weight, self.prior = slots, decay, weight, prior
        self.all = _Rates(np.zeros(slots), np.zeros(slots))
        self._batch: np.ndarray | None = None  # the batch-wide rates, once per observation
        self._version = 0  # observations so far (every request's rates move with the batch's)

    def new_state(self) -> _Rates:
        return _Rates(np.zeros(self.k), np.zeros(self.k))

    def observe(self, state: _Rates, drafted: int, accepted: int, slots=None) -> None:
        """One verification: the first ``accepted`` of ``drafted`` drafts were accepted; draft j
        counts in ``slots[j]`` (default: its position j)."""
        if drafted <= 0:
            return
        reached = min(accepted + 1, drafted)  # drafts whose predecessors were all accepted
        slots = np.arange(drafted) if slots is None else np.asarray(slots[:drafted])
        for r, d in ((state, self.decay), (self.all, 0.995)):
            r.tried *= d
            r.accepted *= d
            np.add.at(r.tried, slots[:reached], 1.0)
            np.add.at(r.accepted, slots[:accepted], 1.0)
        self._batch = None
        self._version += 1

    def conditional(self, state: _Rates) -> np.ndarray:
        """P(accepted | the drafts before it accepted) per slot (read-only: shared until the
        next observation)."""
        if state.version == self._version:
            return state.cond
        w = self.weight
        if self._batch is None:  # read by every request of a step: solved once per observation
            overall = (self.all.accepted.sum() + w * self.prior) / (self.all.tried.sum() + w)
            self._batch = (self.all.accepted + w * overall) / (self.all.tried + w)
        state.cond = (state.accepted + w * self._batch) / (state.tried + w)
        state.cond.setflags(write=False)
        state.version = self._version
        return state.cond

    def cumulative(self, state: _Rates, n: int, slots=None) -> np.ndarray:
        """P(drafts 1..j all accepted) for j = 1..n, draft j in ``slots[j]`` (default j)."""
        cond = self.conditional(state)
        return np.cumprod(cond[:n] if slots is None else cond[np.asarray(slots[:n])])

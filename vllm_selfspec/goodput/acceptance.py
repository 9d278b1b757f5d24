"""Acceptance: per request and draft position (or lookup slot), P(draft accepted | the
drafts before it accepted), decayed and shrunk towards the batch-wide figure."""

from __future__ import annotations

import numpy as np


class _Rates:
    """Decayed counts per slot, kept as ``stored * scale``: decaying every slot is one multiply
    of ``scale``, and an observation touches only the slots it counts (a step observes every
    request, over dozens of lookup slots, in plain Python)."""

    #: below this ``scale`` the stored counts are rescaled (before 1 / scale could overflow)
    RESCALE_BELOW = 1e-100

    def __init__(self, slots: int) -> None:
        self.scale = 1.0
        self.stored_tried = [0.0] * slots
        self.stored_accepted = [0.0] * slots
        self.stored_tried_sum = 0.0
        self.stored_accepted_sum = 0.0

    def decay(self, d: float) -> float:
        """Decays every count by ``d``; returns what a count of 1 is stored as now."""
        self.scale *= d
        if self.scale < self.RESCALE_BELOW:
            s = self.scale
            self.stored_tried = [v * s for v in self.stored_tried]
            self.stored_accepted = [v * s for v in self.stored_accepted]
            self.stored_tried_sum *= s
            self.stored_accepted_sum *= s
            self.scale = 1.0
        return 1.0 / self.scale

    @property
    def tried(self) -> np.ndarray:
        """The decayed count of drafts judged, per slot."""
        return np.array(self.stored_tried) * self.scale

    @property
    def accepted(self) -> np.ndarray:
        """The decayed count of drafts accepted, per slot."""
        return np.array(self.stored_accepted) * self.scale


class AcceptanceTracker:
    """P(a draft token is accepted | the drafts before it were), per request and *slot*, from
    verification outcomes: decayed per request, shrunk towards the batch-wide figure of the slot,
    itself shrunk towards the batch-wide overall rate. A slot is the draft position (1..k) for
    self-drafts, the slot (``lookup.slot``: source, match length, estimate) for context-lookup
    drafts.

    Example: one request whose first draft was accepted and second rejected, twice. Its P of
    the first slot, 1 in its own counts, is shrunk towards the batch's (the same request here,
    itself shrunk towards the overall 0.5); the second's P is near 0, and the cumulative
    product is P(both accepted)::

        >>> t = AcceptanceTracker(3, decay=1.0, weight=1.0)
        >>> s = t.new_state()
        >>> t.observe(s, drafted=2, accepted=1)
        >>> t.observe(s, drafted=2, accepted=1)
        >>> [round(p, 3) for p in t.cumulative(s, 2)]
        [0.944, 0.053]
    """

    def __init__(
        self, slots: int, decay: float = 0.9, weight: float = 2.0, prior: float = 0.5
    ) -> None:
        self.k, self.decay, self.weight, self.prior = slots, decay, weight, prior
        self.all = _Rates(slots)
        #: per slot its batch-wide P (the same for every request), computed when first read
        #: after an observation (a step reads it for every request)
        self._batch: list[float | None] = [None] * slots
        self._shrink: float | None = None  # weight x the overall rate, likewise

    def new_state(self) -> _Rates:
        return _Rates(self.k)

    def observe(self, state: _Rates, drafted: int, accepted: int, slots=None) -> None:
        """One verification: the first ``accepted`` of ``drafted`` drafts were accepted; draft j
        counts in ``slots[j]`` (default: its position j)."""
        if drafted <= 0:
            return
        reached = min(accepted + 1, drafted)  # drafts whose predecessors were all accepted
        if self._shrink is not None:  # read since the last observation (a read sets both)
            self._batch, self._shrink = [None] * self.k, None
        slots = range(drafted) if slots is None else [int(s) for s in slots[:drafted]]
        for r, d in ((state, self.decay), (self.all, 0.995)):
            one = r.decay(d)
            tried, acc = r.stored_tried, r.stored_accepted
            for s in slots[:reached]:
                tried[s] += one
            for s in slots[:accepted]:
                acc[s] += one
            r.stored_tried_sum += one * reached
            r.stored_accepted_sum += one * accepted

    def _overall(self) -> float:
        a, w = self.all, self.weight
        return (a.stored_accepted_sum * a.scale + w * self.prior) / (
            a.stored_tried_sum * a.scale + w
        )

    def conditional(self, state: _Rates) -> np.ndarray:
        """P(accepted | the drafts before it accepted) per slot."""
        return np.array(self._cumulative(state, self.k, None, cumulative=False))

    def cumulative(self, state: _Rates, n: int, slots=None) -> list[float]:
        """P(drafts 1..j all accepted) for j = 1..n, draft j in ``slots[j]`` (default j): a
        list, as a ``Candidate`` takes it (every step reads it for every request)."""
        return self._cumulative(state, n, slots, cumulative=True)

    def _cumulative(self, state: _Rates, n: int, slots, cumulative: bool) -> list[float]:
        a, w = self.all, self.weight
        batch = self._batch
        ss, st, sac = state.scale, state.stored_tried, state.stored_accepted
        out, p = [], 1.0
        for j in range(n):
            s = j if slots is None else slots[j]
            b = batch[s]
            if b is None:  # the slot's batch-wide P, shrunk towards the overall rate
                wo = self._shrink
                if wo is None:
                    wo = self._shrink = w * self._overall()
                b = batch[s] = (a.stored_accepted[s] * a.scale + wo) / (
                    a.stored_tried[s] * a.scale + w
                )
            q = (sac[s] * ss + w * b) / (st[s] * ss + w)
            p = p * q if cumulative else q
            out.append(p)
        return out

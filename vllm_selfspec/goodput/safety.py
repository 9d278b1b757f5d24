"""What keeps speculation from costing more than it earns: the safety net of each kind of draft
against measured plain cycles (``SafetyNet``, ``PlainReference``), and the share of the time that
costly feedback may take (``SearchBudget``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .choice import Choice


@dataclass
class PlainReference:
    """The live figure of a plain cycle's wall seconds: the target line's ``V(B, 0)`` plus what
    plain cycles measured beyond it (the scheduler, sampling, vLLM's bookkeeping; or minus, where
    verification steps bent the line up), a decayed mean over plain cycles. The target line alone
    sees only forwards, and a cost that every speculative step carries (the rejection sampler,
    say) raises it at the plain batch size too, so speculation measured against it looks better
    than it is (docs/architecture.md, "The goodput controller", the safety net)."""

    DECAY = 0.9
    #: a cycle this many times longer than predicted held an idle gap (no requests): not a sample
    MAX_RATIO = 4.0
    over: float = 0.0  # decayed sum of (measured - V(B, 0)) over plain cycles
    count: float = 0.0
    since: int = 0  # steps since the last plain cycle

    def add(self, predicted: float, seconds: float) -> None:
        if seconds > self.MAX_RATIO * predicted:
            return
        self.over = self.DECAY * self.over + (seconds - predicted)
        self.count = self.DECAY * self.count + 1.0
        self.since = 0

    @property
    def overhead(self) -> float:
        """Measured minus predicted seconds of a plain cycle (0 before any was measured)."""
        return self.over / self.count if self.count > 0 else 0.0

    def seconds(self, predicted: float) -> float:
        """A plain cycle's seconds where the target line predicts ``predicted``."""
        overhead = self.over / self.count if self.count > 0 else 0.0  # ``overhead``
        return max(0.5 * predicted, predicted + overhead)


class SafetyNet:
    """The measured record of one kind of speculative step (self-drafts or lookup drafts only):

    * calibration: achieved/predicted extra tokens and extra seconds (beyond the plain step's),
      as decayed sums; the controller scales its next predictions by them, so an over-optimistic
      acceptance estimate (a policy's confidence stop, say) or an unmodelled cost corrects itself;
    * the guard: these steps' tokens per second against plain decoding's at the same batch
      sizes (a ratio of decayed sums). Once it has seen ``MIN_STEPS`` and is below 1, this kind of
      draft pauses for ``pause`` steps (doubling each time, up to a cap) and then starts afresh.

    The sums decay every engine step, whether this kind ran or not, so old evidence fades: a
    kind judged on a workload that has since changed gets tried again. They are kept as
    ``stored * scale`` (as ``acceptance._Rates`` keeps its counts): a step's decay of all seven
    is one multiply of ``scale``, and the ratios (``achieved``, the calibrations) need no scale.

    Example: one step that emitted 3 tokens where plain decoding would have emitted 2 in its
    seconds, then 10 steps without this kind::

        >>> net = SafetyNet(pause=32, max_pause=1024)
        >>> net.record(Choice([2], 3.0, 0.2, 0.1), emitted=3, requests=1, seconds=0.2, plain=0.1)
        >>> for _ in range(10):
        ...     net.tick(False)
        >>> round(net.achieved, 3), round(net.steps, 4), net.idle
        (1.5, 0.9511, 10)
    """

    MIN_STEPS = 12.0
    DECAY = 0.995
    #: below this ``scale`` the stored sums are rescaled (before 1 / scale could overflow)
    RESCALE_BELOW = 1e-100

    def __init__(self, pause: int, max_pause: int) -> None:
        self.pause, self.max_pause = pause, max_pause
        self.paused = 0  # steps left in the current pause
        self.idle = 0  # steps since this kind last ran
        self._reset()

    def _reset(self) -> None:
        self.scale = 1.0
        # decayed sums, each stored divided by ``scale``: this kind's steps; their emitted
        # tokens; what plain decoding would have emitted in their seconds; predicted and
        # achieved extra tokens (over one per request); predicted and achieved extra seconds
        # (over the plain step's)
        self._steps = self._tokens = self._plain_tokens = 0.0
        self._pred_extra = self._real_extra = self._pred_cost = self._real_cost = 0.0
        self._calibrations: tuple[float, float] | None = None

    @property
    def steps(self) -> float:
        """The decayed count of this kind's steps."""
        return self._steps * self.scale

    @property
    def achieved(self) -> float:
        """Tokens per second of this kind's steps over plain decoding's (1 with no evidence)."""
        return self._tokens / self._plain_tokens if self._plain_tokens > 0 else 1.0

    @property
    def open(self) -> bool:
        return self.paused <= 0

    def token_calibration(self) -> float:
        if self._pred_extra * self.scale < 2.0:
            return 1.0
        return min(1.25, max(0.25, self._real_extra / self._pred_extra))

    #: the range of the time calibration. Below 1 it says the cost model prices these steps
    #: dearer than whole cycles measure them; lookup steps sat at a floor of 0.8 for whole runs
    #: at batch 1 and 8 on the CPU, but a floor of 0.5 made `auto` draft more at batch
    #: 8 and lose: a cycle's cost is not all a
    #: closed batch pays for its drafts
    TIME_CALIBRATION = (0.8, 4.0)

    def time_calibration(self) -> float:
        if self._steps * self.scale < self.MIN_STEPS or self._pred_cost <= 0:
            return 1.0
        low, high = self.TIME_CALIBRATION
        return min(high, max(low, self._real_cost / self._pred_cost))

    def calibrations(self) -> tuple[float, float]:
        """(``time_calibration()``, ``token_calibration()``), computed once per step: the
        controller scales every candidate of this kind by them, several times a step."""
        if self._calibrations is None:
            self._calibrations = (self.time_calibration(), self.token_calibration())
        return self._calibrations

    def record(
        self, choice: Choice, emitted: int, requests: int, seconds: float, plain: float
    ) -> None:
        self._calibrations = None
        one = 1.0 / self.scale  # what a sum's 1 is stored as now
        self._steps += one
        self._tokens += emitted * one
        self._plain_tokens += requests * seconds / plain * one
        if not math.isnan(choice.expected_tokens):
            self._pred_extra += (choice.expected_tokens - requests) * one
            self._real_extra += (emitted - requests) * one
        if not math.isnan(choice.expected_seconds):
            self._pred_cost += (choice.expected_seconds - plain) / choice.scale * one
            self._real_cost += max(0.0, seconds - plain) * one
        if self.steps < self.MIN_STEPS:
            return
        if self.achieved < 1.0:  # measured slower than plain
            self.paused = self.pause
            self.pause = min(2 * self.pause, self.max_pause)
            self._reset()  # the next try starts afresh
        else:
            self.pause = max(self.pause // 2, 1)

    def tick(self, ran: bool) -> None:
        """One engine step passed (this kind of draft ran in it or not)."""
        self.idle = 0 if ran else self.idle + 1
        if self.paused > 0:
            self.paused -= 1
        self._calibrations = None
        self.scale *= self.DECAY
        if self.scale < self.RESCALE_BELOW:
            s, self.scale = self.scale, 1.0
            self._steps *= s
            self._tokens *= s
            self._plain_tokens *= s
            self._pred_extra *= s
            self._real_extra *= s
            self._pred_cost *= s
            self._real_cost *= s


@dataclass
class SearchBudget:
    """The share of the engine's time that one kind of costly feedback may take (the proposer
    keeps one budget for KnapSpec's plan searches, one for DEL's hidden-state capture and shadow
    projections): a search is allowed while the searches' seconds stay within ``share`` of all
    seconds (steps and searches together), both as sums decayed per step, so old searches fade and a burst cannot spend
    credit saved up over an idle hour. 2%: a method must stay within 3% of plain decoding when
    its drafts do not pay, and the speculative path's own per-step work already takes part of that
    (docs/architecture.md, "The goodput controller"). Example: at 40 ms a step and 0.6 s a search, a 2% budget
    allows one search in about 735 steps once the sums are settled. ``allows(share)`` asks
    against another share (the controller's ``feedback_share``: less while no self-draft is
    chosen)."""

    share: float = 0.02
    DECAY = 0.999
    spent: float = 0.0  # decayed seconds of searches
    elapsed: float = 0.0  # decayed seconds of steps and searches

    def allows(self, share: float | None = None) -> bool:
        return self.spent <= (self.share if share is None else share) * self.elapsed

    def tick(self, seconds: float) -> None:
        """One engine step of ``seconds`` (searches in it included) passed."""
        self.spent *= self.DECAY
        self.elapsed = self.DECAY * self.elapsed + max(seconds, 0.0)

    def spend(self, seconds: float) -> None:
        self.spent += seconds

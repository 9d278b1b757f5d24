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
        return max(0.5 * predicted, predicted + self.overhead)


@dataclass
class SafetyNet:
    """The measured record of one kind of speculative step (self-drafts or lookup drafts only):

    * calibration: achieved/predicted extra tokens and extra seconds (beyond the plain step's),
      as decayed sums; the controller scales its next predictions by them, so an over-optimistic
      acceptance estimate (a policy's confidence stop, say) or an unmodelled cost corrects itself;
    * the guard: these steps' tokens per second against plain decoding's at the same batch
      sizes (a ratio of decayed sums). Once it has seen ``MIN_STEPS`` and is below 1, this kind of
      draft pauses for ``pause`` steps (doubling each time, up to a cap) and then starts afresh.

    The sums decay every engine step, whether this kind ran or not, so old evidence fades: a
    kind judged on a workload that has since changed gets tried again.
    """

    MIN_STEPS = 12.0
    DECAY = 0.995
    pause: int
    max_pause: int
    paused: int = 0  # steps left in the current pause
    idle: int = 0  # steps since this kind last ran
    steps: float = 0.0  # decayed count of this kind's steps
    tokens: float = 0.0  # their emitted tokens
    plain_tokens: float = 0.0  # what plain decoding would have emitted in their seconds
    pred_extra: float = 0.0  # predicted / achieved extra tokens (over one per request)
    real_extra: float = 0.0
    pred_cost: float = 0.0  # predicted / achieved extra seconds (over the plain step's)
    real_cost: float = 0.0

    @property
    def achieved(self) -> float:
        """Tokens per second of this kind's steps over plain decoding's (1 with no evidence)."""
        return self.tokens / self.plain_tokens if self.plain_tokens > 0 else 1.0

    @property
    def open(self) -> bool:
        return self.paused <= 0

    def token_calibration(self) -> float:
        if self.pred_extra < 2.0:
            return 1.0
        return min(1.25, max(0.25, self.real_extra / self.pred_extra))

    #: the range of the time calibration. Below 1 it says the cost model prices these steps
    #: dearer than whole cycles measure them; lookup steps sat at a floor of 0.8 for whole runs
    #: at batch 1 and 8 on the CPU, but a floor of 0.5 made `auto` draft more at batch
    #: 8 and lose: a cycle's cost is not all a
    #: closed batch pays for its drafts
    TIME_CALIBRATION = (0.8, 4.0)

    def time_calibration(self) -> float:
        if self.steps < self.MIN_STEPS or self.pred_cost <= 0:
            return 1.0
        low, high = self.TIME_CALIBRATION
        return min(high, max(low, self.real_cost / self.pred_cost))

    def record(
        self, choice: Choice, emitted: int, requests: int, seconds: float, plain: float
    ) -> None:
        self.steps += 1.0
        self.tokens += emitted
        self.plain_tokens += requests * seconds / plain
        if not math.isnan(choice.expected_tokens):
            self.pred_extra += choice.expected_tokens - requests
            self.real_extra += emitted - requests
        if not math.isnan(choice.expected_seconds):
            self.pred_cost += (choice.expected_seconds - plain) / choice.scale
            self.real_cost += max(0.0, seconds - plain)
        if self.steps >= self.MIN_STEPS and self.achieved < 1.0:  # measured slower than plain
            self.paused = self.pause
            self.pause = min(2 * self.pause, self.max_pause)
            self.steps = self.tokens = self.plain_tokens = 0.0  # the next try starts afresh
            self.pred_extra = self.real_extra = self.pred_cost = self.real_cost = 0.0
        elif self.steps >= self.MIN_STEPS and self.achieved >= 1.0:
            self.pause = max(self.pause // 2, 1)

    def tick(self, ran: bool) -> None:
        """One engine step passed (this kind of draft ran in it or not)."""
        self.idle = 0 if ran else self.idle + 1
        if self.paused > 0:
            self.paused -= 1
        d = self.DECAY  # every step, every kind: spelt out (a loop over getattr took 3 µs)
        self.steps *= d
        self.tokens *= d
        self.plain_tokens *= d
        self.pred_extra *= d
        self.real_extra *= d
        self.pred_cost *= d
        self.real_cost *= d


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

"""The goodput controller: how many tokens each request of the batch drafts this step.

Pure logic (numpy, no vLLM), unit-tested on synthetic costs in ``tests/unit/test_goodput.py``.
The engine (``engine/proposer.py``) feeds it measured seconds and verification outcomes; each
policy still decides *how* a request drafts (exit layer, skip set, walk); this module decides
*how much*, for the whole batch at once, so that the batch's expected emitted tokens per second
is as high as it can be — and never, as measured, below plain decoding's.

Three parts:

* ``StepCostModel`` — seconds of a target forward as a line in the step's total scheduled tokens
  (plain decode steps included), and of one draft step as ``d0 + d1·layers + d2·layers·rows``;
  both measured online with forgetting. The verify slope is bounded below (a noisy fit must not
  make verification free) and, until the data can tell it, taken as a conservative prior.
* ``AcceptanceTracker`` — per request and draft position j, P(draft j accepted | drafts 1..j-1
  accepted), decayed, shrunk towards the same figure over all requests (the prior of a new one);
  for context-lookup drafts (``lookup.py``) the same per match length.
* ``GoodputController.choose`` — the draft length of every request together (0 allowed).

Worked example (one step, batch of 2, the costs of this project's CPU at batch 2)::

    target forward V(N) = 70 ms + 7 ms · N   (N = scheduled tokens: 2 plain, 2 + drafts)
    draft step         = 5 ms fixed + 4 ms per drafting row
    request a: P(first j drafts accepted) = 0.9, 0.8, 0.7      (a code request)
    request b: P = 0.3, 0.1, 0.03                              (a chat request)

    no drafts:            2 tokens / 84 ms                          = 23.8 tokens/s
    a drafts 1:           2.9 / (84 + 7 + 5 + 4)                    = 29.0
    a drafts 3:           (2 + 2.4) / (84 + 21 + 3·(5 + 4))         = 33.0   <- chosen
    a 3 and b 1:          (2 + 2.4 + 0.3) / (84 + 28 + 3·5 + 4·4)   = 32.9

so request a drafts three tokens and request b none; at batch 16 the same request a would draft
less, because its drafts then lengthen a step that already yields 16 tokens. A request whose
drafts keep failing drafts nothing; every ``probe_every`` steps (doubling while probes fail) one
such request drafts a token again, so its estimate can recover.

The safety net compares what speculation *achieved* with plain decoding at the same batch size:
each speculative step's emitted tokens per second over the fitted plain step's (``B / V(B)``).
While that ratio's running mean is below 1 the controller drafts nothing but probes, so a wrong
cost or acceptance estimate costs a few steps, not a run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


class OnlineFit:
    """y ≈ coef · x for feature vectors x, least squares with forgetting factor ``decay`` per
    sample; coefficients are clipped at ``lower`` and None until ``min_samples`` were seen."""

    def __init__(self, n: int, decay: float = 0.98, lower: float = 0.0,
                 min_samples: float = 3.0) -> None:
        self.decay, self.lower, self.min_samples = decay, lower, min_samples
        self.xtx = np.zeros((n, n))
        self.xty = np.zeros(n)
        self.count = 0.0

    def add(self, x, y: float) -> None:
        x = np.asarray(x, dtype=np.float64)
        self.xtx = self.decay * self.xtx + np.outer(x, x)
        self.xty = self.decay * self.xty + x * y
        self.count = self.decay * self.count + 1.0

    def coefficients(self) -> np.ndarray | None:
        if self.count < self.min_samples:
            return None
        # a light ridge keeps features the data cannot separate (one row count, one plan) at
        # their least-norm values instead of blowing up
        ridge = 1e-6 * max(np.trace(self.xtx), 1e-12)
        coef = np.linalg.solve(self.xtx + ridge * np.eye(len(self.xty)), self.xty)
        return np.maximum(coef, self.lower)


class StepCostModel:
    """Measured seconds of the whole batch's steps (rank 0's under tensor parallelism).

    * target forward: ``V(N) = v0 + v1·N`` over decode/verify steps, N = scheduled tokens;
    * one draft step: ``d0 + d1·layers + d2·layers·rows`` (layers = the plan's layer cost).
    """

    #: an extra verified token costs at least this share of a plain step's seconds per token
    MIN_SLOPE_SHARE = 0.05
    #: until the data separates slope from intercept, assume this share (conservative on a GPU,
    #: where verification is nearly free; measured 4-12 ms of ~60 ms per token on this CPU)
    PRIOR_SLOPE_SHARE = 0.25

    def __init__(self) -> None:
        self.target = OnlineFit(2)
        self.draft = OnlineFit(3)
        self._mean_tokens = self._mean_seconds = 0.0  # decayed means of plain/verify steps
        self._frozen: tuple | None = None

    # ---- measurements ---------------------------------------------------------------------------
    def add_target(self, tokens: int, seconds: float) -> None:
        self.target.add((1.0, tokens), seconds)
        self._mean_tokens = 0.98 * self._mean_tokens + tokens
        self._mean_seconds = 0.98 * self._mean_seconds + seconds

    def add_draft(self, layers: float, rows: int, seconds: float) -> None:
        self.draft.add((1.0, layers, layers * rows), seconds)

    # ---- tensor parallelism: decide from rank 0's figures ------------------------------------
    def state(self) -> tuple:
        return (self._target_line(), self.draft.coefficients())

    def freeze(self, state: tuple | None) -> None:
        self._frozen = state

    # ---- predictions ----------------------------------------------------------------------------
    def _target_line(self) -> tuple[float, float] | None:
        if self._mean_tokens <= 0:
            return None
        per_token = self._mean_seconds / self._mean_tokens  # of the steps seen
        coef = self.target.coefficients()
        spread = self._spread()
        if coef is None or spread < 1.0:  # one token count seen: the slope is not identified
            slope = self.PRIOR_SLOPE_SHARE * per_token
        else:
            slope = max(float(coef[1]), self.MIN_SLOPE_SHARE * per_token)
        mean_x = self._mean_tokens / self.target.count
        mean_y = self._mean_seconds / self.target.count
        return max(0.0, mean_y - slope * mean_x), slope

    def _spread(self) -> float:
        """Standard deviation of the token counts seen (decayed)."""
        c = self.target.count
        if c <= 0:
            return 0.0
        mean = self.target.xtx[0, 1] / c
        return math.sqrt(max(0.0, self.target.xtx[1, 1] / c - mean * mean))

    def target_line(self) -> tuple[float, float] | None:
        """(v0, v1): a target forward of N tokens takes v0 + v1·N seconds; None before data."""
        return self._frozen[0] if self._frozen is not None else self._target_line()

    def draft_coefficients(self) -> np.ndarray | None:
        return self._frozen[1] if self._frozen is not None else self.draft.coefficients()

    def target_seconds(self, tokens: float) -> float | None:
        line = self.target_line()
        return None if line is None else line[0] + line[1] * tokens

    def draft_seconds(self, layers: float, rows: int = 1) -> float | None:
        c = self.draft_coefficients()
        return None if c is None else float(c[0] + c[1] * layers + c[2] * layers * rows)

    def verify_seconds(self, tokens: float, batch: int = 1) -> float | None:
        """A step in which one request verifies ``tokens`` tokens and the other ``batch - 1``
        requests one each (what a policy's per-request time comparisons need)."""
        return self.target_seconds(batch - 1 + tokens)


@dataclass
class _Rates:
    tried: np.ndarray
    accepted: np.ndarray


class AcceptanceTracker:
    """P(a draft token is accepted | the drafts before it were), per request and *slot*, from
    verification outcomes: decayed per request, shrunk towards the batch-wide figure of the slot,
    itself shrunk towards the batch-wide overall rate. A slot is the draft position (1..k) for
    self-drafts, the match length for context-lookup drafts."""

    def __init__(self, slots: int, decay: float = 0.9, weight: float = 2.0,
                 prior: float = 0.5) -> None:
        self.k, self.decay, self.weight, self.prior = slots, decay, weight, prior
        self.all = _Rates(np.zeros(slots), np.zeros(slots))

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

    def conditional(self, state: _Rates) -> np.ndarray:
        """P(accepted | the drafts before it accepted) per slot."""
        w = self.weight
        overall = (self.all.accepted.sum() + w * self.prior) / (self.all.tried.sum() + w)
        batch = (self.all.accepted + w * overall) / (self.all.tried + w)
        return (state.accepted + w * batch) / (state.tried + w)

    def cumulative(self, state: _Rates, n: int, slots=None) -> np.ndarray:
        """P(drafts 1..j all accepted) for j = 1..n, draft j in ``slots[j]`` (default j)."""
        cond = self.conditional(state)
        return np.cumprod(cond[:n] if slots is None else cond[np.asarray(slots[:n])])


@dataclass
class Candidate:
    """One request's draft options this step."""

    max_tokens: int  # the policy's draft length (0: the policy does not draft)
    accept: np.ndarray  # P(first j drafts all accepted), j = 1..max_tokens, non-increasing
    row_seconds: float = 0.0  # marginal draft seconds per draft step of this row
    plan_seconds: float = 0.0  # fixed seconds of a draft step of this row's plan
    free: bool = False  # drafts that cost no draft step (context lookup): only verification


@dataclass
class Choice:
    tokens: list[int]  # draft length per candidate
    expected_tokens: float  # expected emitted tokens of the next step
    expected_seconds: float  # its predicted seconds (draft steps + target forward)
    plain_seconds: float  # the plain step's predicted seconds
    probe: bool = False  # a probe or a trial after a back-off
    kind: str = ""  # "paid" (some self-drafts), "free" (lookup drafts only), "" (none)


@dataclass
class SafetyNet:
    """What one kind of speculative step achieved against plain decoding at the same batch size
    (running mean of the ratio of tokens per second; 1: as good as plain), and the back-off
    while it is below 1: that kind of draft then runs only in a trial every ``interval`` steps
    (doubling while trials fail), whose outcome alone decides what follows."""

    interval: int
    achieved: float = 1.0
    idle: int = 0  # steps since this kind last ran
    #: predicted vs achieved extra tokens of this kind's steps (decayed sums): calibrates the
    #: acceptance estimates against what really happens (e.g. a policy's confidence stops)
    pred_extra: float = 0.0
    real_extra: float = 0.0

    def calibration(self) -> float:
        """Achieved/predicted extra tokens, in [0.25, 1.25] (1 until there is evidence)."""
        if self.pred_extra < 2.0:
            return 1.0
        return min(1.25, max(0.25, self.real_extra / self.pred_extra))

    @property
    def due(self) -> bool:
        """A trial (or probe) is due this step."""
        return self.idle + 1 >= self.interval

    @property
    def open(self) -> bool:
        """This kind of draft may run this step."""
        return self.achieved >= 1.0 or self.due


@dataclass
class GoodputController:
    """Chooses every request's draft length together, from measured costs and acceptance."""

    costs: StepCostModel
    #: speculation must beat plain decoding's predicted goodput by this share to run
    margin: float = 0.03
    #: steps without paid drafts after which one request probes (doubles while probes fail)
    probe_every: int = 16
    max_probe_every: int = 512
    achieved_decay: float = 0.9
    _probe_turn: int = 0
    _pending: Choice | None = None
    #: whether the last choice was a probe or a trial after a back-off (for the stats)
    last_probe: bool = False

    def __post_init__(self) -> None:
        #: steps with self-drafts (paid) and steps with lookup drafts only (free) are judged apart:
        #: a failing self-drafter must not stop free drafts, nor the other way round
        self.nets = {"paid": SafetyNet(self.probe_every), "free": SafetyNet(self.probe_every)}

    @property
    def achieved(self) -> float:
        """The self-drafting steps' achieved/plain goodput (running mean)."""
        return self.nets["paid"].achieved

    def calibration(self) -> float:
        """The self-drafting steps' achieved/predicted extra tokens."""
        return self.nets["paid"].calibration()

    # ---- the choice ------------------------------------------------------------------------
    def choose(self, cands: list[Candidate], tokens: int | None = None) -> Choice:
        """Draft lengths maximising expected emitted tokens / predicted seconds of the next step
        (``tokens``: scheduled tokens of the step without drafts, default one per candidate)."""
        n = len(cands)
        base = float(n if tokens is None else tokens)
        line = self.costs.target_line()
        if line is None or self.costs.draft_coefficients() is None and not all(
                c.free for c in cands if c.max_tokens):
            # nothing measured yet: one draft token per request, so the costs get measured
            return Choice([min(1, c.max_tokens) for c in cands], float("nan"), float("nan"),
                          float("nan"))
        v0, v1 = line
        plain = v0 + v1 * base
        paid, free = self.nets["paid"], self.nets["free"]
        # a kind of draft in back-off is left out of the search, except in its trial steps
        allowed = [c if (free.open if c.free else paid.open) else
                   Candidate(0, c.accept, free=c.free) for c in cands]
        best = Choice([0] * n, float(n), plain, plain)
        best_rate = n / plain * (1.0 + self.margin)
        depth = max((c.max_tokens for c in allowed if not c.free), default=0)
        cal = {True: free.calibration(), False: paid.calibration()}
        for steps in range(depth + 1):
            choice = self._best_for_depth(allowed, steps, base, plain, v1, cal)
            rate = choice.expected_tokens / choice.expected_seconds
            if rate > best_rate:
                best, best_rate = choice, rate
        best.kind = self._kind(cands, best.tokens)
        net = self.nets.get(best.kind)
        best.probe = net is not None and net.achieved < 1.0  # a trial after a back-off
        if best.kind != "paid" and paid.due:
            best = self._probe(cands, best)  # self-drafts have not run for a while: probe
        for kind, net in self.nets.items():
            net.idle = 0 if best.kind == kind else net.idle + 1
        self._pending = best if best.kind else None
        self.last_probe = best.probe
        return best

    @staticmethod
    def _kind(cands: list[Candidate], tokens: list[int]) -> str:
        drafted = [c for c, t in zip(cands, tokens) if t]
        if not drafted:
            return ""
        return "free" if all(c.free for c in drafted) else "paid"

    @staticmethod
    def _best_for_depth(cands, steps, base, plain, v1, cal) -> Choice:
        """With ``steps`` draft steps: the best set of draft tokens. Each token costs one verified
        token plus its row in a draft step (unless free); ranked by expected tokens per second of
        cost, the best set is a prefix of that ranking (a request's tokens come in order, since
        its P is non-increasing and its cost per token constant), the one with the highest
        (tokens / seconds) of the whole step. ``cal[free]`` scales each kind's estimates."""
        n = len(cands)
        width = max((c.max_tokens for c in cands), default=0)
        gain = np.zeros((n, max(width, 1)))
        cost = np.zeros(n)
        fixed = 0.0
        for i, c in enumerate(cands):
            depth = c.max_tokens if c.free else min(c.max_tokens, steps)
            if depth <= 0:
                continue
            gain[i, :depth] = cal[c.free] * c.accept[:depth]
            cost[i] = v1 + (0.0 if c.free else c.row_seconds)
            if not c.free:
                fixed = max(fixed, c.plan_seconds)
        rows, cols = np.nonzero(gain)
        if rows.size == 0:
            return Choice([0] * n, base, plain, plain)
        g = gain[rows, cols]
        order = np.lexsort((cols, -g / np.maximum(cost[rows], 1e-12)))
        total = base + np.cumsum(g[order])
        seconds = plain + steps * fixed + np.cumsum(cost[rows][order])
        best = int(np.argmax(total / seconds))
        tokens = np.bincount(rows[order[:best + 1]], minlength=n)
        return Choice(tokens.tolist(), float(total[best]), float(seconds[best]), plain)

    def _probe(self, cands: list[Candidate], best: Choice) -> Choice:
        """One self-draft token for one request (round robin), to re-measure acceptance; the
        next probe comes twice as late unless self-drafting pays before it."""
        paid = self.nets["paid"]
        paid.interval = min(2 * paid.interval, self.max_probe_every)
        options = [i for i, c in enumerate(cands) if c.max_tokens and not c.free]
        if not options:
            paid.idle = 0
            return best
        i = options[self._probe_turn % len(options)]
        self._probe_turn += 1
        tokens = list(best.tokens)
        tokens[i] = 1
        expected = best.expected_tokens + float(cands[i].accept[0])
        return Choice(tokens, expected, float("nan"), best.plain_seconds, probe=True,
                      kind="paid")

    # ---- what happened ---------------------------------------------------------------------
    def settle(self, emitted: int, requests: int, seconds: float) -> None:
        """The step that verified the last choice emitted ``emitted`` tokens for ``requests``
        requests and took ``seconds`` (its target forward + the draft steps before it)."""
        choice, self._pending = self._pending, None
        if choice is None or seconds <= 0 or requests <= 0:
            return
        plain = self.costs.target_seconds(requests)
        if plain is None:
            return
        ratio = (emitted / seconds) / (requests / plain)
        net = self.nets[choice.kind]
        if choice.probe:  # a trial after a back-off: its outcome alone decides what follows
            net.achieved = ratio
        else:
            d = self.achieved_decay
            net.achieved = d * net.achieved + (1 - d) * ratio
        if net.achieved >= 1.0:
            net.interval = self.probe_every
        elif not choice.probe:
            net.interval = max(net.interval, self.probe_every)
        if not math.isnan(choice.expected_tokens):
            net.pred_extra = 0.95 * net.pred_extra + choice.expected_tokens - len(choice.tokens)
            net.real_extra = 0.95 * net.real_extra + emitted - requests

    def state(self) -> dict:
        return {kind: net.achieved for kind, net in self.nets.items()}

"""The goodput controller: how many tokens each request of the batch drafts this step.

Pure logic (numpy, no vLLM), unit-tested on synthetic costs in ``tests/unit/test_goodput.py``.
The engine (``engine/proposer.py``) feeds it measured seconds and verification outcomes; each
policy still decides *how* a request drafts (exit layer, skip set, walk); this module decides
*how much*, for the whole batch at once, so that the batch's expected emitted tokens per second
is as high as it can be — and never, as measured, below plain decoding's.

Three parts (and ``SearchBudget``, the share of time a plan search may take):

* ``StepCostModel`` — seconds of a target forward as a plane in the step's requests and the
  draft tokens it verifies (plain decode steps included: no drafts), plus what a step pays once
  for verifying any, and of one draft step as ``d0 + d1·layers + d2·layers·rows``; both
  measured online with forgetting, steps with one-time costs left out. The slopes are
  bounded below (a noisy fit must not make verification free) and, until the data can tell
  them, taken as conservative priors. Verification is also priced per step shape (requests,
  draft tokens) where shapes were measured: a forward's time is not a line in its tokens.
* ``AcceptanceTracker`` — per request and draft position j, P(draft j accepted | drafts 1..j-1
  accepted), decayed, shrunk towards the same figure over all requests (the prior of a new one);
  for context-lookup drafts (``lookup.py``) the same per match length.
* ``GoodputController.choose`` — the draft length of every request together (0 allowed); and
  ``look_due``, whether this step's choice is worth its own cost at all (after a choice that
  drafted nothing, one is skipped while choices save less than the proposer takes to make them).

Worked example (one step, batch of 2, round costs of the order docs/performance.md, "Step
costs", reports for the CPU)::

    target forward V(R, D) = 70 ms + 7 ms · R + 7 ms · D   (R = 2 requests, D = their drafts;
                                                            no fixed cost of verifying here)
    draft step         = 5 ms fixed + 4 ms per drafting row
    request a: P(first j drafts accepted) = 0.9, 0.8, 0.7      (a code request)
    request b: P = 0.3, 0.1, 0.03                              (a chat request)

    no drafts:            2 tokens / 84 ms                          = 23.8 tokens/s
    a drafts 1:           2.9 / (84 + 7 + 5 + 4)                    = 29.0
    a drafts 3:           (2 + 2.4) / (84 + 21 + 3·(5 + 4))         = 33.0   <- chosen
    a 3 and b 1:          (2 + 2.4 + 0.3) / (84 + 28 + 3·5 + 4·4)   = 32.9

so request a drafts three tokens and request b none; at batch 16 the same request a would draft
less, because its drafts then lengthen a step that already yields 16 tokens. A request whose
drafts keep failing drafts nothing; every ``probe_every`` steps (doubling while probes fail, no
rarer than a cheap drafter can afford) one such request drafts again, a few tokens, so its
estimate can recover (self-drafts and lookup drafts each on their own clock).

The safety net compares what speculation *achieved* with plain decoding at the same batch size,
both in wall-clock seconds of whole engine cycles (one proposer call to the next: the drafting,
the scheduler, the verifying forward, the rejection sampler and vLLM's bookkeeping, all in):
each speculative cycle's emitted tokens per second over a plain cycle's at its batch size, the
fitted ``B / V(B, 0)`` corrected by what plain cycles measured beyond it (``PlainReference``;
without plain cycles in the last ``plain_every`` steps, the controller runs one). While that
ratio's running mean is below 1 the controller drafts nothing but probes, so a wrong cost or
acceptance estimate, or a cost the model does not see, costs a few steps, not a run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


class OnlineFit:
    """y ≈ coef · x for feature vectors x, least squares with forgetting factor ``decay`` per
    sample; coefficients are clipped at ``lower`` and None until ``min_samples`` were seen."""

    def __init__(
        self, n: int, decay: float = 0.98, lower: float = 0.0, min_samples: float = 3.0
    ) -> None:
        self.decay, self.lower, self.min_samples = decay, lower, min_samples
        self.xtx = np.zeros((n, n))
        self.xty = np.zeros(n)
        self.count = 0.0
        self._coef: np.ndarray | None = None  # solved once per sample (read several times a step)

    def add(self, x, y: float) -> None:
        x = np.asarray(x, dtype=np.float64)
        self.xtx = self.decay * self.xtx + np.outer(x, x)
        self.xty = self.decay * self.xty + x * y
        self.count = self.decay * self.count + 1.0
        self._coef = None

    def coefficients(self) -> np.ndarray | None:
        if self.count < self.min_samples:
            return None
        if self._coef is None:
            # a light ridge keeps features the data cannot separate (one row count, one plan)
            # at their least-norm values instead of blowing up
            ridge = 1e-6 * max(np.trace(self.xtx), 1e-12)
            coef = np.linalg.solve(self.xtx + ridge * np.eye(len(self.xty)), self.xty)
            self._coef = np.maximum(coef, self.lower)
            self._coef.setflags(write=False)  # shared by every reader until the next sample
        return self._coef


class StepCostModel:
    """Measured seconds of the whole batch's steps (rank 0's under tensor parallelism).

    * target forward: ``V(R, D) = v0 + v_row·R + v_tok·D + v_ver·[D > 0]`` over decode/verify
      steps, R = the requests in the step (one sampled token each), D = the draft tokens it
      verifies. Three things are priced apart because they do not cost alike:

      - a request brings its own KV cache, sampling and bookkeeping; a draft token rides along
        in its request's rows. One line in scheduled tokens took its slope from whichever varied
        more in its window (the closed batch's tail thinning, or the drafts) and swung from 2.5
        to 10 ms per token between runs of the same benchmark at batch 8 on this project's CPU;
      - a step that verifies any draft pays once for it (vLLM's rejection sampler and its
        spec-decode metadata in place of the plain sampler): a lone probe token pays it whole,
        a step full of drafts shares it;
      - the machine's speed drifts (the same plain step at 62 and 84 ms a minute apart here).
        Drafting steps are rare where drafts do not pay, so a line fitted over all steps at
        once blamed the drift of the moment on the few drafts in its window (a verified token
        at 7-10 ms against ~2.3). So the plain plane ``v0 + v_row·R`` is fitted on plain steps,
        a fast-moving ``drift`` follows the plain steps' latest residuals (predictions include
        it), and a drafting step is a sample of ``v_tok·D + v_ver`` over *the latest plain
        steps of its size* (a fast average per request count: the speed of the moment),
        fitted on drafting steps alone, so its evidence is not forgotten while no one drafts
        (docs/performance.md, "The cost model"). The same excess is kept per shape
        (requests, draft tokens) and prices the shapes measured and their neighbours, each at
        its mean plus a standard error of it, so noise cannot make a shape look cheap
        (``verify_excess``; docs/performance.md, "The cost model").
    * one draft step: ``d0 + d1·layers + d2·layers·rows`` (layers = the plan's layer cost).
    """

    #: an extra request or verified token costs at least this share of a plain step's seconds per
    #: token
    MIN_SLOPE_SHARE = 0.05
    #: until the data separates a slope from the rest, assume this share (conservative on a GPU,
    #: where verification is nearly free; the CPU: docs/performance.md, "The cost model")
    PRIOR_SLOPE_SHARE = 0.25
    #: each prior slope weighs as much as this many squared count deviations of data (a ridge
    #: towards the prior; the intercept is not penalised)
    PRIOR_WEIGHT = 4.0
    #: the same for the verifying step's fixed cost, prior 0: its feature (any drafts: 0 or 1)
    #: varies by at most 1/4 a step where a count varies by several; light, so that after lone
    #: probe tokens their excess over the token prior goes to the step, and a step of several
    #: drafts gets tried and measured (which then tells the two apart)
    VERIFY_PRIOR_WEIGHT = 0.25
    #: how fast ``drift`` follows plain steps (the share of the old value kept per plain step)
    DRIFT_DECAY = 0.7
    #: a drafting step's seconds over the plain step are also kept per shape (requests, draft
    #: tokens), decayed by this per sample of the shape: a forward's time is not a line in its
    #: tokens. On this project's CPU at batch 1 a 2-token forward took 10 ms *more* than a plain
    #: one, and 3- to 6-token forwards 5-7 ms *less* (the matrix kernels change with the row
    #: count; a GPU's CUDA-graph sizes make steps too), so a line through them priced every
    #: draft length wrongly (docs/performance.md, "The cost model")
    SHAPE_DECAY = 0.9
    #: a shape's mean is shrunk towards the line by this many samples' weight (a shape seen once
    #: or twice is mostly the line)
    SHAPE_PRIOR_WEIGHT = 2.0
    #: how fast the noise of one excess sample (its squared distance from its shape's mean, pooled
    #: over shapes) is followed (the share of the old value kept per sample)
    NOISE_DECAY = 0.98
    #: a shape not measured is priced by the measured ones of as many requests within this many
    #: draft tokens (``verify_excess``)
    SHAPE_REACH = 2
    #: the shapes kept (the least recently measured one goes first); under tensor parallelism
    #: rank 0 sends them to the others each step
    MAX_SHAPES = 256

    #: a draft step runs part of the target's layers, and a head no larger than its LM head, on
    #: its rows: one measured at more than this many times the target forward of as many tokens
    #: carried one-time costs (on CPU an exit head's first call packs its weights), and is not a
    #: sample. Early ones wait for the target line to be judged by.
    MAX_DRAFT_OVER_TARGET = 1.5
    #: nor, once the draft line is measured, is one at more than this many times its
    #: prediction, unless three in a row are (the machine slowed down): a feature head's draft
    #: step (no decoder layer, ~2.5 ms) passes the bound above at up to 80 ms, and first samples
    #: with one-time costs in them would price it for a whole run (docs/performance.md, "The
    #: cost model")
    MAX_DRAFT_OVER_FIT = 4.0

    def __init__(self, skip_first: bool = True) -> None:
        #: leave out samples with one-time costs (``_first_of_shape``, ``MAX_DRAFT_OVER_TARGET``);
        #: False for an engine without any (the unit tests' synthetic ones)
        self.skip_first = skip_first
        self._held: list[tuple[float, int, float]] = []
        self.rejected_draft_samples = 0
        self._outliers = 0  # draft samples rejected in a row by ``MAX_DRAFT_OVER_FIT``
        self.plain = OnlineFit(2)  # plain steps: (1, requests) -> seconds
        self.verify = OnlineFit(2)  # drafting steps: (draft tokens, 1) -> seconds over the plain
        self.drift = 0.0  # plain steps' recent residual over the plain plane (seconds)
        #: per request count, the plain steps' seconds, decayed fast (``DRIFT_DECAY``): what a
        #: drafting step of that size is measured against
        self._recent: dict[int, float] = {}
        #: (requests, draft tokens) -> [decayed sum of excess seconds, decayed count]
        self._shapes: dict[tuple[int, int], list[float]] = {}
        #: the variance of one excess sample about its shape's mean, pooled over shapes (0 before
        #: a shape is measured twice): what a shape's price adds for the uncertainty of its mean
        self._noise_sum = 0.0  # decayed sum of squared deviations (``NOISE_DECAY``)
        self._noise_count = 0.0
        self.draft = OnlineFit(3)
        self._frozen: tuple | None = None
        self._line: tuple[float, float, float, float] | None = None  # solved once per sample
        self._plain_coef: tuple[float, float, float] | None = None  # once per plain sample
        #: shapes measured once already (a target forward's requests and tokens, a draft step's
        #: rows): the first step of each shape is not a sample (see ``_first_of_shape``)
        self._seen: set[tuple] = set()

    def _first_of_shape(self, kind: str, *shape: int) -> bool:
        """Whether this is the engine's first step of this shape. Such a step carries one-time
        costs: the drafter's first metadata and KV-group builds, oneDNN's primitives for a new
        matrix shape on CPU. On the CPU they make the first draft steps of the
        embedded model several times longer than the later ones, and a
        line fitted to them judged every self-draft too dear to ever try again."""
        key = (kind, *shape)
        if key in self._seen:
            return False
        if len(self._seen) < 4096:  # bounded: shapes are at most batch x (k + 1) apart
            self._seen.add(key)
        return True

    # ---- measurements ---------------------------------------------------------------------------
    def add_target(self, requests: int, tokens: int, seconds: float) -> None:
        """A decode/verify step of ``requests`` requests and ``tokens`` scheduled tokens (one per
        request plus its draft tokens) whose target forward took ``seconds``."""
        if self.skip_first and self._first_of_shape("target", requests, tokens):
            return
        drafts = tokens - requests
        recent = self._recent.get(requests)  # the latest plain steps' seconds at this size
        if drafts == 0:
            plain = self._plain_seconds(requests)
            if plain is not None:
                self.drift += (1.0 - self.DRIFT_DECAY) * (seconds - plain - self.drift)
            self.plain.add((1.0, requests), seconds)
            self._plain_coef = None
            if recent is not None:
                self._recent[requests] = recent + (1.0 - self.DRIFT_DECAY) * (seconds - recent)
            elif len(self._recent) < 4096:  # bounded: one entry per batch size
                self._recent[requests] = seconds
        elif recent is not None:  # over plain steps of its size, at the speed of the moment
            self.verify.add((drafts, 1.0), seconds - recent)
            self._add_shape((requests, drafts), seconds - recent)
        self._line = None

    def _add_shape(self, shape: tuple[int, int], excess: float) -> None:
        total, count = self._shapes.pop(shape, (0.0, 0.0))  # re-inserted: the most recent
        if count > 0:
            # a sample's distance from the mean of ``count`` earlier ones has variance
            # noise * (1 + 1/count)
            dev = excess - total / count
            d = self.NOISE_DECAY
            self._noise_sum = d * self._noise_sum + dev * dev * count / (count + 1.0)
            self._noise_count = d * self._noise_count + 1.0
        self._shapes[shape] = [self.SHAPE_DECAY * total + excess, self.SHAPE_DECAY * count + 1.0]
        if len(self._shapes) > self.MAX_SHAPES:
            del self._shapes[next(iter(self._shapes))]

    def add_draft(self, layers: float, rows: int, seconds: float) -> None:
        if not self.skip_first:
            self.draft.add((1.0, layers, layers * rows), seconds)
            return
        if self._first_of_shape("draft", rows):
            return
        if self.target_line() is None:  # judged once there is a target forward to judge by
            if len(self._held) < 64:
                self._held.append((layers, rows, seconds))
            return
        held, self._held = self._held, []
        for n_layers, n_rows, t in (*held, (layers, rows, seconds)):
            if t > self.MAX_DRAFT_OVER_TARGET * self.target_seconds(n_rows):
                self.rejected_draft_samples += 1
                continue
            fitted = self.draft_seconds(n_layers, n_rows) if self._frozen is None else None
            if fitted and t > self.MAX_DRAFT_OVER_FIT * fitted and self._outliers < 2:
                self._outliers += 1  # a one-time cost, unless the next ones agree
                self.rejected_draft_samples += 1
                continue
            self._outliers = 0
            self.draft.add((1.0, n_layers, n_layers * n_rows), t)

    # ---- tensor parallelism: decide from rank 0's figures ------------------------------------
    def state(self) -> tuple:
        shapes = {k: (v[0], v[1]) for k, v in self._shapes.items()}
        return (self._target_line(), self.draft.coefficients(), shapes, self.noise())

    def freeze(self, state: tuple | None) -> None:
        self._frozen = state

    # ---- predictions ----------------------------------------------------------------------------
    def _target_line(self) -> tuple[float, float, float, float] | None:
        if self._line is None:
            self._line = self._solve_target_line()
        return self._line

    def _plain_fit(self) -> tuple[float, float, float] | None:
        """(v0, v_row, seconds per token of a plain step) of the plain plane; None before data."""
        if self._plain_coef is None and self.plain.count > 0:
            self._plain_coef = self._solve_plain_fit()
        return self._plain_coef

    def _solve_plain_fit(self) -> tuple[float, float, float]:
        f = self.plain
        mean_r, mean_y = float(f.xtx[0, 1] / f.count), float(f.xty[0] / f.count)
        per_token = mean_y / mean_r
        prior = self.PRIOR_SLOPE_SHARE * per_token
        # least squares with a ridge towards the prior slope: it weighs by how much the request
        # counts varied (their squared deviations); one count seen leaves the prior standing
        ridge = np.diag([0.0, self.PRIOR_WEIGHT])
        coef = np.linalg.solve(f.xtx + ridge, f.xty + ridge @ np.array([0.0, prior]))
        per_row = max(float(coef[1]), self.MIN_SLOPE_SHARE * per_token)
        return max(0.0, mean_y - per_row * mean_r), per_row, per_token

    def _plain_seconds(self, requests: int) -> float | None:
        """The plain plane's seconds for ``requests`` requests, without the drift."""
        fit = self._plain_fit()
        return None if fit is None else fit[0] + fit[1] * requests

    def _solve_target_line(self) -> tuple[float, float, float, float] | None:
        plain = self._plain_fit()
        if plain is None:
            return None
        v0, per_row, per_token = plain
        # the drafting steps' excess over the plain plane: a ridge towards the prior token cost,
        # and, lightly, towards no fixed cost (a step of lone probe tokens cannot tell the two
        # apart: their excess goes mostly to the step, so several drafts get tried together,
        # which then tells them apart; a prior above 0 would keep them from ever being tried)
        prior = self.PRIOR_SLOPE_SHARE * per_token
        ridge = np.diag([self.PRIOR_WEIGHT, self.VERIFY_PRIOR_WEIGHT])
        f = self.verify
        coef = np.linalg.solve(f.xtx + ridge, f.xty + ridge @ np.array([prior, 0.0]))
        per_draft = max(float(coef[0]), self.MIN_SLOPE_SHARE * per_token)
        verify = max(float(coef[1]), 0.0)
        # Python floats: the engine's stats are serialised
        return max(0.0, v0 + self.drift), per_row, per_draft, verify

    def target_line(self) -> tuple[float, float, float, float] | None:
        """(v0, v_row, v_tok, v_ver): a target forward of R requests verifying D draft tokens
        takes v0 + v_row·R + v_tok·D seconds, plus v_ver if D > 0; None before data."""
        return self._frozen[0] if self._frozen is not None else self._target_line()

    def draft_coefficients(self) -> np.ndarray | None:
        return self._frozen[1] if self._frozen is not None else self.draft.coefficients()

    def target_seconds(self, requests: float, drafts: float = 0.0) -> float | None:
        """A target forward of ``requests`` requests verifying ``drafts`` draft tokens (0: a
        plain decode step)."""
        line = self.target_line()
        if line is None:
            return None
        return line[0] + line[1] * requests + self.verify_excess(requests, drafts)

    def shapes(self) -> list[list[float]]:
        """The shapes measured: [requests, draft tokens, decayed samples, priced excess seconds]
        each, sorted (for the engine's stats)."""
        return [
            [r, d, round(seen[1], 2), self.verify_excess(r, d)]
            for (r, d), seen in sorted(self._shapes.items())
        ]

    def verify_excess(self, requests: float, drafts: float) -> float:
        """Seconds a step of ``requests`` requests pays for verifying ``drafts`` draft tokens
        over a plain step, never below 0 (a shape measured faster than a plain step is priced
        as free, not as a gain); 0 for no drafts:

        * a shape measured: its decayed mean shrunk towards the line (``SHAPE_PRIOR_WEIGHT``),
          plus a standard error of that mean (``_shrunk``);
        * else, with shapes of as many requests measured within ``SHAPE_REACH`` draft tokens:
          the line, shifted by their mean residual (the nearest below and above). A shape the
          controller has not drafted yet is priced like its neighbours: at batch 1 here 4 and
          6 drafts measured free, and 5 priced by the line (16 ms) was never tried;
        * else the line's ``v_tok·D + v_ver``."""
        line = self.target_line()
        if drafts <= 0 or line is None:
            return 0.0
        return self._excess(line, self._shape_table(), int(requests), int(drafts), int(drafts))[0]

    def verify_excess_table(self, requests: float, most: int) -> list[float]:
        """``verify_excess(requests, d)`` for d = 1..most (what the controller prices a step's
        drafts by, every step)."""
        line = self.target_line()
        if line is None:
            return [0.0] * most
        return self._excess(line, self._shape_table(), int(requests), 1, most)

    def _shape_table(self) -> dict:
        return self._frozen[2] if self._frozen is not None else self._shapes

    def _excess(self, line, shapes, r: int, lo: int, hi: int) -> list[float]:
        """``verify_excess(r, d)`` for d = lo..hi: the shapes of r measured in reach of them,
        shrunk towards the line, looked up once."""
        reach = self.SHAPE_REACH
        shrunk = {}
        for d in range(max(1, lo - reach), hi + reach + 1):
            seen = shapes.get((r, d))
            if seen is not None:
                shrunk[d] = self._shrunk(seen, line, d)
        out = []
        for d in range(lo, hi + 1):
            if d in shrunk:
                out.append(max(0.0, shrunk[d]))
                continue
            residuals = []
            for sign in (-1, 1):
                for step in range(1, reach + 1):
                    n = d + sign * step
                    if n in shrunk:
                        residuals.append(shrunk[n] - (line[2] * n + line[3]))
                        break
            shift = sum(residuals) / len(residuals) if residuals else 0.0
            out.append(max(0.0, line[2] * d + line[3] + shift))
        return out

    def noise(self) -> float:
        """The variance of one excess sample about its shape's mean (rank 0's under TP)."""
        if self._frozen is not None:
            return self._frozen[3]
        return self._noise_sum / self._noise_count if self._noise_count > 0 else 0.0

    def _shrunk(self, seen, line, drafts: int) -> float:
        """A measured shape's price: its mean shrunk towards the line, plus one standard error
        of that mean. The controller drafts the shapes priced cheapest, so a shape whose few
        samples came out cheap by chance would be drafted on the strength of noise (the
        winner's curse: on a CPU whose steps vary by several ms, a few samples priced verifying
        1 draft at batch 8, and 5 at batch 5, as free); the standard error fades as the shape's
        samples accumulate (to a third of a sample's deviation: samples decay, ``SHAPE_DECAY``),
        and is 0 on a machine whose steps do not vary."""
        w = self.SHAPE_PRIOR_WEIGHT
        noise = self.noise()
        mean = (seen[0] + w * (line[2] * drafts + line[3])) / (seen[1] + w)
        return mean + math.sqrt(max(noise, 0.0) / (seen[1] + w))

    def token_seconds(self) -> float | None:
        """What one more verified draft token adds to a target forward."""
        line = self.target_line()
        return None if line is None else line[2]

    def draft_seconds(self, layers: float, rows: int = 1) -> float | None:
        c = self.draft_coefficients()
        return None if c is None else float(c[0] + c[1] * layers + c[2] * layers * rows)

    def verify_seconds(self, tokens: float, batch: int = 1) -> float | None:
        """A step in which one request verifies ``tokens`` tokens (its sampled one and
        ``tokens - 1`` drafts) and the other ``batch - 1`` requests one each (what a policy's
        per-request time comparisons need)."""
        return self.target_seconds(batch, tokens - 1)


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
    self-drafts, the match length for context-lookup drafts."""

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


@dataclass
class Candidate:
    """One request's draft options this step."""

    max_tokens: int  # the policy's draft length (0: the policy does not draft)
    accept: np.ndarray  # P(first j drafts all accepted), j = 1..max_tokens, non-increasing
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


@dataclass
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
        for name in (
            "steps",
            "tokens",
            "plain_tokens",
            "pred_extra",
            "real_extra",
            "pred_cost",
            "real_cost",
        ):
            setattr(self, name, self.DECAY * getattr(self, name))


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


@dataclass
class GoodputController:
    """Chooses every request's draft length together, from measured costs and acceptance."""

    costs: StepCostModel
    #: drafts must be expected to emit this share more tokens than plain decoding would in the
    #: seconds they add (a margin on the speculative part of the step, not the whole step)
    margin: float = 0.1
    #: steps without self-drafts after which one request probes (doubles while they do not pay)
    probe_every: int = 16
    max_probe_every: int = 512
    #: a kind of draft measured slower than plain pauses this long first (then doubling)
    pause: int = 32
    max_pause: int = 1024
    #: a plain cycle at least this often (a forced one where none was chosen), to keep the
    #: safety net's reference measured
    plain_every: int = 64
    _probe_turn: int = 0
    _probe_interval: int = 0
    _since_skipped_probe: int = 1 << 30  # steps since a probe was skipped as hopeless
    _free_interval: int = 0  # the same for lookup drafts
    _free_idle: int = 0  # steps since a lookup draft was chosen or probed
    _chosen_idle: int = 1 << 30  # steps since self-drafts were chosen (not probed)
    _pending: Choice | None = None
    _plain_pending: bool = False  # the last choice drafted nothing: its cycle measures plain
    #: what a choice is worth against what it costs (``look_due``): the seconds the searched
    #: choices were expected to save, and the proposer's seconds to make one, both decayed
    _look_saving: float = 0.0
    _look_cost: float | None = None
    _look_next: bool = True  # the last choice drafted or was not searched: the next is made
    _skipped_in_row: int = 0
    #: the last choice's per-token bar (tokens per second of a token's own cost; ``weighed``)
    _floor: float | None = None

    def __post_init__(self) -> None:
        #: self-drafting steps (paid) and lookup-only steps (free) are judged apart: a failing
        #: self-drafter must not stop free drafts, nor the other way round
        self.nets = {kind: SafetyNet(self.pause, self.max_pause) for kind in ("paid", "free")}
        self._probe_interval = self._free_interval = self.probe_every
        self.plain = PlainReference()
        self.plain_refreshes = 0  # plain cycles the controller forced
        self.skipped_probes = 0  # self-draft probes skipped: no acceptance could make them pay
        self.skipped_looks = 0  # steps whose choice was not made (``look_due``)

    @property
    def achieved(self) -> float:
        """The self-drafting steps' tokens per second over plain decoding's."""
        return self.nets["paid"].achieved

    def calibration(self) -> float:
        """The self-drafting steps' achieved/predicted extra tokens."""
        return self.nets["paid"].token_calibration()

    #: the most tokens a probe verifies (``_probe``)
    FREE_PROBE_TOKENS = 4
    #: a self-draft probe drafts as many tokens (up to ``FREE_PROBE_TOKENS``) as its draft steps
    #: fit in this share of a plain step, at least one: a probe of several tokens is what tells a
    #: verified token's cost from a verifying step's fixed cost (``_probe``)
    PAID_PROBE_SHARE = 0.25
    #: self-draft probes that fail come ever more rarely (``max_probe_every``), but never rarer
    #: than it takes for them to cost this share of the time: a cheap drafter near break-even
    #: (feature heads at 15% acceptance) is probed often enough for its estimate to recover
    #: from a few unlucky probes, at a cost no benchmark can tell from noise
    PROBE_TIME_SHARE = 0.005
    #: steps around a self-draft (after one, before a probe) in which feedback for self-drafting
    #: (DEL's shadow tokens) is worth its cost
    FEEDBACK_STEPS = 8
    #: while no self-draft has been chosen for ``FEEDBACK_STEPS`` (only probes run), costly
    #: feedback takes at most this share of the time (``feedback_share``), what the probes it
    #: prepares may take: at the search budget's 2%, DEL's shadow projections alone cost 2% of
    #: every step at batch 16 here while it drafted 4 tokens in a run, and KnapSpec's plan
    #: searches 0.3-3% at batch 1 while it drafted nothing
    IDLE_FEEDBACK_SHARE = PROBE_TIME_SHARE

    def feedback_share(self, share: float) -> float:
        """The share of the time that costly feedback for self-drafting (a ``SearchBudget`` of
        ``share``) may take now: ``share`` around self-drafts the controller chose, at most
        ``IDLE_FEEDBACK_SHARE`` while only probes run."""
        if self._chosen_idle < self.FEEDBACK_STEPS:
            return share
        return min(share, self.IDLE_FEEDBACK_SHARE)

    def feedback_allowed(self, budget: SearchBudget, search: bool = False) -> bool:
        """Whether costly feedback for self-drafting runs this step, DEL's shadow projections or
        a plan search (KnapSpec's, ``search=True``): due (``self_feedback_due``) and within
        ``budget`` at the share allowed now (``feedback_share``: the budget's own around chosen
        self-drafts, at most ``IDLE_FEEDBACK_SHARE`` while only probes run)."""
        return self.self_feedback_due(search=search) and budget.allows(
            self.feedback_share(budget.share)
        )

    def self_feedback_due(self, search: bool = False) -> bool:
        """Whether a policy's costly feedback for self-drafting (DEL's shadow projections) is
        worth it now: self-drafting ran in the last few steps, or a probe is near. A plan search
        (KnapSpec's, ``search=True``, far dearer) only before a probe, or after self-drafts that
        measured faster than plain decoding."""
        paid = self.nets["paid"]
        recent = paid.idle < self.FEEDBACK_STEPS and (not search or paid.achieved >= 1.0)
        return recent or self._probe_idle() + self.FEEDBACK_STEPS >= self._probe_interval

    # ---- whether to choose at all -------------------------------------------------------------
    #: a choice costs the proposer time of its own, drafts or not: the requests' lookups, their
    #: candidates and this search (about 2% of a plain step at batch 8 on the CPU;
    #: docs/architecture.md, "The goodput controller"); at most this many steps in a row go without one (``look_due``)
    MAX_SKIPPED_LOOKS = 3
    #: the share of the old figure kept per choice, in ``_look_saving`` and ``_look_cost``
    LOOK_DECAY = 0.9

    def look_due(self) -> bool:
        """Whether this step's choice is worth making: the last choice drafted (drafts that pay
        come in runs: a quoted passage, a repeated pattern) or was a forced plain cycle that
        searched nothing, or choices have been expected to save at least the seconds they take
        (a decayed mean over choices, 0 for one that drafted nothing, against the proposer's
        measured time to make one, ``looked``), or ``MAX_SKIPPED_LOOKS`` steps in a row went
        without one. A step without a choice drafts nothing and costs the proposer only its
        bookkeeping of the step's tokens; what it skips is a choice expected to be worth less
        than its own cost. Probes and plain refreshes come after as many choices as ever, so
        later in steps.

        Example: at batch 8 choices that draft one step in ten, each expected to save 3 ms,
        are worth 0.3 ms a choice on average; one costing 1.3 ms is then made one step in four
        after each that drafts nothing."""
        if (
            self._look_next
            or self._look_cost is None
            or self._look_saving >= self._look_cost
            or self._skipped_in_row >= self.MAX_SKIPPED_LOOKS
        ):
            self._skipped_in_row = 0
            return True
        self._skipped_in_row += 1
        self.skipped_looks += 1
        return False

    def looked(self, seconds: float) -> None:
        """The proposer's seconds to make this step's choice (its lookups, candidates, search)."""
        if self._look_cost is None:
            self._look_cost = seconds
        else:
            self._look_cost += (1.0 - self.LOOK_DECAY) * (seconds - self._look_cost)

    def _searched(self, best: Choice, base: float, plain: float) -> None:
        """Record what the searched choice (before probes) is expected to save: the seconds
        plain decoding would take for its expected tokens, less its own predicted seconds."""
        saving = 0.0
        if any(best.tokens):
            saving = max(0.0, best.expected_tokens * plain / base - best.expected_seconds)
        self._look_saving += (1.0 - self.LOOK_DECAY) * (saving - self._look_saving)
        self._look_next = any(best.tokens)

    # ---- the choice ------------------------------------------------------------------------
    def choose(self, cands: list[Candidate], tokens: int | None = None) -> Choice:
        """Draft lengths maximising expected emitted tokens / predicted seconds of the next step
        (``tokens``: scheduled tokens of the step without drafts, default one per candidate)."""
        n = len(cands)
        base = float(n if tokens is None else tokens)
        line = self.costs.target_line()
        if line is None:  # no plain step measured yet: one now (drafting steps are priced over it)
            self._plain_pending = True
            return Choice([0] * n, float("nan"), float("nan"), float("nan"))
        if self.costs.draft_coefficients() is None and not all(
            c.free for c in cands if c.max_tokens
        ):
            # no draft step measured yet: one draft token per request, so its cost gets measured
            tokens = [min(1, c.max_tokens) for c in cands]
            self._plain_pending = not any(tokens)
            return Choice(tokens, float("nan"), float("nan"), float("nan"))
        # a verified draft token's seconds; a verifying step's fixed seconds (not scaled by a
        # time calibration below, though the record divides a choice's whole extra by its scale)
        v1, verify = line[2], line[3]
        plain = self.plain.seconds(self.costs.target_seconds(base))
        self.plain.since += 1
        if self.plain.since > self.plain_every:  # no plain cycle measured for a while: one now
            self.plain.since = 0
            self.plain_refreshes += 1
            self._look_next = True  # this choice searched nothing
            for net in self.nets.values():
                net.tick(False)
            self._pending, self._plain_pending = None, True
            return Choice([0] * n, float(n), plain, plain)
        paid, free = self.nets["paid"], self.nets["free"]
        scaled = [self._scaled(c, v1) for c in cands]
        best = Choice([0] * n, float(n), plain, plain)
        best_rate = n / plain
        # each token must pay for itself by the margin: a token near break-even adds nothing
        # but the risk of a wrong estimate, wherever the rest of the step stands
        floor = self._floor = (1.0 + self.margin) * base / plain
        # draft steps are searched only if some self-draft token clears that bar (its first is
        # its likeliest); otherwise a draft step would only add its fixed cost to the free drafts
        depth = max(
            (
                c.max_tokens
                for c in scaled
                if not c.free and c.max_tokens and self._clears_bar(c, floor, v1)
            ),
            default=0,
        )
        # the verification of m = 1.. drafts in this step, by the shapes measured or the line
        most = sum(c.max_tokens for c in scaled)
        excess = self.costs.verify_excess_table(n, most)
        for choice in self._best_for_depths(scaled, depth, base, plain, v1, floor, verify, excess):
            rate = choice.expected_tokens / choice.expected_seconds
            if rate > best_rate and self._clears_margin(choice, base):
                best, best_rate = choice, rate
        best.kind = self._kind(cands, best.tokens)
        self._searched(best, base, plain)
        chosen_free = any(t and c.free for c, t in zip(cands, best.tokens))
        self._since_skipped_probe += 1
        if best.kind != "paid" and paid.open and self._probe_idle() + 1 >= self._probe_interval:
            # self-drafts have not run for a while: probe, unless no self-draft could pay
            # even if every one were accepted (a probe would only cost; the next is as late);
            # once probes are as rare as they get, probe anyway: a probe also re-measures the
            # draft step's cost, which the verdict rests on
            if (
                self._could_pay(cands, floor, v1, verify)
                or self._probe_interval >= self.max_probe_every
            ):
                best = self._probe(cands, best, plain=plain)
            else:
                self._probe_interval = min(2 * self._probe_interval, self.max_probe_every)
                self._since_skipped_probe = 0
                self.skipped_probes += 1
        if best.kind == "paid" and not best.probe:  # self-drafts chosen (not a probe)
            self._probe_interval = self.probe_every
            self._chosen_idle = 0
        else:
            self._chosen_idle += 1
        # lookup drafts likewise: an estimate that fell below the bar gets new evidence
        if chosen_free:
            self._free_idle, self._free_interval = 0, self.probe_every
        else:
            self._free_idle += 1
            if free.open and self._free_idle >= self._free_interval:
                best = self._probe(cands, best, free=True)
        if best.kind:
            best.scale = self.nets[best.kind].time_calibration()
        for kind, net in self.nets.items():
            net.tick(best.kind == kind)
        self._pending = best if best.kind else None
        self._plain_pending = not any(best.tokens)
        return best

    def _scaled(self, c: Candidate, v1: float) -> Candidate:
        """A candidate as the choice prices it: none of a paused kind of draft; each kind's
        estimates scaled by its record (``SafetyNet``'s calibrations)."""
        net = self.nets["free" if c.free else "paid"]
        if not net.open or c.max_tokens <= 0:
            return Candidate(0, c.accept, free=c.free)
        # the measured/predicted extra seconds scale a token's whole cost, its verification
        # (v1) included: as a row cost, so that a lookup draft's is scaled too
        t = net.time_calibration()
        return Candidate(
            c.max_tokens,
            net.token_calibration() * c.accept,
            t * c.row_seconds + (t - 1.0) * v1,
            t * c.plan_seconds,
            c.free,
        )

    def weighed(self, free: Candidate, paid: Candidate, v1: float) -> tuple[Candidate, Candidate]:
        """A request's lookup draft and its self-draft as the next choice will price them, for
        ``prefer_free`` to pick one of: each scaled (``_scaled``: none of a paused kind), and
        the self-draft dropped where its first token does not clear the last choice's per-token
        bar, so that ``choose`` would search no draft step for it. Without this a self-draft
        that the choice then cuts (a paused self-drafter, estimates measured four times too
        high, a draft step dearer than its token is worth) took the place of a lookup draft it
        would have verified."""
        free, paid = self._scaled(free, v1), self._scaled(paid, v1)
        if (
            paid.max_tokens
            and self._floor is not None
            and not self._clears_bar(paid, self._floor, v1)
        ):
            paid = Candidate(0, paid.accept)
        return free, paid

    @staticmethod
    def _clears_bar(c: Candidate, floor: float, v1: float) -> bool:
        """Whether a scaled self-draft's first token (its likeliest) yields more than ``floor``
        tokens per second of its own cost (its verification and its row of a draft step): what
        a draft step is searched for in ``choose``, and what ``weighed`` keeps a self-draft by."""
        return c.accept[0] > floor * (v1 + c.row_seconds)

    def _probe_idle(self) -> int:
        """Steps since self-drafts last ran or a probe was skipped (the probe clock)."""
        return min(self.nets["paid"].idle, self._since_skipped_probe)

    @staticmethod
    def _could_pay(cands: list[Candidate], floor: float, v1: float, verify: float = 0.0) -> bool:
        """Whether a self-draft token could clear the per-token bar (``floor`` tokens per second
        of its own cost) in the best case: accepted for sure, its draft step shared by every
        request that can self-draft. A token's cost is its verification plus its row and its
        share of the draft step and of the verifying step's fixed cost, as measured; a plan that
        costs most of a target step (LayerSkip at exit 28 of 30, say) cannot pay at any
        acceptance, so probing it is pure loss."""
        paid = [c for c in cands if c.max_tokens > 0 and not c.free]
        share = 1.0 / max(len(paid), 1)
        return any(
            1.0 > floor * (v1 + c.row_seconds + share * (c.plan_seconds + verify)) for c in paid
        )

    def _clears_margin(self, choice: Choice, base: float) -> bool:
        """Whether a choice's expected extra tokens beat what plain decoding would emit in its
        extra seconds by ``margin``: the margin covers errors in the *speculative* part of the
        step. (A margin on the whole step's rate would ask a lone drafting request at batch 16
        to lift the whole batch's rate by 3%, which its drafts alone cannot, so nothing would
        ever draft at large batch sizes however well it pays.)"""
        extra_seconds = choice.expected_seconds - choice.plain_seconds
        extra_tokens = choice.expected_tokens - base
        plain_rate = base / choice.plain_seconds
        return extra_tokens > (1.0 + self.margin) * plain_rate * extra_seconds

    @staticmethod
    def _kind(cands: list[Candidate], tokens: list[int]) -> str:
        drafted = [c for c, t in zip(cands, tokens) if t]
        if not drafted:
            return ""
        return "free" if all(c.free for c in drafted) else "paid"

    @staticmethod
    def _best_for_depths(
        cands, depth, base, plain, v1, floor: float = 0.0, verify: float = 0.0, excess=None
    ) -> list[Choice]:
        """For each number of draft steps ``s = 0..depth``: the best set of draft tokens. Each
        token costs its row in a draft step (unless free) and its verification; ranked by
        expected tokens per second of its cost at the line's price ``v1`` a token, the best set
        is a prefix of that ranking (a request's tokens come in order, since its P is
        non-increasing and its cost per token constant), the one with the highest (tokens /
        seconds) of the whole step. The step pays ``excess[m - 1]`` to verify m drafts
        (``StepCostModel.verify_excess``; default the line's ``v1·m + verify``). A prefix whose
        last token is expected to yield no more than ``floor`` tokens per second of its own cost
        (its row, and the prefix's verification per token beyond the fixed ``verify``) is never
        chosen, however well the others pay.

        With s draft steps the tokens on offer are every free token and each self-draft's first
        s: one ranking of all of them serves every s (a subset keeps its order), so all depths
        are priced in one pass, a row of the arrays below per s (with 6-token self-drafts in view
        at 8 requests, the 7 passes of one pricing each took half of a choice's time).

        Example: one free draft (P 0.9, 0.5) and one self-draft (P 0.8) whose draft step costs
        0.02 s; a plain step 0.1 s for 2 tokens, a verified token 0.01 s. With no draft step
        only the free tokens are on offer (3.4 tokens in 0.12 s); with one, the self-draft's
        token too (4.2 tokens in 0.15 s: 28 tokens/s against 28.3, so ``choose`` keeps the
        first)::

            >>> free = Candidate(2, np.array([0.9, 0.5]), free=True)
            >>> paid = Candidate(1, np.array([0.8]), 0.0, 0.02)
            >>> for c in GoodputController._best_for_depths([free, paid], 1, 2, 0.1, 0.01):
            ...     print(c.tokens, round(c.expected_tokens, 2), round(c.expected_seconds, 2))
            [2, 0] 3.4 0.12
            [2, 1] 4.2 0.15
        """
        n = len(cands)
        width = max((c.max_tokens for c in cands), default=0)
        gain = np.zeros((n, max(width, 1)))
        cost = np.zeros(n)
        row = np.zeros(n)
        free = np.zeros(n, dtype=bool)
        fixed = 0.0  # a draft step's fixed seconds: the dearest plan among the drafting rows
        for i, c in enumerate(cands):
            d = c.max_tokens if c.free else min(c.max_tokens, depth)
            if d <= 0:
                continue
            gain[i, :d] = c.accept[:d]
            cost[i] = v1 + c.row_seconds
            row[i] = c.row_seconds
            free[i] = c.free
            if not c.free:
                fixed = max(fixed, c.plan_seconds)
        none = Choice([0] * n, base, plain, plain)
        rows, cols = np.nonzero(gain > 0)
        if rows.size == 0:
            return [none] * (depth + 1)
        g = gain[rows, cols]
        order = np.lexsort((cols, -g / np.maximum(cost[rows], 1e-12)))
        rows, cols, g, r = rows[order], cols[order], g[order], row[rows[order]]
        # on[s, t]: token t is on offer with s draft steps
        on = free[rows][None, :] | (cols[None, :] < np.arange(depth + 1)[:, None])
        m = np.cumsum(on, axis=1)  # drafts in the prefix ending at t
        if excess is None:
            verified = v1 * m + verify
        else:
            table = np.asarray(excess[: len(g)], dtype=np.float64)
            verified = table[np.maximum(m, 1) - 1]
        steps = np.arange(depth + 1)[:, None]
        total = base + np.cumsum(on * g, axis=1)
        seconds = plain + steps * fixed + np.cumsum(on * r, axis=1) + verified
        per_token = np.maximum(verified - verify, 0.0) / np.maximum(m, 1)
        worth = on & (g > floor * (r + per_token))
        rate = np.where(worth, total / seconds, -np.inf)
        out = []
        for s in range(depth + 1):
            if not worth[s].any():
                out.append(none)
                continue
            best = int(np.argmax(rate[s]))
            tokens = np.bincount(rows[: best + 1][on[s, : best + 1]], minlength=n)
            out.append(
                Choice(tokens.tolist(), float(total[s, best]), float(seconds[s, best]), plain)
            )
        return out

    def _probe(
        self, cands: list[Candidate], best: Choice, free: bool = False, plain: float = 0.0
    ) -> Choice:
        """Draft tokens of one request (round robin) that the choice left out, to re-measure
        acceptance and cost; the next probe of that kind comes twice as late unless such drafts
        are chosen before it. A lookup probe (``free``) drafts the whole match, up to
        ``FREE_PROBE_TOKENS``: it costs only its verification. A self-draft probe drafts as many
        tokens as its draft steps fit in ``PAID_PROBE_SHARE`` of a ``plain`` step, at least one,
        and its probes come at least as often as ``PROBE_TIME_SHARE`` of the time pays for.
        Several tokens are what tell the cost of a verified token from a verifying step's fixed
        cost: one token at a time, noise in a few lone probes priced the step so high at batch 1
        that lookup drafts never ran again in a short engine test, and feature heads, whose draft
        step is a twentieth of a target step, drafted 2 tokens in a whole benchmark (their lone
        probes priced a verifying step at 20 ms and a verified token at 16 ms, against 0 and
        2.9 ms measured from the same engine's lookup rounds)."""
        if free:
            self._free_interval = min(2 * self._free_interval, self.max_probe_every)
            self._free_idle = 0
        else:
            self._probe_interval = min(2 * self._probe_interval, self.max_probe_every)
        options = [
            i for i, c in enumerate(cands) if c.max_tokens and c.free == free and not best.tokens[i]
        ]
        if not options:
            return best
        i = options[self._probe_turn % len(options)]
        self._probe_turn += 1
        tokens = list(best.tokens)
        if free:
            tokens[i] = min(cands[i].max_tokens, self.FREE_PROBE_TOKENS)
        else:
            c = cands[i]
            step = c.row_seconds + c.plan_seconds
            fit = int(self.PAID_PROBE_SHARE * plain / step) if step > 0 else self.FREE_PROBE_TOKENS
            tokens[i] = max(1, min(c.max_tokens, self.FREE_PROBE_TOKENS, fit))
            if plain > 0:  # probes a cheap drafter can afford come no rarer than they must
                seconds = tokens[i] * step + self.costs.verify_excess(len(cands), tokens[i])
                affordable = math.ceil(seconds / (self.PROBE_TIME_SHARE * plain))
                self._probe_interval = min(self._probe_interval, max(self.probe_every, affordable))
        expected = best.expected_tokens + float(np.sum(cands[i].accept[: tokens[i]]))
        return Choice(
            tokens,
            expected,
            float("nan"),
            best.plain_seconds,
            probe=True,
            kind=self._kind(cands, tokens),
        )

    # ---- what happened ---------------------------------------------------------------------
    def settle(self, emitted: int, requests: int, seconds: float) -> None:
        """The step that verified the last choice emitted ``emitted`` tokens for ``requests``
        requests, ``seconds`` of wall clock after the choice was made (its draft steps, the
        engine's cycle, the verifying forward). A choice without drafts measures plain decoding."""
        choice, self._pending = self._pending, None
        plain_cycle, self._plain_pending = self._plain_pending, False
        if choice is None and not plain_cycle:  # a step without a choice: nothing to settle
            return
        predicted = self.costs.target_seconds(requests)
        if seconds <= 0 or requests <= 0 or predicted is None or predicted <= 0:
            return
        if plain_cycle:
            self.plain.add(predicted, seconds)
        if choice is None:
            return
        plain = self.plain.seconds(predicted)
        expected = choice.expected_seconds
        if seconds > PlainReference.MAX_RATIO * max(plain, 0 if math.isnan(expected) else expected):
            return  # an idle gap in the cycle: not what the drafts cost
        self.nets[choice.kind].record(choice, emitted, requests, seconds, plain)

    def state(self) -> dict:
        nets = {
            kind: {
                "achieved": net.achieved,
                "token_calibration": net.token_calibration(),
                "time_calibration": net.time_calibration(),
                "paused": net.paused,
            }
            for kind, net in self.nets.items()
        }
        return {
            "plain_refreshes": self.plain_refreshes,
            "skipped_probes": self.skipped_probes,
            "skipped_looks": self.skipped_looks,
            "plain_overhead_s": self.plain.overhead,
            **nets,
        }

"""The step-cost model: measured seconds of a target forward (a plane in the step's requests and
draft tokens, plus a fixed cost of verifying any, and per step shape) and of a draft step (a line
in layers and rows), fitted online with forgetting."""

from __future__ import annotations

import math
import statistics
from collections import deque

import numpy as np


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with ``a x = b`` for a fit's 2 or 3 unknowns, by Cramer's rule in plain Python: several
    times faster than ``np.linalg.solve`` on such sizes, and a fit is solved every step."""
    if len(b) == 2:
        (p, q), (r, s) = a
        det = p * s - q * r
        if det == 0.0:
            raise np.linalg.LinAlgError("singular fit")
        return [(b[0] * s - q * b[1]) / det, (p * b[1] - r * b[0]) / det]
    (a0, a1, a2), (b0, b1, b2), (c0, c1, c2) = a
    # the cofactors of the first column's minors, reused by each unknown's determinant
    m0, m1, m2 = b1 * c2 - b2 * c1, a1 * c2 - a2 * c1, a1 * b2 - a2 * b1
    det = a0 * m0 - b0 * m1 + c0 * m2
    if det == 0.0:
        raise np.linalg.LinAlgError("singular fit")
    y0, y1, y2 = b
    x0 = (y0 * m0 - y1 * m1 + y2 * m2) / det
    x1 = (a0 * (y1 * c2 - b2 * y2) - b0 * (y0 * c2 - a2 * y2) + c0 * (y0 * b2 - a2 * y1)) / det
    x2 = (a0 * (b1 * y2 - y1 * c1) - b0 * (a1 * y2 - y0 * c1) + c0 * (a1 * y1 - y0 * b1)) / det
    return [x0, x1, x2]


class OnlineFit:
    """y ≈ coef · x for feature vectors x of 2 or 3 features, least squares with forgetting
    factor ``decay`` per sample; coefficients are clipped at ``lower`` and None until
    ``min_samples`` were seen. The sums are Python floats, spelt out per size: a step adds a
    sample or two, where numpy's per-call overhead would cost more than the arithmetic."""

    def __init__(
        self, n: int, decay: float = 0.98, lower: float = 0.0, min_samples: float = 3.0
    ) -> None:
        self.decay, self.lower, self.min_samples = decay, lower, min_samples
        self.xtx = [[0.0] * n for _ in range(n)]
        self.xty = [0.0] * n
        self.count = 0.0
        #: solved once per sample (read several times a step)
        self._coef: tuple[float, ...] | None = None

    def add(self, x, y: float) -> None:
        d = self.decay
        if len(x) == 2:  # the target line's fits, every step
            a, b = float(x[0]), float(x[1])
            (p, q), (r, s) = self.xtx
            self.xtx = [[d * p + a * a, d * q + a * b], [d * r + b * a, d * s + b * b]]
            self.xty = [d * self.xty[0] + a * y, d * self.xty[1] + b * y]
            self.count = d * self.count + 1.0
            self._coef = None
            return
        # 3 features: the draft line's fit, every self-drafting step
        a, b, c = float(x[0]), float(x[1]), float(x[2])
        (p, q, r), (s, t, u), (v, w, z) = self.xtx
        self.xtx = [
            [d * p + a * a, d * q + a * b, d * r + a * c],
            [d * s + b * a, d * t + b * b, d * u + b * c],
            [d * v + c * a, d * w + c * b, d * z + c * c],
        ]
        e, f, g = self.xty
        self.xty = [d * e + a * y, d * f + b * y, d * g + c * y]
        self.count = d * self.count + 1.0
        self._coef = None

    def coefficients(self) -> tuple[float, ...] | None:
        if self.count < self.min_samples:
            return None
        if self._coef is None:
            # a light ridge keeps features the data cannot separate (one row count, one plan)
            # at their least-norm values instead of blowing up
            a = [list(row) for row in self.xtx]
            ridge = 1e-6 * max(sum(row[i] for i, row in enumerate(a)), 1e-12)
            for i, row in enumerate(a):
                row[i] += ridge
            self._coef = tuple(max(c, self.lower) for c in solve(a, self.xty))
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
    #: the noise of one excess sample (its distance from its shape's mean, pooled over shapes) is
    #: the lower of two estimates: the decayed mean of the squared distances (the share of the
    #: old value kept per sample), and the squared median of the last ``NOISE_SAMPLES``
    #: distances, read as a normal sample's (robust to spikes). Alone, the mean of squares let
    #: a few slow steps (tens of ms over a 20 ms step at batch 8 on the CPU) put a shape seen
    #: once at about 10 ms over its sample; shapes priced so dear were no longer drafted, so no
    #: sample brought the figure down, and an `auto` engine drafted a fifth as much as its twin
    #: in the same benchmark (docs/results/compiled/noise-chat-bs8). Alone, the median stays
    #: high while a shape's mean follows a change of speed (every distance is large for a
    #: while), and lookup drafts came back later after a slow spell (tests/unit/test_goodput.py)
    NOISE_DECAY = 0.98
    NOISE_SAMPLES = 31
    #: a normal sample's standard deviation over its median absolute distance from the mean
    MAD_TO_SIGMA = 1.4826
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
        #: (requests, draft tokens) -> [decayed sum of excess seconds, decayed count], the least
        #: recently measured first; and the same entries by request count (``_by_requests``:
        #: requests -> {draft tokens: entry}), what a step's prices read
        self._shapes: dict[tuple[int, int], list[float]] = {}
        self._by_requests: dict[int, dict[int, list[float]]] = {}
        #: the variance of one excess sample about its shape's mean, pooled over shapes (0 before
        #: a shape is measured twice): what a shape's price adds for the uncertainty of its mean
        self._noise_sum = 0.0  # decayed sum of squared distances (``NOISE_DECAY``)
        self._noise_count = 0.0
        self._deviations: deque[float] = deque(maxlen=self.NOISE_SAMPLES)
        self._noise = 0.0
        self.draft = OnlineFit(3)
        self._frozen: tuple | None = None  # rank 0's figures under TP (``freeze``)
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
            dev = abs(excess - total / count) * math.sqrt(count / (count + 1.0))
            d = self.NOISE_DECAY
            self._noise_sum = d * self._noise_sum + dev * dev
            self._noise_count = d * self._noise_count + 1.0
            self._deviations.append(dev)
            robust = (self.MAD_TO_SIGMA * statistics.median(self._deviations)) ** 2
            self._noise = min(self._noise_sum / self._noise_count, robust)
        entry = [self.SHAPE_DECAY * total + excess, self.SHAPE_DECAY * count + 1.0]
        self._shapes[shape] = self._by_requests.setdefault(shape[0], {})[shape[1]] = entry
        if len(self._shapes) > self.MAX_SHAPES:  # the least recently measured goes
            requests, drafts = oldest = next(iter(self._shapes))
            del self._shapes[oldest], self._by_requests[requests][drafts]
            if not self._by_requests[requests]:
                del self._by_requests[requests]

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
        """What the other ranks price by (``freeze``): the target line, the draft line, the
        shapes measured by request count (requests -> {draft tokens: (sum, count)}), the
        noise."""
        shapes = {
            r: {d: (v[0], v[1]) for d, v in ds.items()} for r, ds in self._by_requests.items()
        }
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
        mean_r, mean_y = f.xtx[0][1] / f.count, f.xty[0] / f.count
        per_token = mean_y / mean_r
        prior = self.PRIOR_SLOPE_SHARE * per_token
        # least squares with a ridge towards the prior slope: it weighs by how much the request
        # counts varied (their squared deviations); one count seen leaves the prior standing
        w = self.PRIOR_WEIGHT
        (a, b), (c, d) = f.xtx
        coef = solve([[a, b], [c, d + w]], [f.xty[0], f.xty[1] + w * prior])
        per_row = max(coef[1], self.MIN_SLOPE_SHARE * per_token)
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
        w, wv = self.PRIOR_WEIGHT, self.VERIFY_PRIOR_WEIGHT
        (a, b), (c, d) = self.verify.xtx
        coef = solve(
            [[a + w, b], [c, d + wv]], [self.verify.xty[0] + w * prior, self.verify.xty[1]]
        )
        per_draft = max(coef[0], self.MIN_SLOPE_SHARE * per_token)
        verify = max(coef[1], 0.0)
        # Python floats: the engine's stats are serialised
        return max(0.0, v0 + self.drift), per_row, per_draft, verify

    def target_line(self) -> tuple[float, float, float, float] | None:
        """(v0, v_row, v_tok, v_ver): a target forward of R requests verifying D draft tokens
        takes v0 + v_row·R + v_tok·D seconds, plus v_ver if D > 0; None before data."""
        return self._frozen[0] if self._frozen is not None else self._target_line()

    def draft_coefficients(self) -> tuple[float, ...] | None:
        return self._frozen[1] if self._frozen is not None else self.draft.coefficients()

    def target_seconds(self, requests: float, drafts: float = 0.0) -> float | None:
        """A target forward of ``requests`` requests verifying ``drafts`` draft tokens (0: a
        plain decode step)."""
        line = self.target_line()
        if line is None:
            return None
        if drafts <= 0:
            return line[0] + line[1] * requests
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
        r, d = int(requests), int(drafts)
        return self._excess(line, self._shapes_of(r), d, d)[0]

    def verify_excess_table(self, requests: float, most: int) -> list[float]:
        """``verify_excess(requests, d)`` for d = 1..most (what the controller prices a step's
        drafts by, every step)."""
        line = self.target_line()
        if line is None or most <= 0:
            return [0.0] * max(most, 0)
        return self._excess(line, self._shapes_of(int(requests)), 1, most)

    def _shapes_of(self, requests: int) -> dict[int, list[float]]:
        """The shapes of ``requests`` requests measured: draft tokens -> [sum, count]."""
        rows = self._frozen[2] if self._frozen is not None else self._by_requests
        return rows.get(requests, {})

    def _excess(self, line, shapes, lo: int, hi: int) -> list[float]:
        """``verify_excess(r, d)`` for d = lo..hi, from ``shapes`` (r's, ``_shapes_of``): those
        measured in reach of them, shrunk towards the line, priced once; each unmeasured d
        within reach of them gets the mean residual of the nearest below and the nearest
        above."""
        reach, w = self.SHAPE_REACH, self.SHAPE_PRIOR_WEIGHT
        a, b = line[2], line[3]
        noise = max(self.noise(), 0.0)
        first, last = lo - reach, hi + reach
        shrunk = {}
        for d, seen in shapes.items():
            if first <= d <= last:  # ``_shrunk``, spelt out (every step, each shape in reach)
                n = seen[1] + w
                shrunk[d] = (seen[0] + w * (a * d + b)) / n + math.sqrt(noise / n)
        if a >= 0.0 and b >= 0.0:  # as the line is solved: no price below 0
            out = [a * d + b for d in range(lo, hi + 1)]
        else:  # a frozen line from elsewhere
            out = [max(0.0, a * d + b) for d in range(lo, hi + 1)]
        if not shrunk:
            return out
        # only draft counts within reach of a measured shape differ from the line
        for d in range(max(lo, min(shrunk) - reach), min(hi, max(shrunk) + reach) + 1):
            price = shrunk.get(d)
            if price is None:
                residuals = []
                for nearest in (range(d - 1, d - reach - 1, -1), range(d + 1, d + reach + 1)):
                    for n in nearest:  # the nearest below, then the nearest above
                        if n in shrunk:
                            residuals.append(shrunk[n] - (a * n + b))
                            break
                if not residuals:
                    continue
                price = a * d + b + sum(residuals) / len(residuals)
            out[d - lo] = max(0.0, price)
        return out

    def noise(self) -> float:
        """The variance of one excess sample about its shape's mean (rank 0's under TP)."""
        if self._frozen is not None:
            return self._frozen[3]
        return self._noise

    def _shrunk(self, seen, line, drafts: int, noise: float | None = None) -> float:
        """A measured shape's price: its mean shrunk towards the line, plus one standard error
        of that mean. The controller drafts the shapes priced cheapest, so a shape whose few
        samples came out cheap by chance would be drafted on the strength of noise (the
        winner's curse: on a CPU whose steps vary by several ms, a few samples priced verifying
        1 draft at batch 8, and 5 at batch 5, as free); the standard error fades as the shape's
        samples accumulate (to a third of a sample's deviation: samples decay, ``SHAPE_DECAY``),
        and is 0 on a machine whose steps do not vary."""
        w = self.SHAPE_PRIOR_WEIGHT
        noise = self.noise() if noise is None else noise
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

"""The goodput controller's search: for each number of draft steps ``s = 0..depth``, the set of
draft tokens with the most expected tokens per second of the whole step.

Each token costs its verification and, unless free (a lookup draft), its row in each draft
step; ranked by expected tokens per second of that cost at the line's price ``v1`` a token, the
best set is a prefix of the ranking (a request's tokens come in order, since its P is
non-increasing and its cost per token constant): the one with the highest (tokens / seconds) of
the whole step. The step pays ``excess[m - 1]`` to verify m drafts
(``StepCostModel.verify_excess``; default the line's ``v1·m + verify``), and ``s`` times the
dearest plan's fixed seconds among the self-drafting rows. A prefix whose last token is
expected to yield no more than ``floor`` tokens per second of its own cost (its row, and the
prefix's verification per token beyond the fixed ``verify``) is never chosen, however well the
others pay.

With s draft steps the tokens on offer are every free token and each self-draft's first s: one
ranking of all of them serves every s (a subset keeps its order). The tail of the ranking that
could end no set is cut first (``_ranked``): in ``benchmarks/lookup_host.py --self-drafts`` at
batch 8, about 4 of the 29 tokens on offer remain. Two implementations of the same search, checked
against each other (tests/unit/test_goodput.py): ``search_python``, a walk along the ranking
per depth, faster for a step's few dozen tokens, and ``search_arrays``, every depth at once in
numpy arrays, faster for hundreds; ``search`` picks by the size left after the cut. Both
return ``Depths``, whose token counts per request are built only for the depth the controller
takes.

Example: one free draft (P 0.9, 0.5) and one self-draft (P 0.8) whose draft step costs 0.02 s;
a plain step 0.1 s for 2 tokens, a verified token 0.01 s. With no draft step only the free
tokens are on offer (3.4 tokens in 0.12 s); with one, the self-draft's token too (4.2 tokens in
0.15 s: 28 tokens/s against 28.3, so the controller keeps the first)::

    >>> from vllm_selfspec.goodput.choice import Candidate
    >>> free = Candidate(2, [0.9, 0.5], free=True)
    >>> paid = Candidate(1, [0.8], 0.0, 0.02)
    >>> found = search([free, paid], 1, 2, 0.1, 0.01)
    >>> for s, (total, seconds, _) in enumerate(found.best):
    ...     print(found.tokens(s), round(total, 2), round(seconds, 2))
    [2, 0] 3.4 0.12
    [2, 1] 4.2 0.15
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: the largest search (depths × tokens left after the cut, ``_ranked``) walked in plain Python;
#: above it the arrays are faster (on this project's CPU the two took about as long at 200-300
#: depths × tokens)
PYTHON_SEARCH_SIZE = 200


@dataclass
class Depths:
    """Every depth's best set of draft tokens, from one search."""

    n: int  # the requests (candidates)
    requests: list[int]  # the request of each ranked token
    #: the draft steps each ranked token needs to be on offer, less one (-1: a free token)
    needs: list[int]
    #: per depth s: (expected tokens, predicted seconds, the set's last ranked token); -1 with
    #: the plain step's figures where no token is worth it
    best: list[tuple[float, float, int]]

    def tokens(self, s: int) -> list[int]:
        """Per request, its draft tokens in depth ``s``'s set."""
        out = [0] * self.n
        for t in range(self.best[s][2] + 1):
            if self.needs[t] < s:
                out[self.requests[t]] += 1
        return out


def _offer(cands, depth, v1) -> tuple[list[tuple], float]:
    """The tokens on offer at ``depth`` draft steps, ranked: (-tokens per second of its cost,
    column, request, gain, row seconds, need) each, where need is the draft steps the token
    needs to be on offer, less one (-1: a free token); and a draft step's fixed seconds (the
    dearest plan among the self-drafting rows)."""
    offer, fixed = [], 0.0
    append = offer.append
    for i, c in enumerate(cands):
        free, row = c.free, c.row_seconds
        d = c.max_tokens if free else min(c.max_tokens, depth)
        if d <= 0:
            continue
        if not free:
            fixed = max(fixed, c.plan_seconds)
        cost = max(v1 + row, 1e-12)
        for j, g in enumerate(c.accept[:d]):
            if g > 0:
                append((-g / cost, j, i, g, row, -1 if free else j))
    offer.sort()  # ties by column, then request ((column, request) is unique)
    return offer, fixed


def on_offer(cands, depth) -> int:
    """The most draft tokens on offer at ``depth`` draft steps: every free token and each
    self-draft's first ``depth`` (what the verification prices must cover)."""
    return sum(c.max_tokens if c.free else min(c.max_tokens, depth) for c in cands)


def search(
    cands,
    depth,
    base,
    plain,
    v1,
    floor: float = 0.0,
    verify: float = 0.0,
    excess=None,
    offered: int | None = None,
) -> Depths:
    """Every depth's best set (``base``: the step's tokens without drafts; ``plain``: its
    seconds), walked in plain Python or priced in arrays by the size of the search left after
    the cut (``_ranked``; ``offered``: ``on_offer(cands, depth)`` where the caller has it)."""
    if offered is None:
        offered = on_offer(cands, depth)
    if offered == 0:  # nothing to choose from (the common step without a match)
        return Depths(len(cands), [], [], [(base, plain, -1)] * (depth + 1))
    ranked = _ranked(cands, depth, v1, floor, verify, excess)
    walk = _walk_python if (depth + 1) * len(ranked[0]) <= PYTHON_SEARCH_SIZE else _walk_arrays
    return walk(len(cands), ranked, depth, base, plain, floor, verify)


def search_python(
    cands, depth, base, plain, v1, floor: float = 0.0, verify: float = 0.0, excess=None
) -> Depths:
    """``search`` as one walk along the ranking per depth, over the tokens on offer there."""
    ranked = _ranked(cands, depth, v1, floor, verify, excess)
    return _walk_python(len(cands), ranked, depth, base, plain, floor, verify)


def search_arrays(
    cands, depth, base, plain, v1, floor: float = 0.0, verify: float = 0.0, excess=None
) -> Depths:
    """``search`` for every depth at once: a row of the arrays per depth (with 6-token
    self-drafts in view at 8 requests, 7 passes of one pricing each took half of a choice's
    time)."""
    ranked = _ranked(cands, depth, v1, floor, verify, excess)
    return _walk_arrays(len(cands), ranked, depth, base, plain, floor, verify)


def _ranked(cands, depth, v1, floor, verify, excess):
    """The tokens on offer at ``depth`` draft steps, ranked (``_offer``); a draft step's fixed
    seconds; and by the drafts m in the step (index m - 1), their verification and its share
    per draft beyond the verifying step's fixed seconds (what a token's own cost includes).

    A token ends a set only where it clears the bar (``floor`` tokens per second of its row and
    its share), and no share is below the lowest, so the tokens ranked after the last one that
    clears it at the lowest are in no depth's set: they are cut (at a steady line's prices, a
    long lookup draft's unlikely tail and a self-draft's last columns)."""
    offer, fixed = _offer(cands, depth, v1)
    if excess is None:
        verified = [v1 * m + verify for m in range(1, len(offer) + 1)]
    elif isinstance(excess, list):  # the cost model's table: Python floats
        verified = excess[: len(offer)]
    else:
        verified = np.asarray(excess[: len(offer)], dtype=np.float64).tolist()
    shares = [max(v - verify, 0.0) / m for m, v in enumerate(verified, 1)]
    if floor > 0.0 and shares:
        low, last = min(shares), len(offer)
        while last and not offer[last - 1][3] > floor * (offer[last - 1][4] + low):
            last -= 1
        del offer[last:]
    return offer, fixed, verified, shares


def _walk_python(n, ranked, depth, base, plain, floor, verify) -> Depths:
    """One walk along the ranking per depth, over the tokens on offer there."""
    offer, fixed, verified, shares = ranked
    best = []
    for s in range(depth + 1):
        start = plain + s * fixed
        total, row_sum, m = base, 0.0, 0
        rate, found = -math.inf, (base, plain, -1)
        for t, (_, _, _, g, row, need) in enumerate(offer):
            if need >= s:  # a self-draft's token beyond s draft steps
                continue
            total += g
            row_sum += row
            seconds = start + row_sum + verified[m]
            if g > floor * (row + shares[m]) and total / seconds > rate:
                rate, found = total / seconds, (total, seconds, t)
            m += 1
        best.append(found)
    return Depths(n, [t[2] for t in offer], [t[5] for t in offer], best)


def _walk_arrays(n, ranked, depth, base, plain, floor, verify) -> Depths:
    """Every depth at once, a row of the arrays per depth."""
    offer, fixed, table, _ = ranked
    if not offer:
        return Depths(n, [], [], [(base, plain, -1)] * (depth + 1))
    _, _, rows, g, r, needs = (np.array(x) for x in zip(*offer))
    # on[s, t]: token t is on offer with s draft steps
    steps = np.arange(depth + 1)[:, None]
    on = needs[None, :] < steps
    m = np.cumsum(on, axis=1)  # drafts in the prefix ending at t
    verified = np.asarray(table, dtype=np.float64)[np.maximum(m, 1) - 1]
    total = base + np.cumsum(on * g, axis=1)
    seconds = plain + steps * fixed + np.cumsum(on * r, axis=1) + verified
    per_token = np.maximum(verified - verify, 0.0) / np.maximum(m, 1)
    worth = on & (g > floor * (r + per_token))
    rate = np.where(worth, total / seconds, -np.inf)
    last = rate.argmax(axis=1)
    pick = np.arange(depth + 1)
    best = [
        (t, s, int(k)) if ok else (base, plain, -1)
        for t, s, k, ok in zip(
            total[pick, last].tolist(),
            seconds[pick, last].tolist(),
            last.tolist(),
            worth.any(axis=1).tolist(),
        )
    ]
    return Depths(n, rows.tolist(), needs.tolist(), best)

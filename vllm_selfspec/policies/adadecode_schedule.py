"""AdaDecode's deferred-layer schedule (pure logic, no vLLM; AdaDecode §2.2, Algorithm 1).

A request's *round* is the token it just sampled followed by the tokens predicted early from
it. Each token of the round has a *depth*: how many decoder layers it has been through so far.

* **Draft step** (``walk``): the round's last token goes through the layers one by one from 0.
  At each layer with a head, the head predicts the next token; a prediction more confident than
  γ ends the walk there and the next token starts at layer 0 in the next draft step. The token's
  remaining layers are *deferred*: they run later, together with the next tokens at those
  layers. So when the walking token reaches a layer that an earlier token of the round has not
  been through yet, that earlier token joins the walk from there on (it must: the walking token
  attends to its KV at that layer). Depths within a round therefore never increase along the
  round, and at any layer the tokens that run form a suffix of the round (a contiguous query
  for the attention kernel, ending at the walking token).
* **Finishing pass** (``finish_plan``): the verification forward. Every token enters at its
  depth and runs to the last layer, joined by the others as their depths are reached; rows of
  other requests (prefills, plain decodes) enter at 0. No (token, layer) is computed twice.

The target's distribution at the last layer then accepts or rejects the early predictions (vLLM's
rejection sampler); rejected tokens' KV is overwritten when their positions are used again.

The schedule drives a ``backend`` (the vLLM engine, or a toy model in the unit tests) with:

* ``backend.run(rows, start, stop)``: run layers ``start .. stop-1`` on ``rows``, a list of
  ``(request, index in its round)`` ordered by request then index, each request's rows a suffix
  of its round (its last row included);
* ``backend.predict(requests, layer) -> (tokens, confident)``: the head after ``layer`` layers on
  each request's last row: the predicted token and whether its probability clears γ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class Backend(Protocol):
    def run(self, rows: list[tuple[int, int]], start: int, stop: int) -> None: ...

    def predict(self, requests: list[int], layer: int) -> tuple[list[int], list[bool]]: ...


@dataclass
class Round:
    """One request's tokens since its last verification: ``tokens[0]`` was sampled by the target,
    the others were predicted early. ``depth[i]``: layers ``tokens[i]`` has been through."""

    tokens: list[int]
    depth: list[int] = field(default_factory=list)
    #: per early prediction, the layer whose head predicted it
    exits: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.depth:
            self.depth = [0] * len(self.tokens)

    @property
    def drafts(self) -> list[int]:
        return self.tokens[1:]


def walk(
    backend: Backend, rounds: Sequence[Round], walking: list[int], exits: Sequence[int]
) -> dict[int, int]:
    """One draft step for the rounds ``walking`` (indices into ``rounds``): their last token walks
    from layer 0 through the ``exits`` (layer counts with a head, ascending) and stops at the first
    confident one. Returns ``{round: predicted token}`` for the rounds whose walk found one; the
    others' last token ends at depth ``exits[-1]`` without a prediction."""
    exits = sorted(exits)
    predicted: dict[int, int] = {}
    layer = 0
    walking = list(walking)
    while walking and layer < exits[-1]:
        stop = next(e for e in exits if e > layer)
        # an earlier token of a walking round joins at its own depth: end the range there
        for r in walking:
            stop = min([stop] + [d for d in rounds[r].depth if layer < d < stop])
        rows = [(r, i) for r in walking for i, d in enumerate(rounds[r].depth) if d <= layer]
        backend.run(rows, layer, stop)
        for r, i in rows:
            rounds[r].depth[i] = stop
        layer = stop
        if layer in exits:
            tokens, confident = backend.predict(walking, layer)
            for r, t, ok in zip(walking, tokens, confident):
                if ok:
                    predicted[r] = t
                    rounds[r].exits.append(layer)
            walking = [r for r, ok in zip(walking, confident) if not ok]
    return predicted


def draft_round(
    backend: Backend, rounds: Sequence[Round], max_drafts: Sequence[int], exits: Sequence[int]
) -> None:
    """Draft steps until every round ended: a round ends when its last token found no confident
    head or when it holds ``max_drafts[r]`` early predictions (the last one is not run: the
    finishing pass runs it from layer 0)."""
    walking = [r for r in range(len(rounds)) if max_drafts[r] > 0]
    while walking:
        predicted = walk(backend, rounds, walking, exits)
        for r, t in predicted.items():
            rounds[r].tokens.append(t)
            rounds[r].depth.append(0)
        walking = [r for r in walking if r in predicted and len(rounds[r].drafts) < max_drafts[r]]


def finish_plan(depth: Sequence[int], end: int) -> list[tuple[int, int, list[int]]]:
    """The finishing pass for rows entering at ``depth`` (row order as in the batch):
    ``(start, stop, rows)`` layer ranges, each with the rows that run there (every row whose depth
    is at most ``start``); layers no row needs are skipped."""
    cuts = sorted({d for d in depth if d < end} | {end})
    return [(a, b, [i for i, d in enumerate(depth) if d <= a]) for a, b in zip(cuts, cuts[1:])]


def usable_prefix(
    round_tokens: Sequence[int], round_pos0: int, tokens: Sequence[int], pos0: int
) -> int:
    """How many of a verification's rows (``tokens`` from position ``pos0``) can resume from the
    round's computed layers: the rows must be the round's tokens at the round's positions (the
    scheduler may verify fewer drafts than were proposed); 0 when they are not."""
    if pos0 != round_pos0 or len(tokens) > len(round_tokens):
        return 0
    n = 0
    while n < len(tokens) and tokens[n] == round_tokens[n]:
        n += 1
    return n if n == len(tokens) else 0

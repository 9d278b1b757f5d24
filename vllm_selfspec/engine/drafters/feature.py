"""Draft rounds of feature heads (policies/feature.py): the head on the token's embedding and the
target's final-layer output at the position that sampled it. No decoder layer runs, so a draft
step builds no attention metadata and writes no KV: it is one adapter and one LM-head pass over
the drafting rows.

Where the final-layer output comes from: vLLM hands the proposer ``sample_hidden_states``, the
model's normed output at its logits rows, in batch order. A step that verified drafts has
``num_draft_tokens + 1`` rows per request; the request's last sampled token (its accepted drafts,
then the bonus token) came from its row ``len(sampled) - 1``, the output one position before that
token: offset 1, what the head's first draft reads. A step that verified nothing has one row
per request (vLLM's Medusa proposer picks the same rows).

Worked example: request A verified 3 drafts and accepted 1 (sampled ``[d1, b]``), request B
verified none (sampled ``[x]``), request C is a prefill chunk that sampled nothing::

    logits rows:  A0 A1 A2 A3 B0 C0
    >>> feature_rows([[11, 12], [13], []], [3, 0, 0])
    [1, 4, -1]
"""

from __future__ import annotations

import time

import torch

from ...policies.feature import EXIT
from ..drafting import Drafter, RoundStart


def feature_rows(
    sampled_token_ids: list[list[int]], num_draft_tokens: list[int] | None
) -> list[int]:
    """Per batch row, the logits row whose output sampled the row's last token (-1: the row
    sampled nothing). ``num_draft_tokens``: the drafts each row verified (None: none did)."""
    out, start = [], 0
    for i, sampled in enumerate(sampled_token_ids):
        out.append(start + len(sampled) - 1 if sampled else -1)
        start += 1 + (num_draft_tokens[i] if num_draft_tokens is not None else 0)
    return out


class FeatureDrafter(Drafter):
    """The drafter ``feature`` (engine/drafting.py)."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.head = ctx.executor.heads[f"heads@{EXIT}"]
        #: the head is trained for offsets 1..max_offset; later drafts of a round reuse the last
        self.max_offset = self.head.max_offset
        self._inputs: tuple | None = None

    def step_inputs(self, sampled_token_ids, sample_hidden_states, spec_decode_metadata) -> None:
        """This step's sampled tokens, the model's output at its logits rows and what was
        verified (kept for ``draft``)."""
        self._inputs = (sampled_token_ids, sample_hidden_states, spec_decode_metadata)

    @torch.inference_mode()
    def draft(self, runner, active, sampling_metadata, probs, drafts: list[list[int]]) -> None:
        """One draft round for the ``active`` requests ((batch row, decision, max drafts)):
        fills ``drafts`` and, for sampled requests, ``probs`` (the q each draft was drawn from)."""
        ctx = self.ctx
        sampled, hidden, meta = self._inputs
        if hidden is None:
            raise RuntimeError("feature heads need the model's output at its logits rows")
        r = RoundStart.of(runner, active, sampling_metadata)
        rows, gammas, rows_t, tok, temps = r.rows, r.gammas, r.rows_t, r.tok, r.temps
        where = feature_rows(sampled, None if meta is None else list(meta.num_draft_tokens))
        dev = hidden.device
        feature = hidden.index_select(0, torch.tensor([where[i] for i in rows], device=dev))
        layout = ctx.executor.layout
        alive = list(range(len(rows)))
        for step in range(max(gammas)):
            alive = [j for j in alive if gammas[j] > step]
            if not alive:
                break
            t0 = time.perf_counter()
            J = torch.tensor(alive, dtype=torch.long)
            offset = torch.full((len(alive),), min(step + 1, self.max_offset), device=dev)
            x = layout.embed(tok[J].to(dev))
            h = self.head.transform(x, feature[J.to(dev)], offset)
            logits = ctx.executor.project(layout.norm(h)).float()
            nxt = ctx.pick(logits, rows_t[J], temps, probs, J, step)
            ctx.costs.add_draft(0.0, len(alive), time.perf_counter() - t0)
            ctx.stats.draft_forwards += 1
            nxt_list = nxt.tolist()
            for a, token in zip(alive, nxt_list):
                if token >= 0:  # NO_DRAFT: no valid draft distribution, the round ends
                    drafts[rows[a]].append(token)
            alive = [a for a, token in zip(alive, nxt_list) if token >= 0]
            tok[J] = nxt.cpu()
        ctx.count_rounds(drafts, rows)

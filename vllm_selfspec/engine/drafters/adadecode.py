"""AdaDecode in vLLM's step structure: the deferred-layer schedule
(``vllm_selfspec/policies/adadecode_schedule.py``) driven through the target's own layers over its
paged KV cache.

vLLM's spec-decode step is "verify the drafts, then draft the next ones". AdaDecode maps onto it
as follows:

* **drafting** (after a step sampled a token ``b`` per request):
  ``adadecode_schedule.draft_round`` walks ``b`` from layer 0 through the heads; a confident head
  predicts ``d1``, which walks from 0 while ``b`` joins it in the layers past its exit, and so on.
  Every (token, layer) that runs writes the target's KV cache at the token's position. The
  round's tokens stay where they stopped: each row's (pending, residual) state at its depth is
  kept in a ``PendingRound``;
* **finishing** (the next step's target forward, ``finish``, called by the runner mixin in place
  of the model's forward): rows of a pending round enter at their depth, every other row at 0
  (``adadecode_schedule.finish_plan``); all reach the last layer, and vLLM's rejection sampler
  accepts or rejects the early predictions as usual (greedy: equality; sampling: min(1, p/q)
  with the q the head drew from). So the deep layers of an early token are computed once, in
  the pass that verifies it: no second pass over layers the draft already ran.

A pending round is used only by the very next target forward, only for the rows that are
exactly its tokens at its positions and KV slots (the scheduler may verify fewer drafts, skip or
preempt the request); anything else runs from layer 0, which is always correct.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from ...plans import LayerPlan
from ...policies.adadecode_schedule import Round, draft_round, finish_plan, usable_prefix
from ..drafting import Drafter, finite_rows
from ..kv_groups import slots_of
from ..stats import layer_computations


@dataclass
class PendingRound:
    round: Round
    pos0: int  # position of round.tokens[0]
    slots: torch.Tensor  # [groups, n] KV slot of each token per KV-cache group (CPU, int64)
    h: torch.Tensor  # [n, d] pending delta at the token's depth
    res: torch.Tensor  # [n, d] residual stream at the token's depth


class _DraftBackend:
    """``adadecode_schedule.Backend`` for one draft round of a batch of requests: row (r, i) is token i of
    request r's round, at flat index ``r * width + i`` of the state buffers."""

    def __init__(
        self,
        engine: DeferredEngine,
        runner,
        rows: list[int],
        rounds: list[Round],
        pos0: np.ndarray,
        width: int,
        temps: list[float],
        probs,
    ):
        ctx = engine.ctx
        self.engine, self.ctx, self.rounds, self.width = engine, ctx, rounds, width
        self.exe = ctx.executor
        dev = runner.device
        kv = ctx.kv_groups()
        self.tables = kv.tables(runner.input_batch, torch.tensor(rows))
        B = len(rows)
        pos = torch.from_numpy(pos0.astype(np.int64))[:, None] + torch.arange(width)[None, :]
        self.pos = pos.reshape(-1).to(dev)
        # each group's slot of every (request, token) row; rows past a request's last block
        # (past its max length) never run: any slot will do for them
        self.slots = torch.stack(
            [
                slots_of(
                    t.repeat_interleave(width, 0),
                    self.pos.clamp(max=t.shape[1] * g.block_size - 1),
                    g.block_size,
                )
                for t, g in zip(self.tables, kv.groups)
            ]
        )
        d = ctx.info.hidden_size
        param = self.exe.layout.norm.weight
        self.h = torch.zeros(B * width, d, dtype=param.dtype, device=dev)
        self.res = torch.zeros_like(self.h)
        self.pos0 = pos0
        #: request r's sampled drafts' q go to probs[r] (None: all greedy)
        self.temps, self.probs = temps, probs
        self.plan = LayerPlan.full(ctx.info.num_layers)
        self._md: dict[tuple, tuple] = {}

    def _idx(self, rows: list[tuple[int, int]]) -> torch.Tensor:
        return torch.tensor(
            [r * self.width + i for r, i in rows], dtype=torch.long, device=self.h.device
        )

    def run(self, rows: list[tuple[int, int]], start: int, stop: int) -> None:
        def build():
            per_req = Counter(r for r, _ in rows)  # rows are ordered by request
            reqs = list(per_req)
            idx = self._idx(rows)
            # each request's rows end at its round's last token
            seq = torch.tensor(
                [int(self.pos0[r]) + len(self.rounds[r].tokens) for r in reqs], dtype=torch.int32
            )
            attention = self.ctx.rows_attention(
                [t[torch.tensor(reqs, device=t.device)] for t in self.tables],
                list(per_req.values()),
                seq,
                list(self.slots[:, idx]),
                self.pos[idx],
            )
            return idx, attention

        idx, attention = self.ctx.kv_groups().latest(self._md, tuple(rows), build)
        if start == 0:  # rows entering the model: embeddings, no residual yet
            toks = torch.tensor([self.rounds[r].tokens[i] for r, i in rows], device=idx.device)
            h, res = self.exe.layout.embed(toks), None
        else:
            h, res = self.h[idx], self.res[idx]
        t0 = time.perf_counter()
        with attention.context():
            h, res = self.exe.run_layers(self.plan, h, res, self.pos[idx], start, stop)
        self.h[idx], self.res[idx] = h, res
        st = self.ctx.stats
        st.draft_token_layers += len(rows) * (stop - start)
        st.draft_layers += (stop - start) * len({r for r, _ in rows})
        self.ctx.costs.add_draft(stop - start, len(rows), time.perf_counter() - t0)

    def predict(self, requests: list[int], layer: int) -> tuple[list[int], list[bool]]:
        rows = [(r, len(self.rounds[r].tokens) - 1) for r in requests]
        idx = self._idx(rows)
        x = self.h[idx] + self.res[idx]
        head = self.exe.heads[f"heads@{layer}"]
        logits = self.exe.project(self.exe.layout.norm(head.transform(x))).float()
        valid, logits, invalid = finite_rows(logits)
        self.ctx.stats.invalid_draft_rows += invalid  # such a row is never confident
        temps = torch.tensor([self.temps[r] for r in requests], device=logits.device)
        sampled = temps > 0
        q = torch.softmax(logits / torch.where(sampled, temps, 1.0)[:, None], -1)
        nxt = q.argmax(-1)
        if bool(sampled.any()):
            draw = torch.multinomial(q.cpu(), 1, generator=self.ctx.generator).squeeze(1)
            nxt = torch.where(sampled, draw.to(nxt.device), nxt)
        conf = q.gather(1, nxt[:, None]).squeeze(1)
        confident = ((conf > self.engine.threshold) & valid).tolist()
        vocab_ids = self.exe.vocab_ids
        tokens = (vocab_ids[nxt] if vocab_ids is not None else nxt).tolist()
        st = self.ctx.stats
        for a, r in enumerate(requests):
            if confident[a]:
                st.early_predicted[layer] += 1
            elif layer == self.engine.exits[-1]:  # a walk that found no confident head
                st.unconfident_walks += 1
            if confident[a] and self.temps[r] > 0:
                qa = q[a]
                if vocab_ids is not None:  # q over the draft vocabulary, 0 elsewhere
                    qa = qa.new_zeros(self.ctx.info.vocab_size).index_copy_(0, vocab_ids, qa)
                self.probs[r, len(self.rounds[r].tokens) - 1] = qa.to(self.probs.dtype)
        return tokens, confident


class DeferredEngine(Drafter):
    """AdaDecode's drafting and finishing pass: the drafter ``deferred`` (engine/drafting.py)."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        policy = ctx.policy
        self.exits: tuple[int, ...] = policy.exit_layers
        self.threshold: float = policy.threshold
        self.L = ctx.info.num_layers
        #: request id -> its round, for the next target forward only
        self.pending: dict[str, PendingRound] = {}
        #: request id -> the exit layer of each early prediction of its last verified round
        self.round_exits: dict[str, list[int]] = {}
        #: requests whose rows in the last target forward were decode rows (not a prefill)
        self.decoding: set[str] = set()

    # ---- drafting -------------------------------------------------------------------------------
    def draft(self, runner, active, sampling_metadata, probs, drafts: list[list[int]]) -> None:
        """One draft round for the ``active`` requests ((batch row, decision, max drafts)):
        fills ``drafts`` and, for sampled requests, ``probs`` (the q each draft was drawn from)."""
        ib = runner.input_batch
        rows = [i for i, _, _ in active]
        gammas = [g for _, _, g in active]
        pos0 = ib.num_tokens_no_spec[rows].astype(np.int64) - 1  # the token just sampled
        rounds = [Round([int(ib.token_ids_cpu[i, p])]) for i, p in zip(rows, pos0)]
        temps = [0.0] * len(rows)
        if not sampling_metadata.all_greedy:
            t = sampling_metadata.temperature.cpu()
            temps = [float(t[i]) for i in rows]
        backend = _DraftBackend(self, runner, rows, rounds, pos0, max(gammas) + 1, temps, probs)
        draft_round(backend, rounds, gammas, self.exits)
        for j, (i, rnd) in enumerate(zip(rows, rounds)):
            drafts[i].extend(rnd.drafts)
            n = len(rnd.tokens)
            flat = torch.arange(j * backend.width, j * backend.width + n, device=backend.h.device)
            req_id = ib.req_ids[i]
            self.pending[req_id] = PendingRound(
                rnd, int(pos0[j]), backend.slots[:, flat].cpu(), backend.h[flat], backend.res[flat]
            )
            self.round_exits[req_id] = list(rnd.exits)
        self.ctx.count_rounds(drafts, rows)

    def verified(self, req_id, n_drafted, n_accepted, sampled, feedback) -> None:
        st = self.ctx.stats
        st.early_accepted.update(self.round_exits.pop(req_id, [])[:n_accepted])  # which heads
        if req_id in self.decoding:
            st.decode_tokens += len(sampled)

    # ---- the finishing pass (the target forward of the next step) ---------------------------
    def target_forward(self, runner, input_ids, positions):
        """``finish``, and a forward without resumed rows counted as a plain one."""
        out = self.finish(runner, input_ids, positions)
        if out is None:
            self.count_plain(runner)
        return out

    def finish(self, runner, input_ids: torch.Tensor | None, positions: torch.Tensor):
        """The target forward with pending rounds resumed at their depth; None when no row can
        resume (the caller then runs the model's own forward)."""
        pending, self.pending = self.pending, {}
        if not pending or input_ids is None:
            self.ctx.stats.rounds_dropped += len(pending)
            return None
        ib = runner.input_batch
        num_reqs = ib.num_reqs
        qsl = runner.query_start_loc.np[: num_reqs + 1].astype(np.int64)
        N, real = input_ids.shape[0], int(qsl[-1])
        layout = self.ctx.executor.layout
        kv = self.ctx.kv_groups()
        slot_all = torch.stack(kv.forward_slots())  # [groups, N]
        depth = np.zeros(N, dtype=np.int64)
        depth[real:] = self.L  # padding rows never run
        resumed: list[tuple[int, int, PendingRound]] = []
        ids_cpu = input_ids[:real].cpu().tolist()
        pos_cpu = positions[:real].cpu()
        for i, req_id in enumerate(ib.req_ids[:num_reqs]):
            rec = pending.get(req_id)
            if rec is None:
                continue
            a, b = int(qsl[i]), int(qsl[i + 1])
            n = usable_prefix(rec.round.tokens, rec.pos0, ids_cpu[a:b], int(pos_cpu[a]))
            if n == 0 or not torch.equal(slot_all[:, a:b].cpu().to(torch.int64), rec.slots[:, :n]):
                continue
            depth[a:b] = rec.round.depth[:n]
            resumed.append((a, n, rec))
        st = self.ctx.stats
        st.rounds_resumed += len(resumed)
        st.rounds_dropped += len(pending) - len(resumed)
        if not resumed:
            return None
        h = layout.embed(input_ids)
        res = torch.zeros_like(h)
        for a, n, rec in resumed:
            m = sum(1 for d in rec.round.depth[:n] if d > 0)  # rows at depth 0 start afresh
            h[a : a + m], res[a : a + m] = rec.h[:m], rec.res[:m]
        self._count(ib, qsl, depth)
        plan = LayerPlan.full(self.L)
        exe = self.ctx.executor
        req_of_row = np.searchsorted(qsl, np.arange(real), side="right") - 1
        for start, stop, rows in finish_plan(depth.tolist(), self.L):
            if len(rows) == real:  # every row: the runner's own metadata is in the context
                hh, rr = exe.run_layers(
                    plan, h, None if start == 0 else res, positions, start, stop
                )
                h, res = hh, rr
                continue
            idx = torch.tensor(rows, dtype=torch.long, device=h.device)
            reqs, counts = np.unique(req_of_row[rows], return_counts=True)
            seq = positions[torch.from_numpy(qsl[reqs + 1] - 1).to(positions.device)] + 1
            tables = kv.tables(ib, torch.from_numpy(reqs))
            attention = self.ctx.rows_attention(
                tables, counts.tolist(), seq, list(slot_all[:, idx]), positions[idx]
            )
            with attention.context():
                hh, rr = exe.run_layers(
                    plan, h[idx], None if start == 0 else res[idx], positions[idx], start, stop
                )
            h[idx], res[idx] = hh, rr
        return layout.norm(h, res)[0]

    def _count(self, ib, qsl: np.ndarray, depth: np.ndarray) -> None:
        """Layer computations of the decode rows of this pass (prefill rows excluded)."""
        st = self.ctx.stats
        self.decoding = set()
        for i, req_id in enumerate(ib.req_ids[: ib.num_reqs]):
            if ib.num_computed_tokens_cpu[i] < ib.num_prompt_tokens[i]:
                continue
            self.decoding.add(req_id)
            d = depth[qsl[i] : qsl[i + 1]]
            st.verify_token_layers += int((self.L - d).sum())
            st.verify_rows += len(d)
            st.target_layers -= int(d.min())  # the pass ran L - min(depth) layers for it

    def count_plain(self, runner) -> None:
        """A target forward without resumed rows: its decode rows ran every layer."""
        ib = runner.input_batch
        qsl = runner.query_start_loc.np[: ib.num_reqs + 1].astype(np.int64)
        self._count(ib, qsl, np.zeros(int(qsl[-1]), dtype=np.int64))

    def forget(self, req_id: str) -> None:
        self.pending.pop(req_id, None)
        self.round_exits.pop(req_id, None)

    def describe(self) -> dict:
        return {"layer_computations": layer_computations(self.ctx.stats, self.L)}

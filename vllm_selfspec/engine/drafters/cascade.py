"""Cascade's draft rounds (policies/cascade.py): the drafter ``cascade`` (engine/drafting.py).

Each draft token walks the trained exits shallowest first and is drafted at the first whose
confidence estimator clears its threshold (``PlanExecutor.run_cascade``: one forward per draft
step for all rows, each row leaving the walk at its exit); a row whose walk finds no confident
exit ends its round. Before each draft step ``CascadeWalks`` caps how deep each row's walk may go:
the policy's ``walk_cap`` for the probability that the row's drafts so far are all accepted, and
never deeper than the exit of the row's previous draft token (a deeper exit would attend to KV
slots that token never wrote).

After verification the policy learns, per draft token, the cap and exit it was drafted at and
whether it was accepted (``Feedback.cascade_steps``). With ``lossy: true`` every draft is
accepted unverified (worker.UnverifiedAcceptance); the tokens emitted so are counted here.

Worked example: exits at layers 8 and 16; row 0's first token clears exit 8, its second none
(round over: one draft); row 1's first token clears exit 16, the cap of its second is then 16::

    steps per row -> [[(1, 0), (0, -1)], [(1, 1), ...]]     # (walk cap, exit index or -1)
"""

from __future__ import annotations

import time

import torch

from ..drafting import Drafter, RoundStart

#: lossy mode: requests whose unverified-token count stats keep (the most recent ones)
UNVERIFIED_REQUESTS_KEPT = 4096


class CascadeWalks:
    """One Cascade draft round of a group of rows: before each draft step, how deep each row's
    walk may go; after it, which exit each row drafted from."""

    def __init__(self, policy, states: list) -> None:
        self.policy, self.states = policy, states
        n = len(policy.cascade)
        self.cap = [n - 1] * len(states)  # deepest exit the row's next token may use
        self.prefix = [1.0] * len(states)  # P(the row's drafts so far are all accepted)
        self.steps: list[list[tuple[int, int]]] = [[] for _ in states]

    def caps(self, alive: list[int]) -> tuple[list[int], list[int]]:
        """The rows that draft this step, and each one's walk cap (the others' rounds end)."""
        keep, caps = [], []
        for j in alive:
            c = min(self.cap[j], self.policy.walk_cap(self.states[j], self.prefix[j]))
            if c >= 0:
                keep.append(j)
                caps.append(c)
        return keep, caps

    def record(self, alive: list[int], caps: list[int], chosen: list[int], stats) -> None:
        for j, c, e in zip(alive, caps, chosen):
            self.steps[j].append((c, e))
            stats.exit_drafted[self.policy.cascade[e].layer if e >= 0 else "none"] += 1
            if e >= 0:
                self.cap[j] = e
                self.prefix[j] *= self.policy.acceptance(self.states[j], e)


class CascadeDrafter(Drafter):
    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        #: request id -> (walk cap, exit index or -1) per draft step of its last round
        self.round_exits: dict[str, list[tuple[int, int]]] = {}
        #: the lossy sampler: drafts are accepted unverified
        self.lossy = bool(getattr(ctx.policy, "lossy", False))

    def verified(self, req_id, n_drafted, n_accepted, sampled, feedback) -> None:
        st = self.ctx.stats
        if self.lossy:
            st.unverified_tokens += n_accepted
            st.unverified_by_request[req_id] = st.unverified_by_request.pop(req_id, 0) + n_accepted
            while len(st.unverified_by_request) > UNVERIFIED_REQUESTS_KEPT:
                del st.unverified_by_request[next(iter(st.unverified_by_request))]
        steps = self.round_exits.pop(req_id, None)
        if steps and n_drafted:
            cascade = self.ctx.policy.cascade
            st.exit_accepted.update(cascade[e].layer for _, e in steps[:n_accepted])
            feedback.cascade_steps = steps

    @torch.inference_mode()
    def draft(self, runner, active, sampling_metadata, probs, drafts: list[list[int]]) -> None:
        ctx, ib, dev = self.ctx, runner.input_batch, runner.device
        r = RoundStart.of(runner, active, sampling_metadata)
        rows, gammas, rows_t, pos0, tok, temps = r.rows, r.gammas, r.rows_t, r.pos0, r.tok, r.temps
        plans = [d.plan for _, d, _ in active]
        cascade = active[0][1].cascade  # Cascade's decisions share it (one static plan)
        tables = ctx.kv_groups().tables(ib)
        walks = CascadeWalks(ctx.policy, [ctx.states[ib.req_ids[r]] for r in rows])
        alive = list(range(len(rows)))
        for step in range(max(gammas)):
            alive, caps = walks.caps([j for j in alive if gammas[j] > step])
            if not alive:
                break
            J = torch.tensor(alive, dtype=torch.long)
            pos = (pos0[J] + step).to(dev)
            t0 = time.perf_counter()
            step_tables = [t[rows_t[J].to(t.device)] for t in tables]
            with ctx.step_attention(step_tables, pos, step).context():
                logits, chosen, depth = ctx.executor.run_cascade(
                    plans[alive[0]], cascade, tok[J].to(dev), pos, torch.tensor(caps)
                )
            ctx.costs.add_draft(depth, len(alive), time.perf_counter() - t0)
            ctx.stats.draft_forwards += 1
            ctx.stats.draft_layers += depth * len(alive)
            chosen = chosen.tolist()
            walks.record(alive, caps, chosen, ctx.stats)
            if logits is None:  # no row found a confident exit: every round ends
                break
            nxt = ctx.pick(logits.float(), rows_t[J], temps, probs, J, step)
            nxt_list = nxt.tolist()
            kept = [chosen[a] >= 0 and nxt_list[a] >= 0 for a in range(len(alive))]
            for a, j in enumerate(alive):
                if kept[a]:  # a confident exit, and a valid draft (not NO_DRAFT)
                    drafts[rows[j]].append(nxt_list[a])
            alive = [j for a, j in enumerate(alive) if kept[a]]
            tok[J] = nxt.cpu()
        self.round_exits.update(
            (ib.req_ids[rows[j]], steps) for j, steps in enumerate(walks.steps) if steps
        )
        ctx.count_rounds(drafts, rows, plans)

    def forget(self, req_id: str) -> None:
        self.round_exits.pop(req_id, None)

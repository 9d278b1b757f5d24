"""Draft rounds through each request's layer plan (layerskip, DEL, KnapSpec): the drafter
``plan`` (engine/drafting.py).

Every request drafts one token per draft step through the sub-layers its plan keeps, over the
**target's own paged KV cache** (draft KV is written at positions the next verification
rewrites in every layer, so it never leaks into the output). One forward per draft step for the
whole batch, whatever the plans: rows with equal plans run together, and with different plans
each sub-layer runs once on the rows whose plan includes it (``PlanExecutor.run_mixed``), so the
step costs the union of the plans, not their sum. A row leaves when its round ends: its draft
length, or a draft whose top-1 probability is under the decision's ``min_confidence``.

Worked example: rows 0 and 2 draft 3 and 1 tokens through the same plan; step 0 runs both,
steps 1 and 2 row 0 alone::

    active = [(0, DraftDecision(plan, 3), 3), (2, DraftDecision(plan, 1), 1)]
    drafts -> [[t1, t2, t3], [], [u1]]
"""

from __future__ import annotations

import time

import torch

from ..drafting import Drafter, RoundStart


class PlanDrafter(Drafter):
    @torch.inference_mode()
    def draft(self, runner, active, sampling_metadata, probs, drafts: list[list[int]]) -> None:
        ctx, dev = self.ctx, runner.device
        r = RoundStart.of(runner, active, sampling_metadata)
        rows, gammas, rows_t, pos0, tok, temps = r.rows, r.gammas, r.rows_t, r.pos0, r.tok, r.temps
        plans = [d.plan for _, d, _ in active]
        floors = [d.min_confidence for _, d, _ in active]
        need_conf = any(f is not None for f in floors)
        tables = ctx.kv_groups().tables(runner.input_batch)
        alive = list(range(len(rows)))
        for step in range(max(gammas)):
            alive = [j for j in alive if gammas[j] > step]
            if not alive:
                break
            J = torch.tensor(alive, dtype=torch.long)
            pos = (pos0[J] + step).to(dev)
            step_plans = [plans[j] for j in alive]
            t0 = time.perf_counter()
            step_tables = [t[rows_t[J].to(t.device)] for t in tables]
            if len(set(step_plans)) > 1:
                logits = self._run_mixed(step_plans, step_tables, tok[J].to(dev), pos, step)
                depth = max(p.layer_cost for p in step_plans)
            else:
                plan = step_plans[0]
                with ctx.step_attention(step_tables, pos, step).context():
                    h, res = ctx.executor.run(plan, tok[J].to(dev), pos)
                logits = ctx.executor.logits(plan, h, res)
                depth = plan.layer_cost
            ctx.costs.add_draft(depth, len(alive), time.perf_counter() - t0)
            ctx.stats.draft_forwards += 1
            ctx.stats.draft_layers += sum(p.layer_cost for p in step_plans)
            logits = logits.float()
            nxt = ctx.pick(logits, rows_t[J], temps, probs, J, step)
            nxt_list = nxt.tolist()
            keep = [t >= 0 for t in nxt_list]  # NO_DRAFT: no valid draft distribution
            if need_conf:
                conf = torch.softmax(logits, -1).amax(-1).tolist()
                keep = [
                    k and (floors[j] is None or c >= floors[j])
                    for k, j, c in zip(keep, alive, conf)
                ]
            for a, j in enumerate(alive):
                if keep[a]:
                    drafts[rows[j]].append(nxt_list[a])
            alive = [j for a, j in enumerate(alive) if keep[a]]
            tok[J] = nxt.cpu()
        ctx.count_rounds(drafts, rows, plans)

    def _run_mixed(self, plans, tables, tokens, pos, step: int):
        """``PlanExecutor.run_mixed`` with the attention of each row subset (its metadata built
        again when another subset's was built in between: ``KVGroups.latest``)."""
        ctx = self.ctx
        built: dict[tuple[int, ...], tuple] = {}

        def context(rows: list[int]):
            def build():
                idx = torch.tensor(rows, device=pos.device)
                return ctx.step_attention([t[idx] for t in tables], pos[idx], step)

            return ctx.kv_groups().latest(built, tuple(rows), build).context()

        return torch.stack(ctx.executor.run_mixed(plans, tokens, pos, context))

"""The host time of context lookup per engine step, offline: what `auto` adds to a step besides
the forwards, at batch 1, 8 and 64 and contexts of 1k and 32k tokens (no engine, no model).

    python benchmarks/lookup_host.py [--steps 200] [--self-drafts] [--out DIR]
                                            # DIR/results.json, DIR/table.md

Each request is a prompt of the given length (a text with repeats, as a document or code to
edit is), then decoding: per step every request gets new tokens (its accepted drafts and the
target's token), and the step runs what the proposer runs, with the same classes
(``engine/proposer.py``: ``_start_step``, ``_lookup``, ``_candidates``, ``_control``,
``_settle``, ``_verification``):

* lookup: the request's tree takes its new tokens (and, while a long prompt is still being
  indexed, up to ``INDEX_BUDGET`` older ones), then it drafts, beside the tenant's outputs and
  a datastore of 50k tokens (``SharedIndex``);
* choice: each request's acceptance estimate per slot (``AcceptanceTracker.cumulative``), its
  candidate, and the goodput controller's choice for the batch (``GoodputController.choose``).
  With ``--self-drafts`` each request also has a self-draft of ``auto``'s length, and its
  candidate is whichever of the two the controller would rather have (``weighed``,
  ``prefer_free``), so that the controller searches draft steps too;
* bookkeeping: the step's cost samples (``StepCostModel.add_target``, ``add_draft``: the model
  is re-fitted each step, as in the engine), the controller's settlement of its last choice
  (``settle``) and each request's verification outcome (``AcceptanceTracker.observe``).

Per cell: the median microseconds per step of each part over the steps after the prompts were
indexed (steady state), and the lookup time of the step in which a new request of that context
joins the running batch (the stall that the per-step indexing budget bounds).

Warm (the default), the host's caches hold what the proposer touched the step before, as beside
a GPU forward. ``--cold-mb 400`` sweeps 400 MB between steps, as a forward of the embedded model
on the same CPU does: the same Python then takes several times longer. The engine reports the
split live (``get_stats()["host_us_per_step"]``: policy, lookup, controller).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def text_with_repeats(rng: random.Random, n: int, vocab: int = 32000, first: int = 0) -> list[int]:
    """A token sequence where stretches recur (as in code or a document being edited): token
    ids in ``first .. vocab - 1``."""
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < 0.5:
            start = rng.randrange(len(out))
            out += out[start : start + rng.randint(4, 40)]
        else:
            out += [rng.randrange(first, vocab) for _ in range(rng.randint(2, 20))]
    return out[:n]


def run_cell(
    batch: int,
    context: int,
    steps: int,
    k: int | None = None,
    cold_mb: int = 0,
    self_drafts: bool = False,
) -> dict:
    import numpy as np

    from vllm_selfspec.config import AUTO_OPTIONS

    k = k or AUTO_OPTIONS["num_speculative_tokens"]  # the longest lookup draft auto verifies

    # a buffer swept between steps, as a forward on the same CPU sweeps the caches
    sweep = np.ones(cold_mb * 2**20 // 8) if cold_mb else None

    from vllm_selfspec.goodput import AcceptanceTracker, Candidate, GoodputController
    from vllm_selfspec.goodput.choice import prefer_free
    from vllm_selfspec.goodput.costs import StepCostModel
    from vllm_selfspec.lookup import SLOTS, ContextIndex, SharedIndex

    rng = random.Random(batch * 100003 + context)
    shared = SharedIndex(pinned=[text_with_repeats(rng, 500) for _ in range(100)])
    for _ in range(20):
        shared.add(text_with_repeats(rng, 200), tenant="t")
    costs = StepCostModel(skip_first=False)
    for _ in range(50):  # a measured cost line: ~30 ms a step, ~2 ms a verified token
        for r, extra in ((batch, 0), (batch, batch), (batch, 3 * batch)):
            costs.add_target(r, r + extra, 0.03 + 0.0005 * r + 0.002 * extra)
    g = AUTO_OPTIONS["self_draft_tokens"]  # the longest self-draft auto makes
    if self_drafts:  # a measured draft step: ~3 ms fixed, ~0.2 ms a row (trained heads)
        for _ in range(50):
            for layers, rows in ((1.0, 1), (1.0, batch + 1), (2.0, batch)):
                costs.add_draft(layers, rows, 0.0015 * (1 + layers) + 0.0002 * layers * rows)
    controller = GoodputController(costs)
    tracker = AcceptanceTracker(SLOTS)
    self_tracker = AcceptanceTracker(g)
    prompts = [text_with_repeats(rng, context) for _ in range(batch)]
    requests = [
        {
            "tokens": p,
            "index": ContextIndex(),
            "view": shared.view("t"),
            "rates": tracker.new_state(),
            "self_rates": self_tracker.new_state(),
        }
        for p in prompts
    ]

    def option(req, tokens, slots, coef, v1):
        """The request's candidate, as the proposer's ``_candidates`` makes it: its lookup
        draft, or (``self_drafts``) its self-draft where the controller would rather have it."""
        free = Candidate(0, [])
        if tokens:
            free = Candidate(
                len(tokens), tracker.cumulative(req["rates"], len(tokens), slots), free=True
            )
        if not self_drafts:
            return free
        row, plan = float(coef[2]), float(coef[0] + coef[1])
        paid = Candidate(g, self_tracker.cumulative(req["self_rates"], g), row, plan)
        if not tokens:
            return paid
        return free if prefer_free(*controller.weighed(free, paid, v1), v1) else paid

    def verified(n: int, free: bool) -> int:
        """How many of ``n`` drafts the target accepts: a lookup draft's any number alike, a
        self-draft's each token with probability 0.8 (trained heads on a repetitive text)."""
        if free:
            return rng.randint(0, n)
        return next((j for j in range(n) if rng.random() >= 0.8), n)

    parts = {"lookup": [], "choice": [], "bookkeeping": []}
    caught_up = None  # the steps it took to index every prompt
    for _ in range(steps):
        if sweep is not None:
            sweep.sum()
        t0 = time.perf_counter()
        drafts = []
        for req in requests:
            index, toks = req["index"], req["tokens"]
            index.extend(toks[len(index) :])
            drafts.append(index.propose(k, req["view"], batch))
        t1 = time.perf_counter()
        coef, v1 = costs.draft_coefficients(), costs.token_seconds() or 0.0
        cands = [option(req, t, s, coef, v1) for req, (t, s) in zip(requests, drafts)]
        choice = controller.choose(cands)
        t2 = time.perf_counter()
        outcomes = [(min(n, c.max_tokens), c.free) for c, n in zip(cands, choice.tokens)]
        outcomes = [(n, verified(n, free), free) for n, free in outcomes]
        drafted = sum(n for n, _, _ in outcomes)
        paid_rows = sum(1 for n, _, free in outcomes if n and not free)
        forward = 0.03 + 0.0005 * batch + 0.002 * drafted  # the cost line above
        draft_step = 0.0015 * 2 + 0.0002 * paid_rows if paid_rows else 0.0
        t3 = time.perf_counter()
        # what the proposer keeps per step: the forwards' cost samples, the controller's
        # settlement of its last choice, each request's verification outcome
        costs.add_target(batch, batch + drafted, forward)
        if paid_rows:
            costs.add_draft(1.0, paid_rows, draft_step)
        controller.settle(batch + sum(a for _, a, _ in outcomes), batch, forward + draft_step)
        for req, (_, s), (n, accepted, free) in zip(requests, drafts, outcomes):
            if free:
                tracker.observe(req["rates"], n, accepted, s)
            else:
                self_tracker.observe(req["self_rates"], n, accepted)
        t4 = time.perf_counter()
        parts["lookup"].append(t1 - t0)
        parts["choice"].append(t2 - t1)
        parts["bookkeeping"].append(t4 - t3)
        for req, (_, accepted, _) in zip(requests, outcomes):  # the step's new tokens
            req["tokens"] += text_with_repeats(rng, accepted + 1)
        if caught_up is None and all(r["index"].lo == r["index"].floor for r in requests):
            caught_up = len(parts["lookup"])
    caught_up = steps if caught_up is None else caught_up
    mem = sum(r["index"].memory_bytes() for r in requests)
    # a new request of the same context length joins the running batch: its first step's
    # lookup (the median of 5 such joins)
    joins = []
    for _ in range(5):
        requests[0] = {**requests[0], "tokens": text_with_repeats(rng, context)}
        requests[0]["index"] = ContextIndex()
        t0 = time.perf_counter()
        for req in requests:
            index, toks = req["index"], req["tokens"]
            index.extend(toks[len(index) :])
            index.propose(k, req["view"], batch)
        joins.append(time.perf_counter() - t0)
    admission = statistics.median(joins)

    def us(xs):
        return round(1e6 * statistics.median(xs), 1) if xs else None

    steady = {name: us(xs[caught_up:]) for name, xs in parts.items()}
    steady["total"] = round(sum(v for v in steady.values() if v is not None), 1)
    first = {name: round(1e6 * xs[0], 1) for name, xs in parts.items()}
    return {
        "batch": batch,
        "context": context,
        "steady_us": steady,
        "first_step_us": first,
        "admission_step_lookup_us": round(1e6 * admission, 1),
        "steps_to_index_prompts": caught_up,
        "request_index_mb": round(mem / 2**20, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--contexts", default="1024,32768")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--cold-mb",
        type=int,
        default=0,
        help="sweep this many MB between steps: the host caches as a forward on the same CPU "
        "leaves them (0: warm, as beside a GPU forward)",
    )
    p.add_argument(
        "--self-drafts",
        action="store_true",
        help="every request also has a self-draft of auto's length (trained heads: a draft step "
        "a tenth of a plain step, 80%% of tokens accepted), which the controller weighs against "
        "its lookup draft",
    )
    args = p.parse_args()
    rows = []
    lines = [
        "| batch | context | lookup µs | choice µs | bookkeeping µs | total µs | lookup µs of "
        "the step a new request joins | steps to index a prompt | request trees MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            r = run_cell(
                batch, context, args.steps, cold_mb=args.cold_mb, self_drafts=args.self_drafts
            )
            rows.append(r)
            s = r["steady_us"]
            lines.append(
                f"| {batch} | {context} | {s['lookup']} | {s['choice']} | {s['bookkeeping']} | "
                f"{s['total']} | {r['admission_step_lookup_us']} | "
                f"{r['steps_to_index_prompts']} | {r['request_index_mb']} |"
            )
            print(lines[-1], flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
        (out / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

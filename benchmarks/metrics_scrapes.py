"""Throughput of a served selfspec model with and without a flood of ``/metrics`` scrapes.

    python benchmarks/metrics_scrapes.py --config examples/selfspec-auto.json \\
        --concurrency 16 --scrapers 50 --phase 60 --pairs 2 --out OUT.json

One server, one load (``--concurrency`` streaming clients, greedy and sampled, some aborted, as
``benchmarks/load.py``), in alternating phases of ``--phase`` seconds: quiet, then with
``--scrapers`` more clients scraping ``/metrics`` back to back, ``--pairs`` times. Every scrape
of a selfspec server asks its workers for their stats (``metrics.py``); the collector coalesces
concurrent scrapes into one RPC and serves a snapshot of at most 2 s to the rest, so a flood
should cost a selfspec server what it costs vanilla vLLM (``--config none``), whose own metrics
every scrape renders too. Printed and written to ``--out``: tokens/s, the scrapes answered,
errors and greedy mismatches per phase, and the flooded/quiet ratio of each pair (phases
alternate so that drift on a shared machine falls on both alike).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from pathlib import Path

from vllm_selfspec.tools.loadtest import cli_args, engine_kw, greedy_references, run_load
from vllm_selfspec.tools.serving import Server


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        default=str(Path(__file__).parents[1] / "examples" / "selfspec-auto.json"),
        help="selfspec config file (JSON), or 'none' for vanilla vLLM (what a flood costs anyway)",
    )
    p.add_argument("--model", default=None, help="HF checkpoint (default: the embedded model)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--scrapers", type=int, default=50)
    p.add_argument("--phase", type=float, default=60, help="seconds per phase")
    p.add_argument("--pairs", type=int, default=2, help="(quiet, flooded) phase pairs")
    p.add_argument("--abort-prob", type=float, default=0.2)
    p.add_argument("--log", default="scrapes-server.log", help="server log file")
    p.add_argument("--out", default="scrapes-results.json")
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    args = p.parse_args()
    kw = engine_kw(args.eager)
    from vllm import LLM

    from vllm_selfspec.checkpoints import prepare_embedded_model

    model = args.model or str(prepare_embedded_model(progress=False))
    llm = LLM(model=model, **kw)
    refs = greedy_references(llm)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()

    server_args = [*cli_args(kw), "--served-model-name", "model"]
    config = None if args.config == "none" else str(Path(args.config).resolve())
    server_args += ["--speculative-config", config] if config else []
    phases = []
    with Server(model, server_args, log_path=Path(args.log).resolve()) as srv:
        print(f"server ready at {srv.url} (log: {args.log})")
        for n in range(2 * args.pairs):
            scrapers = args.scrapers if n % 2 else 0
            res = asyncio.run(
                run_load(
                    srv.url,
                    "model",
                    refs,
                    args.phase,
                    args.concurrency,
                    abort_prob=args.abort_prob,
                    seed=n,
                    scrapers=scrapers,
                )
            )
            row = {"phase": n, "scrapers": scrapers, **res.summary()}
            row["errors_sample"] = res.errors[:5]
            phases.append(row)
            print(
                f"phase {n}: {scrapers:3d} scrapers, {row['tokens_per_s']:.1f} tok/s, "
                f"{row['metrics_scrapes']} scrapes, {row['errors']} errors, "
                f"{row['greedy_mismatches']} greedy mismatches"
            )
            time.sleep(3)  # the in-flight requests of a phase end before the next starts
    ratios = [
        phases[i + 1]["tokens_per_s"] / phases[i]["tokens_per_s"]
        for i in range(0, len(phases), 2)
        if phases[i]["tokens_per_s"]
    ]
    out = {
        "config": json.loads(Path(config).read_text()) if config else None,
        "concurrency": args.concurrency,
        "scrapers": args.scrapers,
        "phase_s": args.phase,
        "eager": args.eager,
        "phases": phases,
        "flooded_over_quiet": [round(r, 3) for r in ratios],
        "flooded_over_quiet_median": round(statistics.median(ratios), 3) if ratios else None,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"flooded / quiet tokens/s per pair: {out['flooded_over_quiet']}; full results: {args.out}"
    )
    bad = sum(r["errors"] + r["greedy_mismatches"] for r in phases)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

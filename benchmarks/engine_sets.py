"""The same bench run several times, each with new engines, pooled: a method's speedup without
the luck of one engine process.

Two processes of one engine differ in forward speed by up to ~15% on a 2-core CPU
(docs/performance.md, "How a figure is made"), and a process keeps its offset for all of its
repeats: a bench run's median of 3 repeats carries its engines' draw (its A/A engine shows how
far). Each set here starts new engines; the per-repeat ratios of all sets are pooled.

    python benchmarks/engine_sets.py --sets 3 --out OUT -- --methods vanilla2,del,knapspec \
        --method-config '{"vanilla2":{"method":"vanilla"}}' --prompts chat --num-prompts 8 \
        --max-tokens 48 --batch-size 1 --repeats 2 --group-size 3

Set i is one ``vllm-selfspec bench`` run (the arguments after ``--``) in OUT/set<i>/, kept if
there (delete it to redo). Writes OUT/summary.md: per method, each set's speedup (the bench's
median over its repeats), the median of every set's per-repeat ratios with their range, the
same over full-batch decode, the lowest parity, and each set's target step in ms (selfspec
methods: ``verify`` seconds a step). With an A/A engine (a second vanilla, e.g. ``vanilla2``
above: a method with no config), also each method against every vanilla engine of its repeat
(the geometric mean of their tokens/s): the reference engine's own draw, which the A/A engine
shows, then weighs half as much (with one A/A engine): their median and range, and their
geometric mean with the standard error of its log (``log_standard_error``), so that two runs'
figures come with how far each can be trusted. ``--summary-only`` pools what OUT holds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path


def pool(results: list[dict]) -> dict[str, dict]:
    """Per method, its figures over the sets (``results``: each set's bench results.json). For
    example, a method at 0.98 / 0.99 in one set and 1.03 / 1.01 in another::

        >>> sets = [{"methods": {"m": {"speedup": 0.985, "speedup_runs": [0.98, 0.99],
        ...          "parity": 1.0}}},
        ...         {"methods": {"m": {"speedup": 1.02, "speedup_runs": [1.03, 1.01],
        ...          "parity": 1.0}}}]
        >>> p = pool(sets)["m"]
        >>> p["per_set"], p["speedup"], p["range"]
        ([0.985, 1.02], 1.0, (0.98, 1.03))
    """
    names = list(results[0]["methods"])
    for i, r in enumerate(results[1:], 2):
        if list(r["methods"]) != names:
            raise ValueError(f"set {i} ran {list(r['methods'])}, set 1 ran {names}")
    # the A/A engines: vanilla again, under another name (their config is none, as vanilla's)
    first = results[0]["methods"]
    twins = []
    if "vanilla" in names:
        twins = [n for n in names if n != "vanilla" and first[n].get("config", {}) is None]
    # per set and repeat, every vanilla engine's tokens/s over the reference's, multiplied:
    # their geometric mean is a baseline that carries less of one engine's draw
    base = [
        [
            math.prod(r["methods"][t]["speedup_runs"][j] for t in twins) ** (1 / (len(twins) + 1))
            for j in range(len(r["methods"]["vanilla"]["speedup_runs"]))
        ]
        for r in results
        if twins
    ]
    pooled = {}
    for name in names:
        ms = [r["methods"][name] for r in results]
        runs = [x for m in ms for x in m["speedup_runs"]]
        vs_all = [x / b for m, bs in zip(ms, base) for x, b in zip(m["speedup_runs"], bs)]
        full = [x for m in ms for x in m.get("full_batch_speedup_runs") or []]
        steps = []
        for m in ms:
            st = m.get("selfspec_stats")
            if st and st.get("steps"):
                steps.append(1000 * st["time_s"]["verify"] / st["steps"])
        pooled[name] = {
            "per_set": [m["speedup"] for m in ms],
            "speedup": statistics.median(runs),
            "range": (min(runs), max(runs)),
            "full_batch_speedup": statistics.median(full) if full else None,
            # over the geometric mean of every vanilla engine in the same repeat (None without
            # an A/A engine)
            "vs_vanillas": statistics.median(vs_all) if twins else None,
            "vs_vanillas_range": (min(vs_all), max(vs_all)) if twins else None,
            # the same as a geometric mean with the standard error of its log (None without
            # an A/A engine; the error None for one repeat): how far the pooled figure can be
            # trusted, repeats taken as independent draws
            "vs_vanillas_mean": statistics.geometric_mean(vs_all) if twins else None,
            "vs_vanillas_error": log_standard_error(vs_all) if twins else None,
            "parity": min(m["parity"] for m in ms),
            "step_ms": steps,
        }
    return pooled


def log_standard_error(xs: list[float]) -> float | None:
    """The standard error of the mean of ``log(xs)``: a geometric mean ``g`` of ratios is
    ``g`` times/divided by ``exp`` of it (about ``g`` +- that share). None for one value.

    >>> round(log_standard_error([0.9, 1.0, 1.1, 1.0]), 4)
    0.041
    """
    if len(xs) < 2:
        return None
    return statistics.stdev(math.log(x) for x in xs) / math.sqrt(len(xs))


def markdown(pooled: dict[str, dict], commands: list[str]) -> str:
    twins = any(p["vs_vanillas"] is not None for p in pooled.values())
    lines = [
        "| method | speedup per set | all sets' repeats: median [range] | "
        + (
            "against every vanilla engine: median [range]; geometric mean +- standard error | "
            if twins
            else ""
        )
        + "full-batch decode | parity | target step per set (ms) |",
        "|---|---|---|" + ("---|" if twins else "") + "---|---|---|",
    ]
    for name, p in pooled.items():
        lo, hi = p["range"]
        full = p["full_batch_speedup"]
        vs = ""
        if twins:
            vlo, vhi = p["vs_vanillas_range"]
            err = p["vs_vanillas_error"]
            vs = (
                f"{p['vs_vanillas']:.3f}x [{vlo:.3f}, {vhi:.3f}]; {p['vs_vanillas_mean']:.3f}x"
                + (f" +- {err:.3f}" if err is not None else "")
                + " | "
            )
        lines.append(
            f"| {name} | "
            + " / ".join(f"{x:.3f}" for x in p["per_set"])
            + f" | {p['speedup']:.3f}x [{lo:.3f}, {hi:.3f}] | "
            + vs
            + (f"{full:.3f}x" if full is not None else "–")
            + f" | {p['parity']:.2f} | "
            + (" / ".join(f"{x:.1f}" for x in p["step_ms"]) or "–")
            + " |"
        )
    lines += ["", "Each set's command:", ""] + [
        f"- set {i}: `{c}`" for i, c in enumerate(commands, 1)
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True)
    p.add_argument("--sets", type=int, default=3)
    p.add_argument("--summary-only", action="store_true")
    args = p.parse_args(own)
    out = Path(args.out)
    if not args.summary_only:
        if "--out" in bench_args:
            p.error("the sets' --out is OUT/set<i>: give the bench no --out")
        for i in range(1, args.sets + 1):
            target = out / f"set{i}"
            if (target / "results.json").is_file():
                continue
            cmd = [
                sys.executable,
                "-m",
                "vllm_selfspec.tools.bench",
                *bench_args,
                "--out",
                str(target),
            ]
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
    paths = sorted(out.glob("set*/results.json"), key=lambda q: int(q.parent.name[3:]))
    results = [json.loads(q.read_text(encoding="utf-8")) for q in paths]
    if not results:
        p.error(f"no set*/results.json under {out}")
    text = markdown(pool(results), [r["settings"]["command_line"] for r in results])
    (out / "summary.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

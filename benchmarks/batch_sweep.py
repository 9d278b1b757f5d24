"""Speedup against batch size: ``vllm-selfspec bench`` per prompt set and batch size, then one
table and one plot per prompt set (speedup over vanilla of the same run, per method).

    python benchmarks/batch_sweep.py --out OUT --prompts humaneval,chat,passages \
        --batch-sizes 1,8 --methods ngram,auto,layerskip --num-prompts 16 --max-tokens 64 \
        --repeats 3 [--method-config '{...}']

Each (prompt set, batch size) is one bench run in OUT/<prompts>-bs<B>/ (every method in its own
process, in groups of --group-size beside a vanilla engine with their repeats interleaved; the
speedup is the median of the per-round ratios); runs already there are kept (delete a directory
to redo it). Writes OUT/summary.md and OUT/<prompts>.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def run(args) -> None:
    out = Path(args.out)
    for prompts in args.prompts.split(","):
        for bs in args.batch_sizes.split(","):
            target = out / f"{prompts}-bs{bs}"
            if (target / "results.json").is_file():
                continue
            cmd = [
                sys.executable,
                "-m",
                "vllm_selfspec.tools.bench",
                "--methods",
                args.methods,
                "--prompts",
                prompts,
                "--num-prompts",
                str(args.num_prompts),
                "--max-tokens",
                str(args.max_tokens),
                "--batch-size",
                bs,
                "--repeats",
                str(args.repeats),
                "--group-size",
                str(args.group_size),
                "--out",
                str(target),
            ]
            if args.method_config:
                cmd += ["--method-config", args.method_config]
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)


def _table_head(caption: str, sizes: list[int]) -> list[str]:
    """A caption, then a table's header with one column per batch size."""
    return [
        caption,
        "",
        "| method | " + " | ".join(f"bs {b}" for b in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]


def summarize(out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(out.glob("*-bs*/results.json")):
        prompts, bs = path.parent.name.rsplit("-bs", 1)
        runs.setdefault(prompts, {})[int(bs)] = json.loads(path.read_text())
    lines = []
    for prompts, by_bs in runs.items():
        sizes = sorted(by_bs)
        methods = list(next(iter(by_bs.values()))["methods"])
        lines += [f"### {prompts}", ""] + _table_head(
            "speedup over vanilla of the same run (tokens/s, median of the per-round ratios), "
            "at batch > 1 also over decode steps at a full batch (`full_batch_speedup`: no "
            "closed batch's tail, no prefills); acceptance; parity with vanilla",
            sizes,
        )
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in methods:
            cells, xs, ys = [], [], []
            for b in sizes:
                m = by_bs[b]["methods"].get(name)
                if m is None:
                    cells.append("–")
                    continue
                acc, full = m["acceptance_rate"], m.get("full_batch_speedup")
                cells.append(
                    f"{m['speedup']:.2f}x"
                    + (f" / {full:.2f}x" if full is not None and b > 1 else "")
                    + f" ({m['tokens_per_s']:.0f} tok/s"
                    + (f", {100 * acc:.0f}%" if acc is not None else "")
                    + f", parity {m['parity']:.2f})"
                )
                xs.append(b)
                ys.append(m["speedup"])
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
            ax.plot(xs, ys, marker="o", label=name)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size (max_num_seqs)")
        ax.set_ylabel("speedup over vanilla")
        ax.set_title(f"{prompts}: speedup against batch size")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{prompts}.png", dpi=110)
        plt.close(fig)
        lines += [""] + _table_head(
            "Each timed slice's paired ratio (the same prompts by the method and by vanilla "
            "seconds apart): their median and its 90% bootstrap interval, the run's own noise "
            "band (the A/A engine `vanilla2` shows it for a method that changes nothing):",
            sizes,
        )
        for name in methods:
            cells = []
            for b in sizes:
                m = by_bs[b]["methods"].get(name) or {}
                if m.get("slice_speedup_interval") is None:
                    cells.append("–")
                    continue
                lo, hi = m["slice_speedup_interval"]
                cells.append(f"{m['slice_speedup']:.2f}x [{lo:.2f}, {hi:.2f}]")
            if any(c != "–" for c in cells):
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "Where the emitted tokens came from (lookup drafts / self-drafts / the target's "
            "own token each step), selfspec's time (draft / verify = target forward / "
            "policy / shadow / optimise / controller) and draft forwards per engine step:",
            "",
            "| method | batch | lookup / self-draft / target | time shares | "
            "draft forwards / step |",
            "|---|---|---|---|---|",
        ]
        for name in methods:
            for b in sizes:
                m = by_bs[b]["methods"].get(name) or {}
                st = m.get("selfspec_stats")
                if not st:
                    continue
                src = st["token_sources"]
                total = max(sum(src.values()), 1)
                share = m["time_breakdown"]["share"]
                lines.append(
                    f"| {name} | {b} | "
                    + " / ".join(
                        f"{100 * src[k] / total:.0f}%" for k in ("lookup", "self_draft", "target")
                    )
                    + " | "
                    + " / ".join(
                        f"{100 * share.get(k, 0):.0f}%"
                        for k in ("draft", "verify", "policy", "shadow", "optimise", "controller")
                    )
                    + f" | {st['draft_forwards'] / max(st['steps'], 1):.2f} |"
                )
        lines += ["", "Each run's command:", ""]
        lines += [f"- bs {b}: `{by_bs[b]['settings']['command_line']}`" for b in sizes]
        lines.append("")
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n", encoding="utf-8")
    return text


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", default="humaneval,chat,passages")
    p.add_argument("--batch-sizes", default="1,4,8,16")
    p.add_argument("--methods", default="ngram,auto")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--group-size", type=int, default=3)
    p.add_argument("--method-config", default=None)
    p.add_argument("--summary-only", action="store_true")
    args = p.parse_args()
    if not args.summary_only:
        run(args)
    print(summarize(Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

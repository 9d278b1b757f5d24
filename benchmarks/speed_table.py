"""One markdown table from several bench runs (``vllm-selfspec bench --out DIR``): a row per run
(its prompt set and batch size), a column per method with its speedup over vanilla in the same
run (median of the repeats' paired ratios) and acceptance, vanilla's tokens/s, the engines' mode,
and parity over every method.

    python benchmarks/speed_table.py docs/results/compiled/*/results.json

The README's and docs/performance tables come from this script, not from hand copies.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(paths: list[str]) -> list[dict]:
    runs = []
    for p in paths:
        path = Path(p)
        res = json.loads((path / "results.json" if path.is_dir() else path).read_text())
        runs.append(res)
    return runs


def _cell(m: dict) -> str:
    acc = m.get("acceptance_rate")
    return f"{m['speedup']:.2f}x" + (f" ({acc:.0%})" if acc is not None else "")


def table(runs: list[dict]) -> str:
    methods: list[str] = []
    for r in runs:
        methods += [n for n in r["methods"] if n != "vanilla" and n not in methods]
    lines = [
        "| prompts | batch | mode | vanilla tok/s | "
        + " | ".join(f"{m} (acceptance)" for m in methods)
        + " | parity |",
        "|" + "---|" * (5 + len(methods)),
    ]
    for r in runs:
        s, ms = r["settings"], r["methods"]
        parity = min(m["parity"] for m in ms.values() if m.get("parity") is not None)
        cells = [_cell(ms[m]) if m in ms else "–" for m in methods]
        mode = "eager" if s.get("engine_args", {}).get("enforce_eager") else "compiled"
        lines.append(
            f"| {s['prompts']} | {s['batch_size']} | {mode} | "
            f"{ms['vanilla']['tokens_per_s']:.1f} | " + " | ".join(cells) + f" | {parity:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="results.json files or bench --out directories")
    print(table(load(p.parse_args().results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Markdown tables from bench runs (``vllm-selfspec bench --out DIR``): a row per run (its prompt
set and batch size), a column per method with its speedup over vanilla in the same run (median of
the repeats' paired ratios) and acceptance, vanilla's tokens/s, the engines' mode, parity over
every method, whether the engines ran under the frame-stack chunk cache (docs/performance.md, "A
method that drafts nothing"), and the commit of the code that ran (``bench`` records it; "–":
not recorded).

Print one table::

    python benchmarks/speed_table.py docs/results/compiled/*-bs1/results.json

Rewrite the tables in the docs, between their markers, from the results they name::

    python benchmarks/speed_table.py --update README.md docs/performance.md
    python benchmarks/speed_table.py --check README.md docs/performance.md   # exit 1 if stale

A block is ``<!-- speed-table:begin [RUN ...] -->`` ... ``<!-- speed-table:end -->``. RUN is a bench
``--out`` directory (or its results.json), relative to the repository root; without one the block
is the speed table of ``SPEED_RUNS``. ``<!-- include:begin FILE -->`` ... ``<!-- include:end -->``
holds FILE's text as it is (a table another script wrote, such as ``benchmarks/step_costs.py``'s).
The README's and docs/performance.md's tables come from this script, not from hand copies.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: the speed table: vanilla, ngram, suffix and auto in vLLM's default mode, three prompt sets at
#: batch 1 and 8 (docs/performance.md, "Reproduce", has the commands)
SPEED_RUNS = [
    f"docs/results/compiled/{prompts}-bs{batch}"
    for batch in (1, 8)
    for prompts in ("humaneval", "chat", "passages", "edits")
]

BLOCK = re.compile(
    r"(<!-- (speed-table|include):begin(?P<args>[^>]*?)-->\n)(?P<body>.*?)(<!-- \2:end -->)", re.S
)


def load(paths: list[str], root: Path = ROOT) -> list[dict]:
    runs = []
    for p in paths:
        path = Path(p)
        if not path.is_absolute() and not path.exists():
            path = root / path
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
        "| prompts | batch | new tokens | mode | vanilla tok/s | "
        + " | ".join(f"{m} (acceptance)" for m in methods)
        + " | parity | frame-stack cache | code |",
        "|" + "---|" * (8 + len(methods)),
    ]
    for r in runs:
        s, ms = r["settings"], r["methods"]
        parity = min(m["parity"] for m in ms.values() if m.get("parity") is not None)
        cells = [_cell(ms[m]) if m in ms else "–" for m in methods]
        mode = "eager" if s.get("engine_args", {}).get("enforce_eager") else "compiled"
        lines.append(
            f"| {s['prompts']} | {s['batch_size']} | {s['max_tokens']} | {mode} | "
            f"{ms['vanilla']['tokens_per_s']:.1f} | "
            + " | ".join(cells)
            + f" | {parity:.2f} | {_stack_cache(s)} | {s.get('code') or '–'} |"
        )
    return "\n".join(lines)


def _stack_cache(settings: dict) -> str:
    """Whether the run's engines ran under the frame-stack chunk cache (vllm_selfspec/
    frame_stack.py): "on", else "off" (a run from before the bench had it records nothing)."""
    return "on" if settings.get("frame_stack_cache") == "on" else "off"


def _block(kind: str, args: list[str], root: Path) -> str:
    if kind == "include":
        if len(args) != 1:
            raise SystemExit(f"<!-- include:begin FILE --> names one file, got {args}")
        return (root / args[0]).read_text().rstrip("\n")
    return table(load(args or SPEED_RUNS, root))


def update(text: str, root: Path = ROOT) -> str:
    """``text`` with every block's body regenerated."""

    def repl(m: re.Match) -> str:
        body = _block(m.group(2), m.group("args").split(), root)
        return f"{m.group(1)}{body}\n{m.group(5)}"

    return BLOCK.sub(repl, text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="*", help="results.json files or bench --out directories")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--update", action="store_true", help="rewrite the blocks of the markdown files named"
    )
    mode.add_argument(
        "--check", action="store_true", help="exit 1 if a named file's blocks are out of date"
    )
    args = p.parse_args()
    if not (args.update or args.check):
        print(table(load(args.paths or SPEED_RUNS)))
        return 0
    stale = []
    for name in args.paths:
        path = Path(name)
        text = path.read_text()
        if not BLOCK.search(text):
            raise SystemExit(
                f"{name}: no <!-- speed-table:begin --> or <!-- include:begin --> block"
            )
        new = update(text)
        if new != text:
            stale.append(name)
            if args.update:
                path.write_text(new)
    if args.check and stale:
        print("out of date (run with --update): " + ", ".join(stale), file=sys.stderr)
        return 1
    for name in stale:
        print(f"updated {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

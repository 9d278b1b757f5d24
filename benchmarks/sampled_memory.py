"""Resident memory of a full batch of sampled requests: vanilla vLLM against self-drafting methods.

    python benchmarks/sampled_memory.py [--requests 64] [--max-tokens 8] [--out DIR]

The drafter's own memory in a step grows with the batch: a sampled batch keeps float32
draft distributions ``[requests, k, V]``, shadow projections ``[rows, V]`` run in chunks
(``engine/drafting.py::peak_shapes`` has the shapes). On a GPU vLLM's start-up profile
allocates that peak (``tests/unit/test_drafting.py``); on the CPU there is no profile to check
against, so this shows what the peak costs in resident memory: each engine starts in a process
of its own with ``max_num_seqs`` = ``--requests`` (the embedded model, vLLM's default compiled
mode, engine and worker in that one process), its resident set is read once it has started,
its high-water mark is reset (``/proc/self/clear_refs``), it serves ``--requests`` sampled
requests at once (temperature 1, the chat set's prompts), and the high-water mark is read
again. The increase is what serving the batch added: the KV cache is allocated at start-up, so
what grows is activations, sampling, and for a drafter its draft steps and distributions.

Engines: vanilla; ``layerskip`` at exit 8 with 4 tokens and the controller off (it drafts every
step, the most a drafter's distributions take); ``auto``. Writes DIR/results.json and
DIR/table.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ENGINES = {
    "vanilla": None,
    "layerskip": {
        "method": "layerskip",
        "exit_layer": 8,
        "num_speculative_tokens": 4,
        "goodput": False,
    },
    "auto": {"method": "auto"},
}


def status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def run_engine(name: str, requests: int, max_tokens: int) -> dict:
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process
    from vllm import LLM, SamplingParams

    import vllm_selfspec
    from vllm_selfspec.checkpoints import embedded_model_dir
    from vllm_selfspec.tools.bench import engine_args
    from vllm_selfspec.tools.prompts import load_prompts

    spec = ENGINES[name]
    llm = LLM(
        model=str(embedded_model_dir()),
        **{**engine_args(), "max_num_seqs": requests},
        speculative_config=spec,
    )
    chat = load_prompts("chat", None, str(embedded_model_dir()))
    prompts = [chat[i % len(chat)] for i in range(requests)]  # each sampled with its own draw
    sampled = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    llm.generate(prompts[:2], sampled)  # warm: first steps of each shape
    started = status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here on
    outs = llm.generate(prompts, sampled)
    peak = status_mib("VmHWM")
    stats = vllm_selfspec.get_stats(llm) if spec else {}
    return {
        "rss_started_mib": round(started),
        "peak_mib": round(peak),
        "added_mib": round(peak - started),
        "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "drafted_tokens": stats.get("drafted_tokens"),
        "accepted_tokens": stats.get("accepted_tokens"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64, help="max_num_seqs and requests at once")
    p.add_argument("--max-tokens", type=int, default=8, help="per request (memory, not speed)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"among {', '.join(ENGINES)}")
    p.add_argument("--out", default="sampled-memory")
    p.add_argument("--one", nargs=2, metavar=("ENGINE", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        engine, result = args.one
        Path(result).write_text(json.dumps(run_engine(engine, args.requests, args.max_tokens)))
        return
    engines = args.engines.split(",")
    if unknown := set(engines) - set(ENGINES):
        p.error(f"unknown engines {sorted(unknown)}; choose among {', '.join(ENGINES)}")
    results = {"settings": {k: v for k, v in vars(args).items() if k != "one"}}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in engines:  # each in a fresh process
            result = Path(tmp) / f"{engine}.json"
            subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--one", engine, str(result)], check=True
            )
            results[engine] = {"config": ENGINES[engine], **json.loads(result.read_text())}
    rows = [
        "| engine | RSS once started, MiB | peak serving the batch, MiB | added, MiB | tokens "
        "| drafted / accepted |",
        "|---|---|---|---|---|---|",
    ]
    for engine in engines:
        r = results[engine]
        drafts = (
            "–"
            if r["drafted_tokens"] is None
            else f"{r['drafted_tokens']} / {r['accepted_tokens']}"
        )
        rows.append(
            f"| {engine} | {r['rss_started_mib']} | {r['peak_mib']} | {r['added_mib']} "
            f"| {r['tokens']} | {drafts} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "table.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

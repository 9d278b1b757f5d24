"""What one engine step costs, eager against compiled (vLLM's default mode), at batch 1 and 8: a
plain step, a verify step with k = 1, 3 and 6 drafts per request, and a draft step per exit depth
(8, 16, 24 layers of the model's L) and per drafter kind (a layer plan, a sub-layer skip set,
feature heads).

    python benchmarks/step_costs.py --out docs/results/compiled/step-costs

Each engine (one per config and mode, in this process, one after the other) decodes the same
prompts one at a time (batch 1) and then all together (batch 8), greedy, after a warm-up. The
configs draft a fixed k every step (``"goodput": false``): LayerSkip at exit 8 with k = 1, at 16
with k = 3 and at 24 with k = 6, so each gives the verify step of its k (the target forward over
1 + k tokens per request, whatever drafted them) and the draft step of its depth. Timed: the
target forward (the runner's ``_model_forward``), keyed by its token count, and each draft step
as the drafter reports it to the cost model (``StepCostModel.add_draft``: the metadata, the
layers and the head), keyed by its rows; medians in ms. Also each engine's start-up (``LLM(...)``,
compilation or its cache included). Writes ``OUT/step_costs.json`` and ``OUT/step_costs.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # hooks reach the runner directly

#: config name -> (speculative config, k); "{heads}": feature heads built at their
#: initialisation (a draft step's cost does not depend on what the head learnt)
CONFIGS = {
    "vanilla": (None, 0),
    "plan E8": (
        {"method": "layerskip", "exit_layer": 8, "num_speculative_tokens": 1, "goodput": False},
        1,
    ),
    "plan E16": (
        {"method": "layerskip", "exit_layer": 16, "num_speculative_tokens": 3, "goodput": False},
        3,
    ),
    "plan E24": (
        {"method": "layerskip", "exit_layer": 24, "num_speculative_tokens": 6, "goodput": False},
        6,
    ),
    "skip set": (
        {
            "method": "layerskip",
            "skip_attn": list(range(1, 24, 3)),
            "skip_mlp": list(range(2, 24, 3)),
            "exit_layer": 24,
            "num_speculative_tokens": 3,
            "goodput": False,
        },
        3,
    ),
    "feature": (
        {"method": "feature", "heads": "{heads}", "num_speculative_tokens": 3, "goodput": False},
        3,
    ),
}
BATCHES = (1, 8)


def built_feature_heads(model: str, out: Path) -> str:
    """Feature heads of ``model`` at their initialisation, saved at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_selfspec.heads import HeadSet, identity_from_hf, make_head, save_heads

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    identity = identity_from_hf(hf)
    torch.manual_seed(0)
    heads = {0: make_head("feature", identity.hidden_size)}
    return str(save_heads(out, HeadSet("feature", heads, identity), training={"built": "bench"}))


def _hook(worker) -> None:
    """Times the target forward by token count, and draft steps by (depth, rows)."""
    runner = worker.model_runner
    runner._cost_log = {"forward": [], "draft": []}
    forward = runner._model_forward

    def model_forward(*a, **k):
        t = time.perf_counter()
        out = forward(*a, **k)
        ids = k.get("input_ids", a[0] if a else None)
        runner._cost_log["forward"].append((int(ids.shape[0]), time.perf_counter() - t))
        return out

    runner._model_forward = model_forward
    drafter = getattr(runner, "drafter", None)
    costs = getattr(drafter, "costs", None)
    if costs is not None:
        add = costs.add_draft

        def add_draft(layers, rows, seconds):
            runner._cost_log["draft"].append((float(layers), int(rows), seconds))
            return add(layers, rows, seconds)

        costs.add_draft = add_draft


def _take(worker) -> dict:
    log = worker.model_runner._cost_log
    worker.model_runner._cost_log = {"forward": [], "draft": []}
    return log


def _median_ms(xs: list[float]) -> float | None:
    return round(1e3 * statistics.median(xs), 2) if xs else None


def measure(model: str, name: str, spec, k: int, eager: bool, prompts, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_selfspec.tools.bench import engine_args

    t0 = time.perf_counter()
    llm = LLM(model=model, max_num_seqs=8, speculative_config=spec, **engine_args(eager))
    startup = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    llm.collective_rpc(_hook)
    out: dict = {"startup_s": round(startup, 1)}
    for bs in BATCHES:
        batch = prompts[:bs]
        llm.reset_prefix_cache()
        if bs == 1:
            for p in prompts[:4]:
                llm.generate([p], sp, use_tqdm=False)
        else:
            llm.generate(batch, sp, use_tqdm=False)
        log = llm.collective_rpc(_take)[0]
        # the decode steps: every request verifies its k drafts (or none, plainly)
        tokens = bs * (1 + k)
        out[f"forward_bs{bs}"] = _median_ms([s for n, s in log["forward"] if n == tokens])
        out[f"draft_bs{bs}"] = _median_ms([s for _, rows, s in log["draft"] if rows == bs])
        out[f"draft_layers_bs{bs}"] = sorted({d for d, rows, _ in log["draft"] if rows == bs})
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return out


def table(results: dict) -> str:
    """Markdown: each cost eager | compiled | their ratio, per batch size (configs measured)."""
    modes = ("eager", "compiled")
    names = [n for n in CONFIGS if all(n in results[m] for m in modes)]
    rows = []

    def row(label, name, key):
        cells = []
        for bs in BATCHES:
            e, c = (results[m][name][f"{key}_bs{bs}"] for m in modes)
            ratio = f"{e / c:.2f}x" if e and c else "–"
            cells += [f"{e:.1f}" if e else "–", f"{c:.1f}" if c else "–", ratio]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")

    for name in names:
        k = CONFIGS[name][1]
        row("plain step" if k == 0 else f"verify step, k = {k} ({name})", name, "forward")
    for name in names:
        if CONFIGS[name][0] is not None:
            row(f"draft step, {name}", name, "draft")
    head = "| step, ms (median) | " + " | ".join(
        f"bs {bs} eager | bs {bs} compiled | bs {bs} speedup" for bs in BATCHES
    )
    starts = ", ".join(
        f"{n} {results['eager'][n]['startup_s']:.0f} / {results['compiled'][n]['startup_s']:.0f}"
        for n in names
    )
    return "\n".join(
        [
            head + " |",
            "|" + "---|" * (1 + 3 * len(BATCHES)),
            *rows,
            "",
            f"start-up s (eager / compiled): {starts}",
        ]
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF checkpoint (default: the embedded model)")
    p.add_argument("--prompts", default="passages")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default="step-costs")
    p.add_argument("--table", default=None, help="only print the table of a step_costs.json")
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"which of {', '.join(CONFIGS)} (vanilla and the three plans make the table's rows)",
    )
    args = p.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0

    from vllm_selfspec.checkpoints import resolve_model
    from vllm_selfspec.tools.bench import frame_stack_cache
    from vllm_selfspec.tools.prompts import load_prompts

    model = resolve_model(args.model)
    prompts = load_prompts(args.prompts, 8, model)
    results: dict = {"eager": {}, "compiled": {}}
    # every engine under the frame-stack chunk cache, as in the bench (vllm_selfspec/frame_stack.py)
    with tempfile.TemporaryDirectory() as tmp, frame_stack_cache(True) as state:
        print(f"frame-stack chunk cache {state}", flush=True)
        heads = built_feature_heads(model, Path(tmp) / "heads")
        for mode in results:
            for name in args.configs.split(","):
                spec, k = CONFIGS[name]
                if spec is not None and spec.get("heads") == "{heads}":
                    spec = {**spec, "heads": heads}
                r = measure(model, name, spec, k, mode == "eager", prompts, args.max_tokens)
                results[mode][name] = r
                print(f"{mode} {name}: {r}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = table(results)
    (out / "step_costs.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "step_costs.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

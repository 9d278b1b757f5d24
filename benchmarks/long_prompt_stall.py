"""The step times of a running batch when a 64k-token prompt joins it: vanilla vLLM, vLLM's
`suffix` method (the draft-free peer) and `auto`.

    python benchmarks/long_prompt_stall.py [--prompt-tokens 65536] [--engines vanilla,suffix,auto] [--out DIR]

Context lookup indexes a request's prompt in its own suffix tree (``lookup.py``): the last 2,048
tokens on its first decode step, 2,048 more each step after, back to 16,384. The work is bounded
per step so that a long prompt does not stall the requests decoding beside it. This measures
that in an engine: 7 requests decode, then one with a ``--prompt-tokens`` prompt joins; every
engine step is timed, each engine alone, in vLLM's default compiled mode. The model is a tiny
random-weight Llama (4 layers, hidden 128, vocabulary 512, positions to 70k, written to a
temporary directory): the stall in question is the host's indexing, which does not depend on
the model, while the embedded model's 8k positions and one-core prefill would not fit a 64k
prompt. Prompts are random tokens with recurring stretches, so lookups draft.

Per engine and phase: steps, tokens emitted, median and max step milliseconds, over the steps
before the long request joins (``before``), while its prompt is prefilled in chunks
(``prefill``), its first 10 decode steps (``indexing``: where `auto` indexes the prompt) and the
rest (``after``). A speculative step emits several tokens per request, so compare tokens per
second, not step times. For `auto`, the most milliseconds context lookup took in one step of the
phase, and where the phase's slowest step spent its time (the engine's ``get_stats`` timers:
draft, verify, lookup, controller...). Written to DIR/results.json and DIR/table.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lookup_host import text_with_repeats  # benchmarks/, this script's folder

BATCH_MATES = 7
INDEXING_STEPS = 10
ENGINES = {"vanilla": None, "suffix": {"method": "suffix"}, "auto": {"method": "auto"}}
PHASES = ("before", "prefill", "indexing", "after")


def tokens_with_repeats(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Prompt tokens with recurring stretches, none of them BOS or EOS (ids 0 and 1)."""
    return text_with_repeats(rng, n, vocab, first=2)


def tiny_model(path: Path, vocab: int, max_positions: int) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=0,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def run_engine(model: str, spec: dict | None, args) -> dict:
    import os

    from vllm import LLM, SamplingParams

    import vllm_selfspec
    from vllm_selfspec import compat

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # step the engine core in this process
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        max_model_len=args.prompt_tokens + 1024,
        max_num_seqs=BATCH_MATES + 1,
        max_num_batched_tokens=args.chunk,
        kv_cache_memory_bytes=1 << 28,
        speculative_config=spec,
        seed=0,
    )
    eng = llm.llm_engine
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for i in range(BATCH_MATES):
        prompt = tokens_with_repeats(rng, 256, args.vocab)
        eng.add_request(f"mate{i}", {"prompt_token_ids": prompt}, greedy)
    selfspec = spec is not None and spec["method"] not in compat.vllm_spec_methods()
    steps: dict[str, list[dict]] = {k: [] for k in PHASES}
    seen: dict[str, float] = {}  # selfspec: the runner's timers so far
    emitted: dict[str, int] = {}  # tokens each request has emitted so far

    def step() -> dict:
        t0 = time.perf_counter()
        outs = eng.step()
        ms = 1000 * (time.perf_counter() - t0)
        tokens = 0
        for o in outs:
            n = len(o.outputs[0].token_ids)
            tokens += n - emitted.get(o.request_id, 0)
            emitted[o.request_id] = n
        split = None
        if selfspec:  # the runner's timers of this step, ms (read outside the timed step)
            now = vllm_selfspec.get_stats(llm)["time_s"]
            split = {k: round(1000 * (v - seen.get(k, 0.0)), 3) for k, v in now.items()}
            seen.update(now)
        return {"ms": ms, "outs": outs, "tokens": tokens, "split": split}

    for _ in range(args.warm_steps):
        step()

    def record(phase: str, s: dict) -> None:
        steps[phase].append({"ms": s["ms"], "tokens": s["tokens"], "split": s["split"]})

    for _ in range(args.steps_before):
        record("before", step())
    long_prompt = tokens_with_repeats(rng, args.prompt_tokens, args.vocab)
    eng.add_request("long", {"prompt_token_ids": long_prompt}, SamplingParams(
        temperature=0, max_tokens=args.long_tokens, ignore_eos=True
    ))  # fmt: skip
    produced = 0
    while produced < args.long_tokens:
        s = step()
        n = sum(len(o.outputs[0].token_ids) for o in s["outs"] if o.request_id == "long")
        phase = "prefill" if produced == 0 and n == 0 else None
        produced = max(produced, n)
        if phase is None:
            decode_steps = len(steps["indexing"]) + len(steps["after"])
            phase = "indexing" if decode_steps < INDEXING_STEPS else "after"
        record(phase, s)
    stats = vllm_selfspec.get_stats(llm) if selfspec else {}
    eng.engine_core.shutdown()
    return {
        "phases": {k: summarise(v) for k, v in steps.items()},
        "host_us_per_step": stats.get("host_us_per_step"),
        "lookup_index": stats.get("lookup_index"),
        "drafted_tokens": stats.get("drafted_tokens"),
        "accepted_tokens": stats.get("accepted_tokens"),
    }


def summarise(steps: list[dict]) -> dict:
    """One phase: its steps, tokens, tokens/s, median and max step ms; for a selfspec engine,
    the most ms lookup took in a step and the split of the slowest step."""
    if not steps:
        return {"steps": 0}
    ms = [s["ms"] for s in steps]
    slowest = max(steps, key=lambda s: s["ms"])
    tokens = sum(s["tokens"] for s in steps)
    r = {
        "steps": len(steps),
        "tokens": tokens,
        "tokens_per_s": round(1000 * tokens / sum(ms), 1),
        "median_ms": round(statistics.median(ms), 2),
        "max_ms": round(max(ms), 2),
    }
    if slowest["split"] is not None:
        r["lookup_max_ms"] = max(s["split"]["lookup"] for s in steps)
        r["slowest_step_split_ms"] = slowest["split"]
    return r


def split_text(split: dict | None) -> str:
    """The slowest step's largest parts, e.g. ``verify 1402, lookup 12.6``."""
    if not split:
        return "–"
    parts = sorted(((v, k) for k, v in split.items() if k != "total" and v >= 0.5), reverse=True)
    return ", ".join(f"{k} {v:.1f}" for v, k in parts[:3]) or "–"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=65536)
    p.add_argument("--chunk", type=int, default=4096, help="max_num_batched_tokens")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--warm-steps", type=int, default=20)
    p.add_argument("--steps-before", type=int, default=30)
    p.add_argument("--long-tokens", type=int, default=200, help="tokens the long request decodes")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"among {', '.join(ENGINES)}")
    p.add_argument("--out", default="long-prompt-stall")
    # internal: run one engine in this process and write its results to a file
    p.add_argument("--one", nargs=3, metavar=("ENGINE", "MODEL", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        engine, model, result = args.one
        Path(result).write_text(json.dumps(run_engine(model, ENGINES[engine], args)))
        return
    engines = args.engines.split(",")
    if unknown := set(engines) - set(ENGINES):
        p.error(f"unknown engines {sorted(unknown)}; choose among {', '.join(ENGINES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "tiny", args.vocab, args.prompt_tokens + 4096)
        results = {"settings": {k: v for k, v in vars(args).items() if k != "one"}}
        for engine in engines:  # each in a fresh process, as each engine would be served
            result = Path(tmp) / f"{engine}.json"
            subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--one", engine, model, str(result)],
                check=True,
            )
            results[engine] = json.loads(result.read_text())
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    rows = [
        "| engine | phase | steps | tokens | tokens/s | median step ms | max step ms "
        "| max lookup ms of a step | slowest step's largest parts, ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for engine in engines:
        for phase, r in results[engine]["phases"].items():
            if not r["steps"]:
                continue
            look = r.get("lookup_max_ms", "–")
            split = split_text(r.get("slowest_step_split_ms"))
            rows.append(
                f"| {engine} | {phase} | {r['steps']} | {r['tokens']} | {r['tokens_per_s']} "
                f"| {r['median_ms']} | {r['max_ms']} | {look} | {split} |"
            )
    (out / "table.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    for engine in engines:
        if results[engine].get("host_us_per_step"):
            print(f"{engine} host µs per step: {results[engine]['host_us_per_step']}")


if __name__ == "__main__":
    main()

"""The step times of a running batch when a 64k-token prompt joins it, vanilla vLLM against `auto`.

    python benchmarks/long_prompt_stall.py [--prompt-tokens 65536] [--out DIR]

Context lookup indexes a request's prompt in its own suffix tree (``lookup.py``): the last 2,048
tokens on its first decode step, 2,048 more each step after, back to 16,384. The work is bounded
per step so that a long prompt does not stall the requests decoding beside it. This measures
that in an engine: 7 requests decode, then one with a ``--prompt-tokens`` prompt joins; every
engine step is timed, vanilla and `auto` (each engine alone, vLLM's default compiled mode). The
model is a tiny random-weight Llama (4 layers, hidden 128, vocabulary 512, positions to 70k,
written to a temporary directory): the stall in question is the host's indexing, which does not
depend on the model, while the embedded model's 8k positions and one-core prefill would not fit
a 64k prompt. Prompts are random tokens with recurring stretches, so lookup drafts.

Per engine and phase: median and max step milliseconds, over the steps before the long request
joins (``before``), while its prompt is prefilled in chunks (``prefill``), its first 10 decode
steps (``indexing``: where `auto` indexes the prompt) and the rest (``after``); for `auto`, the
most milliseconds context lookup took in one step of the phase (its own timer, which the
engine's ``get_stats`` reports). Written to
DIR/results.json and DIR/table.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from lookup_host import text_with_repeats  # benchmarks/, this script's folder

BATCH_MATES = 7
INDEXING_STEPS = 10


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
    phases: dict[str, list[float]] = {"before": [], "prefill": [], "indexing": [], "after": []}
    lookup: dict[str, list[float]] = {k: [] for k in phases}  # auto: lookup ms of each step
    seen = {"lookup": 0.0}

    def step() -> dict:
        t0 = time.perf_counter()
        outs = eng.step()
        ms = 1000 * (time.perf_counter() - t0)
        look = None
        if spec:  # the proposer's lookup seconds so far (read outside the timed step)
            total = vllm_selfspec.get_stats(llm)["time_s"]["lookup"]
            look, seen["lookup"] = 1000 * (total - seen["lookup"]), total
        return {"ms": ms, "outs": outs, "lookup_ms": look}

    for _ in range(args.warm_steps):
        step()

    def record(phase: str, s: dict) -> None:
        phases[phase].append(s["ms"])
        if s["lookup_ms"] is not None:
            lookup[phase].append(s["lookup_ms"])

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
            decode_steps = len(phases["indexing"]) + len(phases["after"])
            phase = "indexing" if decode_steps < INDEXING_STEPS else "after"
        record(phase, s)
    stats = vllm_selfspec.get_stats(llm) if spec else {}
    eng.engine_core.shutdown()
    return {
        "phases": {
            k: {
                "steps": len(v),
                "median_ms": round(statistics.median(v), 2) if v else None,
                "max_ms": round(max(v), 2) if v else None,
                "lookup_max_ms": round(max(lookup[k]), 3) if lookup[k] else None,
            }
            for k, v in phases.items()
        },
        "host_us_per_step": stats.get("host_us_per_step"),
        "lookup_index": stats.get("lookup_index"),
        "drafted_tokens": stats.get("drafted_tokens"),
        "accepted_tokens": stats.get("accepted_tokens"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=65536)
    p.add_argument("--chunk", type=int, default=4096, help="max_num_batched_tokens")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--warm-steps", type=int, default=20)
    p.add_argument("--steps-before", type=int, default=30)
    p.add_argument("--long-tokens", type=int, default=200, help="tokens the long request decodes")
    p.add_argument("--out", default="long-prompt-stall")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "tiny", args.vocab, args.prompt_tokens + 4096)
        results = {
            "settings": vars(args),
            "vanilla": run_engine(model, None, args),
            "auto": run_engine(model, {"method": "auto"}, args),
        }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    rows = [
        "| engine | phase | steps | median step ms | max step ms | max lookup ms of a step |",
        "|---|---|---|---|---|---|",
    ]
    for engine in ("vanilla", "auto"):
        for phase, r in results[engine]["phases"].items():
            look = "–" if r["lookup_max_ms"] is None else r["lookup_max_ms"]
            rows.append(
                f"| {engine} | {phase} | {r['steps']} | {r['median_ms']} | {r['max_ms']} | {look} |"
            )
    (out / "table.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    print(f"auto host µs per step: {results['auto']['host_us_per_step']}")


if __name__ == "__main__":
    main()

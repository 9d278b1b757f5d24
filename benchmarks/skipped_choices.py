"""`auto` with and without skipped choices (``GoodputController.look_due``), beside vanilla, in
one process: three engines live at once, the same prompt slices run by each in turn (the order
reversed every repeat), each slice's tokens per second over vanilla's, medians over slices.

    VLLM_ALLOW_INSECURE_SERIALIZATION=1 python benchmarks/skipped_choices.py \
        --prompts chat --num-prompts 24 --batch-size 8 --repeats 8

"every" is `auto` with every step's choice made (``look_due`` patched to return True in its
worker), as before choices could be skipped. Like the bench, every timed run starts from an empty
shared lookup index and prefix cache, after one untimed pass over the whole workload. Prints the
per-slice ratios, the paired ratio auto / every, parity against vanilla, and each engine's draft
counts and skipped choices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _every(worker) -> None:
    worker.model_runner.drafter.controller.look_due = lambda: True


def _counts(worker) -> dict:
    d = worker.model_runner.drafter
    st = d.stats
    return {
        "skipped_choices": d.controller.skipped_looks,
        "steps": st.steps,
        "drafted": st.drafted_tokens,
        "accepted": st.accepted_tokens,
        "lookup_drafted": st.lookup_drafted,
        "lookup_accepted": st.lookup_accepted,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", default="chat")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    args = p.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_selfspec import forget_outputs
    from vllm_selfspec.checkpoints import resolve_model
    from vllm_selfspec.tools.bench import engine_args
    from vllm_selfspec.tools.prompts import load_prompts

    model = resolve_model(None)
    prompts = load_prompts(args.prompts, args.num_prompts, model)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    auto = {"method": "auto"}
    engines = {
        name: LLM(
            model=model,
            max_num_seqs=args.batch_size,
            speculative_config=cfg,
            **engine_args(args.eager),
        )
        for name, cfg in (("vanilla", None), ("auto", auto), ("every", auto))
    }
    engines["every"].collective_rpc(_every)
    n, bs = len(prompts), args.batch_size
    slices = [(a, min(a + 2 * bs, n)) for a in range(0, n, 2 * bs)]

    def run(name: str, a: int, b: int):
        llm = engines[name]
        if name != "vanilla":
            forget_outputs(llm)
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        out = llm.generate(prompts[a:b], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in out], time.perf_counter() - t0

    outputs = {name: [] for name in engines}
    for name in engines:  # untimed: the whole workload once
        for a, b in slices:
            outputs[name].extend(run(name, a, b)[0])
    ratios: dict[str, list[float]] = {"auto": [], "every": []}
    for r in range(args.repeats):
        for a, b in slices:
            tps = {}
            for name in engines if r % 2 == 0 else reversed(engines):
                time.sleep(1.0)  # an idle worker polls its queue for a second after its last step
                ids, wall = run(name, a, b)
                tps[name] = sum(len(x) for x in ids) / wall
            for name in ratios:
                ratios[name].append(tps[name] / tps["vanilla"])
    print(
        json.dumps(
            {
                "args": vars(args),
                "speedup": {k: round(statistics.median(v), 3) for k, v in ratios.items()},
                "auto_over_every": round(
                    statistics.median(x / y for x, y in zip(ratios["auto"], ratios["every"])), 3
                ),
                "slice_ratios": {k: [round(x, 3) for x in v] for k, v in ratios.items()},
                "parity": {k: outputs[k] == outputs["vanilla"] for k in ratios},
                "counts": {k: engines[k].collective_rpc(_counts)[0] for k in ratios},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

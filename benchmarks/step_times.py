"""Where a step's time goes: per engine step, the runner's execute_model and sample_tokens
seconds, and the wall time to the next step (the rest: scheduling, outputs, IPC), by the step's
scheduled tokens. One engine per call (its engine core and its worker in processes of their
own, as a server runs them), hooks installed in the worker with collective_rpc.

    VLLM_ALLOW_INSECURE_SERIALIZATION=1 python benchmarks/step_times.py --config none \
        --prompts passages --num-prompts 8 --batch-size 1 --max-tokens 64
    ... --config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                   "prompt_lookup_min": 2}'
    ... --config '{"method": "auto"}'

Prints, per scheduled-token count, the steps and the median gap / execute (of which the model's
forward) / sample / rest in ms: "sample" holds the drafter in speculative engines, "rest" the
engine core's scheduling and the round trips to the worker process. Compare engines run back
to back only by the same token count, and mind the machine's drift (docs/performance.md, "How a
figure is made", alternates the engines): a
marginal verified token's cost is the difference between token counts *within* one run.
Then, per number of requests in a step (decode-only steps apart from those with a prompt
chunk), the steps, their seconds and the tokens they emitted: a drafter's steps with the batch
full against vanilla's, and its closed batch's tail (steps with fewer requests) apart. The
warm-up is one short prompt, so a speculative engine's first steps of each shape are counted;
with ``--warm-up`` the whole workload runs once first, as in the bench (its prompts then computed
again: the prefix cache is reset).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _hook(worker) -> None:
    import time as _t

    runner = worker.model_runner
    runner._step_log = []
    runner._forward_s = 0.0
    execute, sample, forward = runner.execute_model, runner.sample_tokens, runner._model_forward

    def execute_model(scheduler_output, *a, **k):
        t = _t.perf_counter()
        runner._forward_s = 0.0
        out = execute(scheduler_output, *a, **k)
        n = scheduler_output.total_num_scheduled_tokens
        per_req = scheduler_output.num_scheduled_tokens
        # rows: requests in the step; decode: no prefill chunk in it (a request scheduled for
        # more tokens than it verifies); emitted is filled in by sample_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens
        decode = all(k == 1 + len(spec.get(r, ())) for r, k in per_req.items())
        row = [t, n, _t.perf_counter() - t, 0.0, runner._forward_s, len(per_req), decode, 0]
        runner._step_log.append(row)
        return out

    def model_forward(*a, **k):  # the model's own forward, inside execute_model
        t = _t.perf_counter()
        out = forward(*a, **k)
        runner._forward_s += _t.perf_counter() - t
        return out

    def sample_tokens(*a, **k):
        t = _t.perf_counter()
        out = sample(*a, **k)
        if runner._step_log:
            runner._step_log[-1][3] = _t.perf_counter() - t
            ids = getattr(out, "sampled_token_ids", None) or []
            runner._step_log[-1][7] = sum(len(x) for x in ids)
        return out

    runner.execute_model, runner.sample_tokens = execute_model, sample_tokens
    runner._model_forward = model_forward


def _read(worker) -> list:
    return worker.model_runner._step_log


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="none", help='speculative config JSON, or "none"')
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", default="passages")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    p.add_argument(
        "--warm-up",
        action="store_true",
        help="run the whole workload once first, as the bench does (a selfspec engine's cost "
        "model and acceptance warm; the outputs it saw are forgotten before the timed run)",
    )
    p.add_argument(
        "--no-frame-stack-cache",
        dest="frame_stack_cache",
        action="store_false",
        help="run the engine without the frame-stack chunk cache (vllm_selfspec/frame_stack.py), "
        "which is on by default, as in the bench",
    )
    args = p.parse_args()

    from vllm_selfspec.tools.bench import frame_stack_cache

    with frame_stack_cache(args.frame_stack_cache) as state:
        print(f"frame-stack chunk cache {state}")
        run(args)


def run(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    from vllm_selfspec.checkpoints import resolve_model
    from vllm_selfspec.tools.bench import engine_args
    from vllm_selfspec.tools.prompts import load_prompts

    model = resolve_model(args.model)
    cfg = None if args.config == "none" else json.loads(args.config)
    prompts = load_prompts(args.prompts, args.num_prompts, model)
    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        max_num_seqs=args.batch_size,
        speculative_config=cfg,
        **engine_args(args.eager),
    )
    print(
        f"engine ({'eager' if args.eager else 'compiled'}) started in {time.perf_counter() - t0:.0f} s"
    )
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    if args.warm_up:
        from vllm_selfspec import forget_outputs
        from vllm_selfspec.config import methods

        llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False
        )
        if cfg is not None and cfg.get("method") in methods():
            forget_outputs(llm)
        llm.reset_prefix_cache()
    llm.collective_rpc(_hook)
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
    wall = time.perf_counter() - t0
    log = llm.collective_rpc(_read)[0]
    print(f"{args.config}: {wall:.1f} s, {len(log)} steps")
    by_tokens: dict[int, list] = {}
    by_rows: dict[tuple[bool, int], list] = {}  # (decode-only, requests) -> [steps, s, tokens]
    for (t, n, ex, sa, fw, requests, decode, emitted), nxt in zip(log, log[1:]):
        by_tokens.setdefault(n, []).append((nxt[0] - t, ex, sa, fw))
        acc = by_rows.setdefault((decode, requests), [0, 0.0, 0])
        acc[0], acc[1], acc[2] = acc[0] + 1, acc[1] + nxt[0] - t, acc[2] + emitted
    for n in sorted(by_tokens):
        rows = by_tokens[n]
        gap, ex, sa, fw = (statistics.median(r[i] for r in rows) * 1e3 for i in range(4))
        print(
            f"  {n:4d} tokens: {len(rows):4d} steps, gap {gap:6.1f} ms = execute {ex:6.1f}"
            f" (forward {fw:6.1f}) + sample {sa:5.1f} + rest {gap - ex - sa:5.1f}"
        )
    print("  by requests in the step (the last step left out):")
    for (decode, requests), (steps, secs, emitted) in sorted(by_rows.items()):
        print(
            f"  {'decode' if decode else 'prefill'} {requests:3d} requests: {steps:4d} steps,"
            f" {secs:6.2f} s, {emitted:5d} tokens, {emitted / secs:6.1f} tokens/s"
        )


if __name__ == "__main__":
    main()

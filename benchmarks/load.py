"""Load and fault benchmark of a served selfspec model (the long form of the load test in tests/engine/test_serve.py).

    flock /tmp/selfspec-engine.lock .venv/bin/python benchmarks/load.py \
        --config examples/selfspec-layerskip.json --duration 600 --concurrency 64

1. vanilla vLLM computes the greedy references of the prompt pool offline (same engine settings);
2. vLLM's OpenAI server starts on 127.0.0.1 with the selfspec config;
3. ``--concurrency`` streaming clients send requests for ``--duration`` seconds (greedy/sampled,
   short to long prompts, ``--abort-prob`` of them dropped mid-stream);
4. the summary (requests, errors, greedy mismatches, tokens/s, server RSS over time in all and by
   process, selfspec stats and vLLM's spec-decode counters from /metrics, live selfspec requests
   afterwards) is printed and written to ``--out``. Exit status 1 on any error, greedy mismatch
   or leftover request state.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from pathlib import Path

from vllm_selfspec.tools.bench import frame_stack_cache
from vllm_selfspec.tools.loadtest import cli_args, engine_kw, greedy_references, run_load
from vllm_selfspec.tools.serving import Server, parse_metrics


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        default=str(Path(__file__).parents[1] / "examples" / "selfspec-layerskip.json"),
        help="selfspec config file (JSON), or 'none' for vanilla vLLM (the baseline's memory)",
    )
    p.add_argument("--model", default=None, help="HF checkpoint (default: the embedded model)")
    p.add_argument("--duration", type=float, default=300, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--abort-prob", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default="load-server.log", help="server log file")
    p.add_argument("--out", default="load-results.json")
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    args = p.parse_args()
    kw = engine_kw(args.eager)
    from vllm import LLM

    from vllm_selfspec.checkpoints import prepare_embedded_model

    model = args.model or str(prepare_embedded_model(progress=False))
    config = None if args.config == "none" else str(Path(args.config).resolve())
    t0 = time.monotonic()
    llm = LLM(model=model, **kw)
    refs = greedy_references(llm)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    print(f"vanilla references: {len(refs)} prompts in {time.monotonic() - t0:.0f}s")

    server_args = [
        *cli_args(kw),
        "--served-model-name",
        "model",
        *(["--speculative-config", config] if config else []),
    ]
    # the server under the frame-stack chunk cache, as the bench's engines (frame_stack.py)
    with (
        frame_stack_cache(True) as stack_cache,
        Server(model, server_args, log_path=Path(args.log).resolve()) as srv,
    ):
        print(
            f"server ready at {srv.url} (log: {args.log}); {args.concurrency} clients for "
            f"{args.duration:.0f}s"
        )
        res = asyncio.run(
            run_load(
                srv.url,
                "model",
                refs,
                args.duration,
                args.concurrency,
                abort_prob=args.abort_prob,
                seed=args.seed,
                rss_fn=srv.rss_by_process,
            )
        )
        deadline = time.monotonic() + 15
        while True:
            metrics = parse_metrics(srv.get("/metrics"))
            live = sum(v for k, v in metrics.items() if k.startswith("vllm:selfspec_live_requests"))
            if live == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    out = {
        "config": json.loads(Path(config).read_text()) if config else None,
        "concurrency": args.concurrency,
        "abort_prob": args.abort_prob,
        "eager": args.eager,
        "frame_stack_cache": stack_cache,
        **res.summary(),
        "live_requests_after": live,
        "errors_sample": res.errors[:10],
        "mismatches_sample": res.mismatches[:3],
        "rss_mib": [(round(t, 1), round(b / 2**20)) for t, b in res.rss],
        "rss_mib_by_process": {
            name: [(round(t, 1), round(b / 2**20)) for t, b in series]
            for name, series in res.rss_by_process.items()
        },
        "metrics": {
            k: v
            for k, v in metrics.items()
            if k.startswith(("vllm:selfspec_", "vllm:spec_decode_num"))
            and "_bucket" not in k
            and "_created" not in k
        },
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(res.summary(), indent=2))
    print(f"live selfspec requests after the run: {live}; full results: {args.out}")
    return 1 if res.errors or res.mismatches or live else 0


if __name__ == "__main__":
    sys.exit(main())

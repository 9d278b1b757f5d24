"""How long an engine takes to start, start after start: each start in a fresh process
(``LLM(...)`` on the embedded model with the bench's engine settings, imports not counted), so
the second start shows whether vLLM's compile cache loads.

    python benchmarks/startup.py [--starts 2] [--config JSON] [--eager]
    VLLM_USE_AOT_COMPILE=0 python benchmarks/startup.py

Prints each start's seconds and what vLLM logged of its ahead-of-time compile cache (saved,
loaded, or compiled again after a failed load; nothing on the Inductor cache's path).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

#: vLLM's log lines on its ahead-of-time compile cache (vllm/compilation/decorators.py)
CACHE_EVENTS = {
    "saved AOT compiled function": "saved",
    "Directly load AOT compilation": "loaded",
    "Compiling model again due to a load failure": "load failed, compiled again",
}


def _start(config: str, eager: bool) -> None:
    from vllm import LLM

    from vllm_selfspec.checkpoints import resolve_model
    from vllm_selfspec.tools.bench import engine_args

    spec = None if config == "none" else json.loads(config)
    t0 = time.perf_counter()
    LLM(model=resolve_model(None), max_num_seqs=8, speculative_config=spec, **engine_args(eager))
    print(f"STARTED {time.perf_counter() - t0:.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--starts", type=int, default=2)
    p.add_argument("--config", default="none", help='speculative config JSON, or "none"')
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        _start(args.config, args.eager)
        return
    cmd = [sys.executable, __file__, "--_child", "--config", args.config]
    for i in range(1, args.starts + 1):
        out = subprocess.run(
            cmd + (["--eager"] if args.eager else []), capture_output=True, text=True
        )
        log = out.stdout + out.stderr
        seconds = next((ln.split()[1] for ln in log.splitlines() if ln.startswith("STARTED")), None)
        if seconds is None:
            sys.exit(f"start {i} failed (exit code {out.returncode}):\n{log[-3000:]}")
        events = [name for line, name in CACHE_EVENTS.items() if line in log]
        print(f"start {i}: {seconds} s; compile cache: {', '.join(events) or 'no AOT event'}")


if __name__ == "__main__":
    main()

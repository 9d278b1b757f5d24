"""``vllm-selfspec`` command line: prepare-model | demo | bench."""
from __future__ import annotations

import argparse
import json
import sys


def _prepare_model(args) -> int:
    from .models import prepare_embedded_model

    print(prepare_embedded_model(force=args.force))
    return 0


def _demo(args) -> int:
    from .demo import run_demo

    config = json.loads(args.config) if args.config else None
    return run_demo(model=args.model, speculative_config=config, max_tokens=args.max_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-selfspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-model", help="convert the embedded GGUF model to an HF checkpoint")
    p.add_argument("--force", action="store_true", help="convert again even if cached")
    p.set_defaults(func=_prepare_model)

    p = sub.add_parser("demo", help="vanilla vLLM vs a self-spec method on a few prompts")
    p.add_argument("--model", default=None, help="HF checkpoint path (default: embedded model)")
    p.add_argument("--config", default=None,
                   help="selfspec speculative config as JSON (default: the demo's layerskip)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.set_defaults(func=_demo)

    from . import bench

    p = sub.add_parser("bench", help="benchmark vanilla and methods on the same prompts")
    bench.add_arguments(p)
    p.set_defaults(func=bench.main)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

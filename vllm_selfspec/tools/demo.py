"""``vllm-selfspec demo``: vanilla vLLM and a self-spec method on a few prompts, side by side.

Each engine runs in its own process (the bench workers, both live at once, the timed runs back to
back), with the same settings, in vLLM's default mode (compiled; ``--eager``: both eager), and
greedy decoding, one request at a time: the latency a single
user sees, where speculative decoding is for (at larger batch sizes the goodput controller drafts
less, down to nothing: docs/performance.md). Prints both texts, tokens/s, acceptance and whether
the tokens are identical.
"""

from __future__ import annotations

# transformers is imported inside run_demo: the CLI imports this module
import tempfile
from pathlib import Path

from ..checkpoints import resolve_model
from .bench import mode_name, run_interleaved
from .prompts import load_prompts

#: the default demo method: what a user should turn on (context lookup + the strongest
#: self-drafter the model has, under the goodput controller)
DEMO_CONFIG = {"method": "auto"}


def run_demo(
    model: str | None = None,
    speculative_config: dict | None = None,
    max_tokens: int = 96,
    eager: bool = False,
) -> int:
    from transformers import AutoTokenizer

    model = resolve_model(model)
    cfg = speculative_config or DEMO_CONFIG
    prompts = load_prompts("chat", 3, model) + load_prompts("humaneval", 1, model)
    tok = AutoTokenizer.from_pretrained(model)
    spec = {
        "model": model,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "batch_size": 1,
        "eager": eager,
    }
    if cfg.get("method") == "auto":
        from ..config import auto_note

        print(auto_note(model), flush=True)
    print(f"running vanilla vLLM and {cfg}, {mode_name(eager)} ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="selfspec-demo-") as tmp:
        raw, ratios = run_interleaved(
            {"vanilla": None, "selfspec": cfg},
            spec,
            repeats=1,
            group_size=1,
            logs=Path(tmp),
            tmp=Path(tmp),
        )
    van, ss = raw["vanilla"], raw["selfspec"]
    same = 0
    for i, prompt in enumerate(prompts):
        a, b = van["token_ids"][i], ss["token_ids"][i]
        same += a == b
        print(f"\n=== prompt {i + 1}: {prompt.strip()[-80:]!r}")
        print(f"--- vanilla:\n{tok.decode(a)}")
        print(f"--- {cfg['method']}:\n{tok.decode(b)}")
        print(f"--- identical tokens: {a == b}")
    tps = [r["runs"][0]["tokens"] / r["runs"][0]["wall_s"] for r in (van, ss)]
    c = ss["counters"]
    acc = c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else 0.0
    print(
        f"\nvanilla: {tps[0]:.1f} tok/s | {cfg['method']}: {tps[1]:.1f} tok/s "
        f"({ratios['selfspec'][0]:.2f}x), acceptance {acc:.0%}, "
        f"identical outputs {same}/{len(prompts)} (one request at a time)"
    )
    print(
        f"engine start-up ({mode_name(eager)}): vanilla {van['startup_s']:.0f} s, "
        f"{cfg['method']} {ss['startup_s']:.0f} s"
    )
    return 0 if same == len(prompts) else 1

"""``vllm-selfspec demo``: vanilla vLLM and a self-spec method on a few prompts, side by side.

Each engine runs in its own process (the bench worker), with the same settings and greedy
decoding; prints both texts, tokens/s, acceptance and whether the tokens are identical.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .bench import _run_worker
from .models import resolve_model
from .prompts import load_prompts

#: the default demo method: what a user should turn on (context lookup + the strongest
#: self-drafter the model has, under the goodput controller)
DEMO_CONFIG = {"method": "auto"}


def run_demo(
    model: str | None = None, speculative_config: dict | None = None, max_tokens: int = 96
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
        "batch_size": len(prompts),
        "repeats": 1,
    }
    with tempfile.TemporaryDirectory(prefix="selfspec-demo-") as tmp:
        print("running vanilla vLLM ...", flush=True)
        van = _run_worker("vanilla", {**spec, "config": None}, Path(tmp) / "vanilla.log", Path(tmp))
        print(f"running {cfg} ...", flush=True)
        ss = _run_worker("selfspec", {**spec, "config": cfg}, Path(tmp) / "selfspec.log", Path(tmp))
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
        f"({tps[1] / tps[0]:.2f}x), acceptance {acc:.0%}, "
        f"identical outputs {same}/{len(prompts)}"
    )
    return 0 if same == len(prompts) else 1

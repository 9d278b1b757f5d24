"""Context-lookup drafters compared offline, on the model's own greedy outputs (no engine).

    python benchmarks/lookup_offline.py --prompts chat,passages,humaneval --num-prompts 8 \
        --max-tokens 64 --verify-cost 0.08

For every prompt the model's greedy continuation is generated once with HF transformers; then
each drafter is replayed over it as speculative decoding would run it (at each step it proposes
from the tokens so far, the longest prefix equal to the real continuation is accepted, decoding
moves on by accepted + 1). Per drafter: steps, drafted and accepted tokens, and a modelled
speedup ``tokens / (steps + c * drafted)``, c = ``--verify-cost``, the seconds of one verified
token over a plain step's (on this project's CPU, measured: ~0.08 at batch 1, ~0.3 of a request's
share at batch 8). "oracle" verifies exactly the tokens that will be accepted: the bound no
choice of draft lengths can pass with these proposals. Also prints the acceptance of lookup
tokens per slot (``lookup.slot``), which is what the goodput controller estimates online.
"""

from __future__ import annotations

import argparse
from collections import defaultdict


def greedy_outputs(model: str, prompt_set: str, num: int, max_tokens: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_selfspec.tools.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    out = []
    for p in load_prompts(prompt_set, num, model):
        ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
        gen = lm.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        out.append((ids.shape[1], gen[0].tolist()))
    return out


def ngram_propose(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """vLLM's ``ngram``: the earliest occurrence of the longest suffix n-gram (lo..hi), then the k
    tokens after it."""
    n = len(tokens)
    for length in range(min(hi, n - 1), lo - 1, -1):
        suffix = tokens[n - length :]
        for i in range(n - length):
            if tokens[i : i + length] == suffix:
                return tokens[i + length : i + length + k]
    return []


def replay(seqs, propose, cost: float, oracle: bool = False) -> dict:
    steps = drafted = accepted = 0
    for prompt_len, tokens in seqs:
        t, state = prompt_len, {}
        while t < len(tokens):
            draft = propose(tokens[:t], state)
            a = 0
            while a < len(draft) and t + a < len(tokens) and draft[a] == tokens[t + a]:
                a += 1
            steps += 1
            drafted += a if oracle else len(draft)
            accepted += a
            t += a + 1
    return {
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": round(accepted / max(drafted, 1), 2),
        "modelled_speedup": round((steps + accepted) / (steps + cost * drafted), 3),
    }


def context_lookup(k: int, **options):
    """This project's context lookup (``lookup.ContextIndex``), the request's own tree only."""
    from vllm_selfspec.lookup import ContextIndex

    def propose(tokens, state):
        index = state.setdefault("index", ContextIndex(options))
        index.extend(tokens[len(index) :])
        return index.propose(k)[0]

    return propose


def suffix_decoding(k: int, depth: int = 24, factor: float = 1.0, min_prob: float = 0.1):
    """vLLM's ``suffix`` method as its proposer calls ArcticInference's cache (one request at a
    time, no other request's outputs)."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    def propose(tokens, state):
        if "cache" not in state:
            state["cache"] = SuffixDecodingCache(depth, max_cached_requests=0)
            state["cache"].start_request("r", tokens)
            state["n"] = len(tokens)
        cache = state["cache"]
        if len(tokens) > state["n"]:
            cache.add_active_response("r", tokens[state["n"] :])
            state["n"] = len(tokens)
        draft = cache.speculate(
            "r", tokens[-depth:], max_spec_tokens=k, max_spec_factor=factor, min_token_prob=min_prob
        )
        return draft.token_ids

    return propose


def slot_acceptance(seqs, k: int = 16) -> dict:
    """Acceptance of context-lookup tokens per slot (``lookup.slot``: match length bucket and the
    tree's estimate bucket), over every decoding position: what the goodput controller learns
    online."""
    from vllm_selfspec.lookup import ESTIMATE_BUCKETS, ContextIndex

    tried, hit = defaultdict(int), defaultdict(int)
    per = len(ESTIMATE_BUCKETS) + 1
    for prompt_len, tokens in seqs:
        index = ContextIndex()
        index.extend(tokens[:prompt_len])
        for t in range(prompt_len, len(tokens)):
            draft, slots = index.propose(k)
            for j, (x, s) in enumerate(zip(draft, slots)):
                if t + j >= len(tokens):
                    break
                key = f"match>={2 ** (s // per)} est{s % per}"
                tried[key] += 1
                if x != tokens[t + j]:
                    break
                hit[key] += 1
            index.extend([tokens[t]])
    return {k: f"{hit[k] / tried[k]:.2f} of {tried[k]}" for k in sorted(tried)}


def main() -> None:
    from vllm_selfspec.checkpoints import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF checkpoint (default: the embedded model)")
    p.add_argument("--prompts", default="chat,passages,humaneval")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--verify-cost", type=float, default=0.08)
    args = p.parse_args()
    model = resolve_model(args.model)
    drafters = {
        "vLLM ngram (k 4, n 2-4)": lambda toks, st: ngram_propose(toks, 4, 2, 4),
        "vLLM suffix (k 24)": suffix_decoding(24),
        "context lookup (k 6)": context_lookup(6),
        "context lookup (k 16, factor 1)": context_lookup(16, max_spec_factor=1.0),
        "context lookup (k 16)": context_lookup(16),
        "context lookup (k 24)": context_lookup(24),
    }
    for prompt_set in args.prompts.split(","):
        seqs = greedy_outputs(model, prompt_set, args.num_prompts, args.max_tokens)
        print(f"\n{prompt_set} ({len(seqs)} prompts x {args.max_tokens} tokens)")
        for name, propose in drafters.items():
            print(f"  {name:30s} {replay(seqs, propose, args.verify_cost)}")
        print(
            f"  {'oracle over lookup (k 16)':30s} "
            f"{replay(seqs, context_lookup(16), args.verify_cost, oracle=True)}"
        )
        print(f"  acceptance by slot: {slot_acceptance(seqs)}")


if __name__ == "__main__":
    main()

"""Exit heads offline: agreement with the final layer against training data and steps, and a
higher-capacity exit design beside the Cascade adapter (docs/heads.md, "Data, steps and
capacity"). Three stages, each reading the previous one's files in ``--dir``:

    python benchmarks/heads_curve.py data --dir /tmp/heads-curve --general 320 --code 160
    python benchmarks/heads_curve.py train --dir /tmp/heads-curve --kind mlp --layer 8 \
        --steps 300 --eval-every 50 --train-frac 0.5 --out /tmp/heads-curve/runs/mlp8-0.5.json
    python benchmarks/heads_curve.py plot --dir /tmp/heads-curve --out curve.png

``data``: the embedded model's greedy outputs (vLLM, float32, 128 tokens) for the default training
corpus (``heads/corpus.py``: ``--general`` requests, ``--code`` standard-library prompts) and for
the held-out sets (40 HumanEval prompts, the chat set, the passages set: none is in the corpus),
then one teacher-forced HF forward per sequence storing the residual stream at ``LAYERS`` for
every position and the final top-64 logits and log-normalisers (T = 1, 2).

``train``: one exit head at ``--layer`` on the training sequences, the Cascade loss
(0.5 CE + 0.5 T^2 KL at T = 2 against the stored top-64), AdamW with warm-up and cosine decay;
per step ``--seqs`` sequences, ``--per-seq`` loss positions from each. Kinds:

* ``mlp``: today's Cascade adapter (``heads.modules.CascadeHead``'s transform) on one position;
* ``layer``: a decoder layer that shares its keys and values with the model's own layer
  ``--layer`` (its input norm and k/v projections are that layer's, frozen, so in an engine its
  keys and values are the ones already in vLLM's KV cache); its q/o projections, post-attention
  norm and MLP start as that layer's and are trained. It costs one decoder layer per draft token
  and sees every earlier position through attention;
* ``deep``: a feature head (``heads.FeatureHead``): the stream after ``--layer`` layers and the
  final layer's output ``--offsets`` positions back (each row trains at one of them; scored at
  each); at ``--layer 0`` a draft runs no decoder layer (docs/heads.md, "Feature heads");
* ``raw`` (the LM head on the stream after ``--layer`` layers) and ``raw1`` (the ``layer`` head
  untrained: must equal ``raw`` at ``--layer`` + 1, a check of its forward).

``chain``: a ``deep`` head at layer 0 saved by ``train --save``, drafting chains on the held-out
sets as the engine drafts them (draft j reads the embedding of draft j - 1).

Evaluation: top-1 agreement with the final layer's token on the held-out sets' generated
positions, exact float32 read-out.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from pathlib import Path

#: streams ``data`` stores: the embeddings (0), exit layers, and the final layer's normed output
#: (HF's last hidden state: what the LM head reads, the ``deep`` head's input)
LAYERS = (0, 6, 8, 9, 10, 12, 30)
HELD_OUT = ("humaneval", "chat", "passages")
MODEL = "smollm2-135m-instruct"


def _generate(d: Path, n_general: int, n_code: int, max_tokens: int) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_selfspec.checkpoints import model_dir
    from vllm_selfspec.heads.corpus import general_requests, stdlib_functions
    from vllm_selfspec.tools.prompts import load_prompts, render_chat

    path = str(model_dir(MODEL))
    tok = AutoTokenizer.from_pretrained(path)
    sets = {
        "eval_humaneval": load_prompts("humaneval", 40, path),
        "eval_chat": load_prompts("chat", None, path),
        "eval_passages": load_prompts("passages", None, path),
        "train_general": [
            render_chat(tok, [{"role": "user", "content": r}]) for r in general_requests(n_general)
        ],
        "train_code": stdlib_functions(n_code),
    }
    llm = LLM(
        model=path,
        enforce_eager=True,
        max_num_seqs=64,
        dtype="float32",
        kv_cache_memory_bytes=3 << 30,
        max_model_len=2048,
        seed=0,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for name, prompts in sets.items():
        with open(d / f"{name}.jsonl", "w") as f:
            for o in llm.generate(prompts, params):
                rec = {"prompt": list(o.prompt_token_ids), "out": list(o.outputs[0].token_ids)}
                f.write(json.dumps(rec) + "\n")


def _capture(d: Path, name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_selfspec.checkpoints import model_dir

    model = AutoModelForCausalLM.from_pretrained(str(model_dir(MODEL)), dtype=torch.float32)
    seqs = [json.loads(line) for line in open(d / f"{name}.jsonl")]
    out = []
    with torch.no_grad():
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]["prompt"]) + len(seqs[i]["out"]))
        for s in range(0, len(order), 8):  # right-padded: causal attention never sees the pads
            idx = order[s : s + 8]
            toks = [seqs[i]["prompt"] + seqs[i]["out"] for i in idx]
            ids = torch.zeros(len(idx), max(map(len, toks)), dtype=torch.long)
            for b, t in enumerate(toks):
                ids[b, : len(t)] = torch.tensor(t)
            o = model.model(input_ids=ids, output_hidden_states=True)
            for b, i in enumerate(idx):
                n = len(toks[b])
                logits = model.lm_head(o.last_hidden_state[b, :n])
                vals, top = logits.topk(64, -1)
                lse = torch.stack([logits.logsumexp(-1), (logits / 2).logsumexp(-1)], -1)
                out.append(
                    {
                        "ids": torch.tensor(toks[b]),
                        "prompt_len": len(seqs[i]["prompt"]),
                        "hidden": {l: o.hidden_states[l][b, :n].clone() for l in LAYERS},
                        "topk_ids": top,
                        "topk_logits": vals,
                        "lse": lse,
                    }
                )
    torch.save(out, d / f"{name}.pt")


def data(args) -> None:
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    _generate(d, args.general, args.code, args.max_tokens)
    for name in [f"eval_{s}" for s in HELD_OUT] + ["train_general", "train_code"]:
        _capture(d, name)


def deep_head(d: int, b: int, max_offset: int):
    """An untrained ``deep`` head: the package's feature head (``heads.FeatureHead``: the stream
    after layer L at position t and the final layer's normed output at position t - o, which a
    verification has already computed; o = 1 for the first draft token after it, o = j for the
    j-th)."""
    from vllm_selfspec.heads import make_head

    return make_head("feature", d, b, max_offset)


def train(args) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from transformers import AutoModelForCausalLM

    from vllm_selfspec.checkpoints import model_dir
    from vllm_selfspec.heads.losses import cascade_loss
    from vllm_selfspec.heads.modules import CascadeHead

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    d = Path(args.dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir(MODEL)), dtype=torch.float32)
    model.requires_grad_(False)
    norm, lm_head, rope = model.model.norm, model.lm_head, model.model.rotary_emb
    cfg = model.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // H
    L = args.layer
    seqs = torch.load(d / "train_general.pt") + torch.load(d / "train_code.pt")
    random.Random(0).shuffle(seqs)
    seqs = seqs[: max(1, int(len(seqs) * args.train_frac))]
    held_out = {k: torch.load(d / f"eval_{k}.pt") for k in HELD_OUT}

    def rotate(x, pos):
        cos, sin = (t[0][:, None] for t in rope(x, pos[None]))
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return x * cos + torch.cat((-x2, x1), -1) * sin

    class SharedKVLayer(nn.Module):
        """Decoder layer L with its input norm and k/v projections frozen (its keys and values
        are layer L's); q/o projections, post-attention norm and MLP trained."""

        def __init__(self, layer) -> None:
            super().__init__()
            self.src = layer
            self.q_proj = copy.deepcopy(layer.self_attn.q_proj)
            self.o_proj = copy.deepcopy(layer.self_attn.o_proj)
            self.post_norm = copy.deepcopy(layer.post_attention_layernorm)
            self.mlp = copy.deepcopy(layer.mlp)
            for p in (*self.q_proj.parameters(), *self.o_proj.parameters()):
                p.requires_grad_(True)
            for p in (*self.post_norm.parameters(), *self.mlp.parameters()):
                p.requires_grad_(True)

        def forward(self, h):
            n, pos = h.shape[0], torch.arange(h.shape[0])
            x = self.src.input_layernorm(h)
            with torch.no_grad():
                at = self.src.self_attn
                k = rotate(at.k_proj(x).view(n, KV, D), pos).repeat_interleave(H // KV, 1)
                v = at.v_proj(x).view(n, KV, D).repeat_interleave(H // KV, 1)
            q = rotate(self.q_proj(x).view(n, H, D), pos)
            o = F.scaled_dot_product_attention(
                *(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True
            )[0]
            h2 = h + self.o_proj(o.transpose(0, 1).reshape(n, H * D))
            return h2 + self.mlp(self.post_norm(h2))

    offsets = [int(x) for x in args.offsets.split(",")]
    if args.kind in ("layer", "raw1"):
        head = SharedKVLayer(model.model.layers[L])
    elif args.kind == "mlp":
        head = CascadeHead(cfg.hidden_size, 512)
    elif args.kind == "deep":
        head = deep_head(cfg.hidden_size, 512, max(offsets))
    else:
        head = None

    def run(seq, pos=None, off=None):
        """The head's output stream at positions ``pos`` (all: None); ``deep`` reads the final
        layer's output ``off`` positions back (zeros before the sequence's start)."""
        h = seq["hidden"][L]
        pos = torch.arange(len(h)) if pos is None else pos
        if head is None:
            return h[pos]
        if args.kind == "deep":
            back = pos - off
            f = seq["hidden"][30][back.clamp(min=0)] * (back >= 0)[:, None]
            return head.transform(h[pos], f, off.expand_as(pos))
        return head.transform(h[pos]) if args.kind == "mlp" else head(h)[pos]

    @torch.no_grad()
    def evaluate():
        res = {}
        for o in offsets if args.kind == "deep" else [0]:
            suffix = f"@{o}" if args.kind == "deep" else ""
            for name, group in held_out.items():
                hit = tot = 0
                for s in group:
                    n, p = len(s["ids"]), s["prompt_len"]
                    pos = torch.arange(p - 1, n - 1)
                    pred = lm_head(norm(run(s, pos, torch.tensor(o)))).argmax(-1)
                    hit += int((pred == s["topk_ids"][pos, 0]).sum())
                    tot += len(pred)
                res[name + suffix] = round(100 * hit / max(tot, 1), 1)
        return res

    if args.kind in ("raw", "raw1"):
        print(json.dumps({"kind": args.kind, "layer": L, "eval": evaluate()}))
        return
    params = [p for p in head.parameters() if p.requires_grad]
    print(args.kind, "trained parameters", sum(p.numel() for p in params), "sequences", len(seqs))
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    g = random.Random(1)
    curve, t0 = [], time.time()
    for step in range(args.steps):
        warm = min(1.0, (step + 1) / max(1, args.steps * 0.05))
        for pg in opt.param_groups:
            pg["lr"] = args.lr * warm * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        outs, ids, vals, lses = [], [], [], []
        for i in g.sample(range(len(seqs)), args.seqs):
            s, n = seqs[i], len(seqs[i]["ids"])
            sel = torch.tensor(g.sample(range(1, n - 1), min(args.per_seq, n - 2)))
            off = torch.tensor([g.choice(offsets) for _ in sel])
            outs.append(run(s, sel, off))
            ids.append(s["topk_ids"][sel])
            vals.append(s["topk_logits"][sel])
            lses.append(s["lse"][sel])
        z = lm_head(norm(torch.cat(outs)))
        loss = cascade_loss(z, torch.cat(ids), torch.cat(vals), torch.cat(lses))
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 20 == 0:
            print(step, round(loss.item(), 3), round(time.time() - t0, 1), flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            positions = (step + 1) * args.seqs * args.per_seq
            curve.append({"step": step + 1, "positions": positions, **evaluate()})
            print(curve[-1], flush=True)
    res = {
        **{k: getattr(args, k) for k in ("kind", "layer", "steps", "seqs", "per_seq", "lr")},
        "offsets": offsets if args.kind == "deep" else None,
        "train_frac": args.train_frac,
        "train_positions": sum(len(s["ids"]) - 2 for s in seqs),
        "seconds": round(time.time() - t0),
        "eval": evaluate(),
        "curve": curve,
    }
    print(json.dumps(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res))
    if args.save:
        torch.save(
            {
                "args": {k: v for k, v in vars(args).items() if k != "func"},
                "state": head.state_dict(),
            },
            args.save,
        )


def chain(args) -> None:
    """Draft chains of a layer-0 deep head on the held-out sets, exactly as an engine would draft
    them (no decoder layer runs: draft j reads the embedding of draft j-1 and the final layer's
    output at the verified position, offset j): per set, the share of positions whose first j
    drafts all equal the target's greedy tokens, the mean accepted length for each fixed draft
    length, the same when drafting stops at the first draft whose top-1 probability is below a
    floor, and the head's own time per draft token (one row, full vocabulary, one thread)."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_selfspec.checkpoints import model_dir

    torch.set_num_threads(args.threads)
    saved = torch.load(args.head)
    if saved["args"]["layer"] != 0 or saved["args"]["kind"] != "deep":
        raise SystemExit("chain simulates deep heads at layer 0 only (drafts run no layer)")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir(MODEL)), dtype=torch.float32)
    embed, norm, lm_head = model.model.embed_tokens, model.model.norm, model.lm_head
    offsets = [int(x) for x in saved["args"]["offsets"].split(",")]
    head = deep_head(model.config.hidden_size, 512, max(offsets))
    head.load_state_dict(saved["state"])
    K = min(args.max_draft, max(offsets))
    floors = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
    res = {"head": args.head, "offsets": offsets, "max_draft": K}
    with torch.no_grad():
        for name in HELD_OUT:
            hits = torch.zeros(K)  # positions whose first j+1 drafts are all right
            gated = {f: [0, 0] for f in floors}  # floor -> [drafted, accepted]
            total = 0
            for s in torch.load(Path(args.dir) / f"eval_{name}.pt"):
                ids, p = s["ids"], s["prompt_len"]
                pos = torch.arange(max(p - 1, 1), len(ids) - 1)  # drafts after verified tokens
                f = s["hidden"][30][pos - 1]
                tok, alive, conf = ids[pos], torch.ones(len(pos), dtype=torch.bool), []
                for j in range(1, K + 1):
                    ok = pos + j < len(ids)
                    z = lm_head(
                        norm(head.transform(embed(tok), f, torch.tensor(j).expand(len(pos))))
                    )
                    prob, tok = torch.softmax(z, -1).max(-1)
                    truth = torch.where(ok, ids[(pos + j).clamp(max=len(ids) - 1)], -1)
                    alive = alive & ok & (tok == truth)
                    hits[j - 1] += alive.sum()
                    conf.append((prob, alive))
                total += len(pos)
                for fl in floors:  # draft while every draft so far cleared the floor
                    going = torch.ones(len(pos), dtype=torch.bool)
                    for prob, right in conf:
                        going = going & (prob >= fl)
                        gated[fl][0] += int(going.sum())
                        gated[fl][1] += int((going & right).sum())
            rate = (hits / total).tolist()
            res[name] = {
                "positions": total,
                "first_j_right": [round(r, 3) for r in rate],
                "mean_accepted_at_k": [round(sum(rate[:k]), 3) for k in range(1, K + 1)],
                "gated": {
                    str(fl): {
                        "drafted_per_step": round(d / total, 3),
                        "accepted_per_step": round(a / total, 3),
                    }
                    for fl, (d, a) in gated.items()
                },
            }
        x, f = embed(torch.tensor([42])), torch.randn(1, model.config.hidden_size)
        one = torch.tensor([1])
        for _ in range(20):
            lm_head(norm(head.transform(x, f, one)))
        t0 = time.perf_counter()
        for _ in range(200):
            lm_head(norm(head.transform(x, f, one))).argmax(-1)
        res["seconds_per_draft_token"] = round((time.perf_counter() - t0) / 200, 5)
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res))


def plot(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(p.read_text()) for p in sorted(Path(args.dir, "runs").glob("*.json"))]
    fig, axes = plt.subplots(1, len(HELD_OUT), figsize=(5 * len(HELD_OUT), 4), sharey=True)
    for ax, name in zip(axes, HELD_OUT, strict=True):
        for r in runs:
            label = f"{r['kind']} @ {r['layer']}, {r['train_positions'] // 1000}k positions"
            xs = [c["step"] for c in r["curve"]]
            key = name if r["kind"] != "deep" else f"{name}@{r['offsets'][0]}"
            if r["kind"] == "deep":
                label = (
                    f"deep @ {r['layer']} (+ final layer, offset {r['offsets'][0]}), "
                    + label[label.index(",") + 2 :]
                )
            ax.plot(xs, [c[key] for c in r["curve"]], marker="o", label=label)
        ax.set_title(f"held-out {name}")
        ax.set_xlabel("training steps (512 positions each)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("top-1 agreement with the final layer (%)")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(required=True)
    p = sub.add_parser("data")
    p.add_argument("--dir", required=True)
    p.add_argument("--general", type=int, default=320)
    p.add_argument("--code", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=128)
    p.set_defaults(func=data)
    p = sub.add_parser("train")
    p.add_argument("--dir", required=True)
    p.add_argument("--kind", choices=["mlp", "layer", "deep", "raw", "raw1"], default="layer")
    p.add_argument(
        "--offsets", default="1", help="deep: how far back the final layer's output is, e.g. 1,2,3"
    )
    p.add_argument("--layer", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--per-seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-frac", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--out", default="")
    p.add_argument("--save", default="", help="write the trained head's weights here")
    p.set_defaults(func=train)
    p = sub.add_parser("chain")
    p.add_argument("--dir", required=True)
    p.add_argument("--head", required=True, help="a deep head at layer 0 saved by train --save")
    p.add_argument("--max-draft", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="")
    p.set_defaults(func=chain)
    p = sub.add_parser("plot")
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=plot)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Self-distillation data: the target model's own greedy generations on an offline prompt corpus,
with the residual stream at the exit layers and the final distribution at every position.

Per kept position we store

* ``hidden[l]``: HF ``hidden_states[l]``, the pre-final-norm residual stream after ``l`` layers
  (``l = 0``: the token embeddings; ``l = num_layers``: the final layer's normed output, which
  feature heads read at earlier positions, ``TokenData.earlier``);
* the final distribution as its top-``k`` logits + ids (``topk_ids[:, 0]`` is the final top-1)
  and its log-normaliser ``lse[:, j] = logsumexp(logits / TEMPERATURES[j])``. The full
  [tokens, 49152] distribution would be ~200 KB per token; with the log-normaliser the top-k
  probabilities stay exact and the remaining mass is one "tail" bucket (``losses.kl_topk``);
* ``generated``: the position predicts a token the model generated (vs. a prompt token).

Kept positions: every real token except each sequence's first (an attention-sink outlier that
no drafter ever exits at), up to the last generated token (exclusive) or EOS.

Prompts are split by a hash of their text: ``train`` (heads), ``fit`` (confidence estimators),
``val`` (thresholds, held-out metrics) and ``test`` (never touched by training; eval-heads).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import DynamicCache

from ..cachedir import staged_file
from ..tools.prompts import load_prompts, render_chat
from .corpus import general_requests, stdlib_functions

#: temperatures whose log-normaliser is stored (1: AdaDecode KL and CE; 2: Cascade distillation)
TEMPERATURES = (1.0, 2.0)
#: digest % 10 -> split
SPLIT_BUCKETS = {"train": range(0, 6), "fit": range(6, 7), "val": range(7, 8), "test": range(8, 10)}
TRAINING_SPLITS = ("train", "fit", "val")
#: prompt sources besides a JSONL file path ("general": ``corpus``, disjoint from the benchmarks)
SOURCES = ("general", "humaneval", "chat", "pydoc")
#: characters of Python documentation per raw-text prompt, and such prompts per pydoc topic
PYDOC_CHUNK_CHARS = 1500
PYDOC_CHUNKS_PER_TOPIC = 1


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def split_of(text: str) -> str:
    bucket = int(digest(text), 16) % 10
    return next(name for name, r in SPLIT_BUCKETS.items() if bucket in r)


@dataclass(frozen=True)
class Prompt:
    text: str
    source: str

    @property
    def split(self) -> str:
        return split_of(self.text)


def pydoc_prompts(tokenizer) -> list[Prompt]:
    """Prompts from ``pydoc_data.topics`` (Python's own docs, always offline): per topic a
    raw-text chunk to continue and, if the tokenizer has a chat template, a chat request to
    explain the topic (titled by the topic's first line)."""
    out: list[Prompt] = []
    for key in sorted(topics):
        text = topics[key].strip()
        for i in range(PYDOC_CHUNKS_PER_TOPIC):
            chunk = text[i * PYDOC_CHUNK_CHARS : (i + 1) * PYDOC_CHUNK_CHARS]
            if len(chunk) >= 200:
                out.append(Prompt(chunk, "pydoc-text"))
        if getattr(tokenizer, "chat_template", None):
            title = text.splitlines()[0].strip() or key
            msg = f"Explain {title} in Python, with a short example."
            out.append(
                Prompt(
                    tokenizer.apply_chat_template(
                        [{"role": "user", "content": msg}],
                        tokenize=False,
                        add_generation_prompt=True,
                    ),
                    "pydoc-chat",
                )
            )
    return out


def general_prompts(tokenizer) -> list[Prompt]:
    """The default corpus (``corpus``): every general request, rendered as the model's chat
    template renders it, and every standard-library code prompt as raw text."""
    chat = [
        Prompt(render_chat(tokenizer, [{"role": "user", "content": r}]), "general-chat")
        for r in general_requests(10**6)
    ]
    return chat + [Prompt(c, "general-code") for c in stdlib_functions(10**6)]


def load_corpus(sources: str, tokenizer, tokenizer_path: str) -> list[Prompt]:
    """Prompts of a comma-separated ``sources`` list: ``general`` (``general_prompts``; disjoint
    from every benchmark set), ``humaneval``, ``chat`` (built-in chat set), ``pydoc`` (see
    ``pydoc_prompts``) or JSONL files (as ``prompts.load_prompts``).
    Duplicates are dropped; order is deterministic."""
    prompts: list[Prompt] = []
    for src in (s.strip() for s in sources.split(",")):
        if not src:
            continue
        if src == "pydoc":
            prompts += pydoc_prompts(tokenizer)
        elif src == "general":
            prompts += general_prompts(tokenizer)
        else:
            prompts += [
                Prompt(t, src if src in SOURCES else Path(src).name)
                for t in load_prompts(src, None, tokenizer_path)
            ]
    if not prompts:
        raise ValueError(f"no prompts in sources {sources!r}")
    return list({p.text: p for p in prompts}.values())


@dataclass
class TokenData:
    """Captured positions (see module doc). ``prompt[i]`` indexes the prompt a row came from."""

    hidden: dict[int, torch.Tensor]  # layer -> [N, d] float32
    topk_ids: torch.Tensor  # [N, k] int64
    topk_logits: torch.Tensor  # [N, k] float32
    lse: torch.Tensor  # [N, len(TEMPERATURES)] float32
    generated: torch.Tensor  # [N] bool
    prompt: torch.Tensor  # [N] int64

    def __len__(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def layers(self) -> list[int]:
        return sorted(self.hidden)

    def select(self, idx: torch.Tensor) -> TokenData:
        return TokenData(
            {l: h[idx] for l, h in self.hidden.items()},
            self.topk_ids[idx],
            self.topk_logits[idx],
            self.lse[idx],
            self.generated[idx],
            self.prompt[idx],
        )

    def earlier(self, layer: int, idx: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``hidden[layer]`` at the rows ``offsets`` positions before rows ``idx`` of the same
        prompt, zeros where the prompt has no such kept position. A prompt's rows are
        consecutive positions (``capture`` keeps every position from the second on, in
        order), so the row ``i - o`` is position ``t - o`` when it is the same prompt's."""
        back = idx - offsets
        ok = (back >= 0) & (self.prompt[back.clamp(min=0)] == self.prompt[idx])
        return self.hidden[layer][back.clamp(min=0)] * ok[:, None]

    @staticmethod
    def cat(parts: list[TokenData]) -> TokenData:
        if not parts:
            raise ValueError("no data to concatenate")
        return TokenData(
            {l: torch.cat([p.hidden[l] for p in parts]) for l in parts[0].hidden},
            *(
                torch.cat([getattr(p, f) for p in parts])
                for f in ("topk_ids", "topk_logits", "lse", "generated", "prompt")
            ),
        )

    def save(self, path: Path, seconds: float = 0.0) -> None:
        """One safetensors file; ``seconds`` (capture time) goes into its metadata."""
        tensors = {f"hidden.{l}": h.contiguous() for l, h in self.hidden.items()}
        tensors.update(
            topk_ids=self.topk_ids,
            topk_logits=self.topk_logits,
            lse=self.lse,
            generated=self.generated,
            prompt=self.prompt,
        )
        with staged_file(path) as tmp:  # atomic: a shard is either complete or absent
            save_file(tensors, str(tmp), metadata={"seconds": f"{seconds:.3f}"})

    @classmethod
    def load(cls, path: Path) -> TokenData:
        t = load_file(str(path))
        hidden = {int(k.split(".")[1]): v for k, v in t.items() if k.startswith("hidden.")}
        return cls(hidden, t["topk_ids"], t["topk_logits"], t["lse"], t["generated"], t["prompt"])


def _final_stats(logits: torch.Tensor, top_k: int):
    """Top-k (values, ids) and the log-normalisers at TEMPERATURES of [n, V] logits."""
    vals, ids = logits.topk(top_k, dim=-1)
    lse = torch.stack([torch.logsumexp(logits / t, dim=-1) for t in TEMPERATURES], dim=-1)
    return vals, ids, lse


@torch.no_grad()
def capture(
    model,
    prompts: list[list[int]],
    layers: list[int],
    max_new_tokens: int,
    top_k: int,
    eos_ids: set[int],
    prompt_index: list[int] | None = None,
) -> TokenData:
    """Greedy-generate from a batch of token-id prompts (left-padded, KV-cached) and return
    every kept position's exit-layer streams and final distribution (see module doc)."""
    if not 0 < top_k < model.config.vocab_size:
        raise ValueError(f"top_k must be in [1, vocab_size), got {top_k}")
    B, P = len(prompts), max(len(p) for p in prompts)
    pad = min(eos_ids) if eos_ids else 0
    ids = torch.full((B, P), pad, dtype=torch.long)
    mask = torch.zeros((B, P), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :] = torch.tensor(p)
        mask[b, P - len(p) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    lm_head = model.get_output_embeddings()
    cache = DynamicCache(config=model.config)

    hidden = {l: [] for l in layers}
    vals, tids, lses, keep, gen = [], [], [], [], []
    alive = torch.ones(B, dtype=torch.bool)
    for step in range(max_new_tokens):
        out = model.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        final = out.last_hidden_state  # [B, t, d] after the final norm
        if step == 0:  # prompt positions: real tokens except each row's first
            k = mask.bool() & (pos > 0)
            g = torch.zeros_like(k)
            g[:, -1] = True  # the last prompt token predicts the first generated one
        else:  # the token fed this step, in rows still generating
            k = alive[:, None].clone()
            g = k.clone()
        kept = final[k]
        v, i, s = _final_stats(
            torch.cat([lm_head(kept[j : j + 1024]) for j in range(0, max(len(kept), 1), 1024)]),
            top_k,
        )
        for l in layers:
            hidden[l].append(out.hidden_states[l][k])
        vals.append(v)
        tids.append(i)
        lses.append(s)
        gen.append(g[k])
        keep.append(k.nonzero()[:, 0])  # batch row of each kept position
        # greedy next token from the last position (exact float32 LM head)
        nxt = lm_head(final[:, -1]).argmax(-1)
        nxt = torch.where(alive, nxt, torch.full_like(nxt, pad))
        alive &= ~torch.isin(nxt, torch.tensor(sorted(eos_ids), dtype=torch.long))
        if not alive.any() or step == max_new_tokens - 1:
            break
        ids = nxt[:, None]
        pos = pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], dim=1)

    rows = torch.cat(keep)
    index = torch.tensor(prompt_index if prompt_index is not None else range(B))
    # order by (row, time): stable sort keeps the time order inside a row
    order = torch.sort(rows, stable=True).indices
    return TokenData(
        {l: torch.cat(h)[order] for l, h in hidden.items()},
        torch.cat(tids)[order],
        torch.cat(vals)[order],
        torch.cat(lses)[order],
        torch.cat(gen)[order],
        index[rows][order],
    )


def eos_ids(model, tokenizer) -> set[int]:
    """End-of-sequence ids: the tokenizer's and the generation config's."""
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    gen = [gen] if isinstance(gen, int) else list(gen or [])
    return {e for e in [tokenizer.eos_token_id, *gen] if e is not None}


def plan_batches(
    lengths: list[int], batch_tokens: int, max_batch: int, max_new_tokens: int
) -> list[list[int]]:
    """Group prompt indices by length (less padding) into batches of at most ``max_batch``
    prompts and ``batch_tokens`` (prompt + generated) tokens. Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = lengths[i] + max_new_tokens
        if cur and (len(cur) >= max_batch or (len(cur) + 1) * width > batch_tokens):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


@dataclass(frozen=True)
class CollectSpec:
    """Everything that determines the collected data (its hash names the data directory)."""

    fingerprint: str
    layers: tuple[int, ...]
    sources: str
    max_prompts: int | None  # over train/fit/val, shared 6:1:1, after a seeded shuffle
    max_prompt_tokens: int
    max_new_tokens: int
    top_k: int
    seed: int

    def key(self) -> str:
        return digest(json.dumps(self.__dict__, sort_keys=True, default=list))


def tokenize(tokenizer, texts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    """Token ids as vLLM would see the prompt text, keeping the last ``max_prompt_tokens``."""
    return [tokenizer(t).input_ids[-max_prompt_tokens:] for t in texts]


def choose_prompts(
    prompts: list[Prompt], split: str, max_prompts: int | None, seed: int
) -> list[Prompt]:
    """The prompts of one split, seeded-shuffled and capped (so a cap mixes every source).
    ``max_prompts`` counts the three training splits together; each gets its bucket share."""
    mine = [p for p in prompts if p.split == split]
    g = torch.Generator().manual_seed(seed)
    mine = [mine[i] for i in torch.randperm(len(mine), generator=g).tolist()]
    if max_prompts is None:
        return mine
    share = len(SPLIT_BUCKETS[split]) / sum(len(SPLIT_BUCKETS[s]) for s in TRAINING_SPLITS)
    return mine[: max(1, round(max_prompts * share))]


def collect(
    model,
    tokenizer,
    prompts: list[Prompt],
    splits: tuple[str, ...],
    spec: CollectSpec,
    data_dir: Path,
    batch_tokens: int = 8192,
    max_batch: int = 32,
    progress: bool = True,
) -> dict[str, TokenData]:
    """Capture the data of ``splits`` into ``data_dir`` (one safetensors shard per batch) and
    return it. Resumable: finished shards are kept and skipped on the next call."""
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "spec.json").write_text(json.dumps(spec.__dict__, indent=1, default=list))
    eos = eos_ids(model, tokenizer)
    jobs = []
    for split in splits:
        chosen = choose_prompts(prompts, split, spec.max_prompts, spec.seed)
        if not chosen:
            raise ValueError(
                f"no prompt of the {len(prompts)} given falls into the {split!r} "
                f"split (about 1 in 10 prompts does); use more prompts"
            )
        (data_dir / f"{split}-prompts.json").write_text(
            json.dumps([{"digest": digest(p.text), "source": p.source} for p in chosen], indent=0)
        )
        ids = tokenize(tokenizer, [p.text for p in chosen], spec.max_prompt_tokens)
        for n, batch in enumerate(
            plan_batches([len(i) for i in ids], batch_tokens, max_batch, spec.max_new_tokens)
        ):
            jobs.append((data_dir / f"{split}-{n:05d}.safetensors", [ids[i] for i in batch], batch))
    todo = [j for j in jobs if not j[0].is_file()]
    bar = tqdm(
        total=len(jobs),
        initial=len(jobs) - len(todo),
        desc="collect",
        unit="batch",
        disable=not progress,
    )
    for path, batch_ids, index in todo:
        t0 = time.perf_counter()
        part = capture(
            model, batch_ids, list(spec.layers), spec.max_new_tokens, spec.top_k, eos, index
        )
        part.save(path, seconds=time.perf_counter() - t0)
        bar.update()
    bar.close()
    return {
        s: TokenData.cat([TokenData.load(p) for p, _, _ in jobs if p.name.startswith(s + "-")])
        for s in splits
    }

"""Exit-head quality: top-1 agreement with the final layer, the confidence estimator's
precision/recall at its threshold, and a feature head's precision/coverage by its confidence.
Every number here uses the exact float32 read-out."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..checkpoints import resolve_model
from .data import TokenData, capture, digest, eos_ids, load_corpus, plan_batches, tokenize
from .identity import identity_from_hf
from .io import load_heads, read_config, train_prompt_digests
from .modules import Readout

CHUNK = 1024


@torch.no_grad()
def top1(readout: Readout, x: torch.Tensor, head: nn.Module | None = None) -> torch.Tensor:
    """Greedy token of ``lm_head(final_norm(head.transform(x)))`` (``head=None``: raw LM head)."""
    out = []
    for i in range(0, x.shape[0], CHUNK):
        h = x[i : i + CHUNK]
        out.append(readout.logits(head.transform(h) if head is not None else h).argmax(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def head_input(head: nn.Module, data: TokenData, layer: int, idx: torch.Tensor, offsets=None):
    """``head.transform`` on rows ``idx`` of ``data`` at exit ``layer``; a feature head also
    reads the final layer's output ``offsets`` positions back (``data`` holds the final layer
    as its deepest stream)."""
    x = data.hidden[layer][idx]
    if getattr(head, "kind", None) != "feature":
        return head.transform(x)
    return head.transform(x, data.earlier(max(data.hidden), idx, offsets), offsets)


@torch.no_grad()
def feature_top1(
    readout: Readout, head: nn.Module, data: TokenData, layer: int, rows: torch.Tensor, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A feature head's greedy token at ``rows``, reading the final layer ``offset`` back, and
    its probability (the head's confidence, which ``gated`` scores)."""
    tokens, probs = [], []
    for i in range(0, len(rows), CHUNK):
        idx = rows[i : i + CHUNK]
        o = torch.full_like(idx, offset)
        p, t = torch.softmax(readout.logits(head_input(head, data, layer, idx, o)), -1).max(-1)
        tokens.append(t)
        probs.append(p)
    if not tokens:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0)
    return torch.cat(tokens), torch.cat(probs)


#: the confidence floors ``eval-heads`` reports a feature head's precision and coverage at
GATES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.7)


def gated(correct: torch.Tensor, conf: torch.Tensor) -> list[dict[str, float | None]]:
    """Per floor of ``GATES``: the share of positions whose confidence clears it (coverage), the
    agreement among them (precision) and the share of all agreeing positions they keep."""
    out = []
    for floor in GATES:
        keep = conf >= floor
        precision, recall = precision_recall(keep, correct)
        out.append(
            {
                "min_confidence": floor,
                "coverage": float(keep.float().mean()) if len(keep) else None,
                "precision": precision,
                "kept_agreement": recall,
            }
        )
    return out


@torch.no_grad()
def confidence(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([head.confidence(x[i : i + CHUNK]) for i in range(0, x.shape[0], CHUNK)])


def precision_recall(
    exit_: torch.Tensor, correct: torch.Tensor
) -> tuple[float | None, float | None]:
    """Precision = P(correct | exit); recall = P(exit | correct). None when undefined."""
    tp = int((exit_ & correct).sum())
    n_exit, n_correct = int(exit_.sum()), int(correct.sum())
    return (tp / n_exit if n_exit else None), (tp / n_correct if n_correct else None)


def select_threshold(scores: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """The threshold maximising F1 of the rule ``score >= threshold`` -> positive.

    Candidate cuts sit between distinct scores (ties are never split). With no positive label
    the F1 is 0 everywhere and the threshold is 1.01 (above any probability: never exit)."""
    order = torch.argsort(scores, descending=True, stable=True)
    s, y = scores[order].double(), labels[order].double()
    n_pos = float(y.sum())
    if n_pos == 0 or len(s) == 0:
        return {"threshold": 1.01, "f1": 0.0, "precision": 0.0, "recall": 0.0}
    tp = y.cumsum(0)
    k = torch.arange(1, len(s) + 1, dtype=torch.float64)
    f1 = 2 * tp / (k + n_pos)
    last_of_tie = torch.ones(len(s), dtype=torch.bool)
    last_of_tie[:-1] = s[:-1] != s[1:]
    best = int(torch.where(last_of_tie, f1, torch.full_like(f1, -1.0)).argmax())
    return {
        "threshold": float(s[best]),
        "f1": float(f1[best]),
        "precision": float(tp[best] / k[best]),
        "recall": float(tp[best] / n_pos),
    }


def agreement(
    heads: dict[int, nn.Module], readout: Readout, data: TokenData, generated_only: bool = True
) -> dict[str, dict[str, Any]]:
    """Per exit layer: ``raw_top1`` (raw LM head on the layer's stream) and ``head_top1``
    (through the head) agreement with the final top-1; for heads with a confidence estimator
    also its ``precision``/``recall`` at ``head.threshold`` and the ``exit_rate`` (else None).
    Feature heads: ``head_top1`` reads the final layer one position back (a round's first
    draft token), ``head_top1_by_offset[j - 1]`` j positions back (its j-th, the tokens before
    it right), and ``gated``: by the first draft's probability, its precision and coverage at
    each floor of ``GATES``. ``generated_only``: score only positions predicting generated
    tokens (what a drafter sees)."""
    rows = data.generated.nonzero()[:, 0] if generated_only else torch.arange(len(data))
    final = data.topk_ids[rows, 0]
    table: dict[str, dict[str, Any]] = {}
    for layer, head in heads.items():
        x = data.hidden[layer][rows]
        by_offset = conf = None
        if getattr(head, "kind", None) == "feature":
            by_offset = []
            for o in range(1, head.max_offset + 1):
                tokens, c = feature_top1(readout, head, data, layer, rows, o)
                by_offset.append(tokens == final)
                if o == 1:  # ``gated`` scores a round's first draft
                    conf = c
            correct = by_offset[0]
        else:
            correct = top1(readout, x, head) == final
        row: dict[str, Any] = {
            "raw_top1": float((top1(readout, x) == final).float().mean()) if len(x) else None,
            "head_top1": float(correct.float().mean()) if len(x) else None,
            "precision": None,
            "recall": None,
            "exit_rate": None,
            "tokens": len(x),
        }
        if by_offset is not None:
            row["head_top1_by_offset"] = [
                float(c.float().mean()) if len(x) else None for c in by_offset
            ]
            row["gated"] = gated(correct, conf)  # a round's first draft, by its confidence
        if hasattr(head, "confidence"):
            exit_ = confidence(head, x) >= head.threshold
            row["precision"], row["recall"] = precision_recall(exit_, correct)
            row["exit_rate"] = float(exit_.float().mean()) if len(x) else None
        table[str(layer)] = row
    return table


def evaluate_heads(
    heads_dir: str,
    prompts: str,
    model: str | None = None,
    num_prompts: int | None = None,
    max_new_tokens: int = 96,
    max_prompt_tokens: int = 384,
    progress: bool = True,
) -> dict[str, Any]:
    """``eval-heads``: greedy-generate with the base model on ``prompts`` (same sources as
    training), skipping every prompt training used, and return ``{"layers": agreement(...),
    ...}`` on the generated positions. ``model`` defaults to the path recorded at training
    (or the embedded model); it must match the heads' identity."""
    t0 = time.perf_counter()
    if model is None:
        recorded = read_config(heads_dir).get("training", {}).get("model_path")
        model = recorded if recorded and Path(recorded).is_dir() else None
    model_path = resolve_model(model)
    tok = AutoTokenizer.from_pretrained(model_path)
    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    lm.requires_grad_(False)
    heads = load_heads(heads_dir, expect=identity_from_hf(lm))
    used = train_prompt_digests(heads_dir)
    corpus = load_corpus(prompts, tok, model_path)
    fresh = [p for p in corpus if digest(p.text) not in used]
    held_out = fresh[:num_prompts]
    if not held_out:
        raise ValueError(f"every prompt of {prompts!r} was used in training; nothing held out")
    ids = tokenize(tok, [p.text for p in held_out], max_prompt_tokens)
    eos = eos_ids(lm, tok)
    # feature heads read the final layer's output too
    final = [heads.identity.num_layers] if heads.kind == "feature" else []
    streams = heads.layers + final
    parts = []
    for batch in tqdm(
        plan_batches([len(i) for i in ids], 8192, 32, max_new_tokens),
        desc="eval-heads",
        unit="batch",
        disable=not progress,
    ):
        parts.append(capture(lm, [ids[i] for i in batch], streams, max_new_tokens, 1, eos, batch))
    data = TokenData.cat(parts)
    table = agreement(dict(heads.items()), Readout(lm), data)
    return {
        "heads": str(heads_dir),
        "kind": heads.kind,
        "model": model_path,
        "prompts": prompts,
        "num_prompts": len(held_out),
        "skipped_training_prompts": len(corpus) - len(fresh),
        "positions": "generated",
        "tokens": int(data.generated.sum()),
        "max_new_tokens": max_new_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "layers": table,
    }

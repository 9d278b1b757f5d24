"""``train-heads``: self-distil exit heads for a base model.

1. collect (``data.collect``): greedy generations of the model on the prompt corpus, with the
   exit layers' residual streams and the final distribution (top-k + log-normaliser);
2. fit the transforms on the ``train`` split, all layers on the same token batches
   (AdaDecode: KL(final ‖ head); Cascade and Feature: α·CE + (1−α)·T²·KL at T = 2; a feature
   head's rows each read the final layer 1..max_offset positions back, ``feature_offsets``);
3. Cascade only: per layer a confidence estimator trained on the ``fit`` split (labels: the
   trained exit's exact top-1 equals the final top-1; not the ``train`` split, where the adapter's
   agreement is optimistic), its threshold chosen by F1 on ``val``;
4. held-out metrics on ``val``, then an atomic write of the head directory (``io.save_heads``).

Deterministic for a seed (batches are a pure function of (seed, step)); resumable: data shards
and a training checkpoint every ``checkpoint_every`` steps survive an interruption, and a
re-run continues where it stopped with the same result.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..cachedir import locked, staged_file
from ..checkpoints import home, resolve_model
from .data import TRAINING_SPLITS, CollectSpec, TokenData, collect, load_corpus
from .evaluate import agreement, head_input, select_threshold, top1
from .identity import identity_from_hf
from .io import HeadSet, min_exit_layer, save_heads
from .losses import adadecode_loss, cascade_loss
from .modules import FEATURE_MAX_OFFSET, KINDS, Readout, make_head


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a training run (recorded in the head directory's metadata)."""

    kind: str
    layers: tuple[int, ...]
    # data
    sources: str = "general"  # heads/corpus.py: disjoint from every benchmark prompt set
    max_prompts: int | None = 128  # over train/fit/val (6:1:1); None: every prompt
    max_new_tokens: int = 96
    max_prompt_tokens: int = 384
    top_k: int = 64
    # transforms
    steps: int = 160
    batch_size: int = 256
    lr: float | None = None  # None: 3e-3 adadecode, 1e-3 cascade (docs/heads.md, "Training")
    weight_decay: float | None = None  # None: 0 for adadecode (T starts at I), 0.01 for cascade
    warmup: float = 0.05
    grad_clip: float = 1.0
    alpha: float = 0.5  # cascade CE weight
    temperature: float = 2.0  # cascade distillation temperature
    bottleneck: int | None = None  # cascade, feature; None: min(512, d)
    max_offset: int = FEATURE_MAX_OFFSET  # feature: draft positions trained for (offsets 1..)
    # confidence estimators (cascade)
    est_steps: int = 60  # ~8 epochs of the embedded fit split; more overfit (docs/heads.md)
    est_batch_size: int = 512
    est_lr: float = 1e-3
    seed: int = 0
    checkpoint_every: int = 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(sorted(set(int(l) for l in self.layers))))
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}; expected one of {KINDS}")
        if not self.layers:
            raise ValueError("no exit layers given")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        if self.max_offset < 1:
            raise ValueError("max_offset must be >= 1")


def lr_factor(step: int, total: int, warmup: float) -> float:
    """Linear warm-up over the first ``warmup`` fraction, then cosine decay to 0."""
    w = max(1, round(warmup * total))
    if step < w:
        return (step + 1) / w
    return 0.5 * (1 + math.cos(math.pi * (step - w) / max(1, total - w)))


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> torch.Tensor:
    """Rows of batch ``step``: epoch-wise seeded permutations, a pure function of its inputs
    (what makes a resumed run identical to an uninterrupted one)."""
    per_epoch = max(1, n // batch_size)
    epoch, j = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return perm[j * batch_size : (j + 1) * batch_size]


def feature_offsets(n: int, max_offset: int, step: int, seed: int) -> torch.Tensor:
    """Feature heads: the offset (1..max_offset) each of a step's ``n`` rows trains at, a pure
    function of (seed, step) as the rows are (resumed runs repeat it)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + 7)
    return torch.randint(1, max_offset + 1, (n,), generator=g)


def transform_parameters(head: nn.Module) -> list[nn.Parameter]:
    """What stage 2 trains: everything but a confidence estimator."""
    return [p for n, p in head.named_parameters() if not n.startswith("estimator.")]


def _atomic_torch_save(obj: Any, path: Path) -> None:
    with staged_file(path) as tmp:
        torch.save(obj, tmp)


def fit_transforms(
    heads: dict[int, nn.Module],
    readout: Readout,
    data: TokenData,
    cfg: TrainConfig,
    state_path: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train every head's transform on ``data`` (in place) for ``cfg.steps`` steps; returns
    ``{"loss": {layer: [per-step loss]}, "seconds": ...}``. With ``state_path`` a checkpoint is
    written every ``cfg.checkpoint_every`` steps and resumed from if present."""
    loss_fn: Callable = (
        adadecode_loss
        if cfg.kind == "adadecode"
        else (lambda z, i, v, s: cascade_loss(z, i, v, s, cfg.alpha, cfg.temperature))
    )
    ada = cfg.kind == "adadecode"
    wd = cfg.weight_decay if cfg.weight_decay is not None else (0.0 if ada else 0.01)
    lr = cfg.lr if cfg.lr is not None else (3e-3 if ada else 1e-3)
    groups = {l: transform_parameters(h) for l, h in heads.items()}
    opt = torch.optim.AdamW(
        [p for ps in groups.values() for p in ps], lr=lr, weight_decay=wd, betas=(0.9, 0.95)
    )
    history: dict[str, list[float]] = {str(l): [] for l in heads}
    step, seconds = 0, 0.0
    if state_path is not None and state_path.is_file():
        try:  # tensors and plain containers only: a checkpoint runs no code
            state = torch.load(state_path, weights_only=True)
        except pickle.UnpicklingError as e:
            raise RuntimeError(
                f"refusing to resume from {state_path}: it holds more than tensors and plain "
                f"values ({str(e).splitlines()[0]}); delete it to train from the start"
            ) from e
        for l, h in heads.items():
            h.load_state_dict(state["heads"][l])
        opt.load_state_dict(state["optimizer"])
        step, seconds, history = state["step"], state["seconds"], state["history"]

    def checkpoint() -> None:
        if state_path is not None:
            _atomic_torch_save(
                {
                    "step": step,
                    "seconds": seconds,
                    "history": history,
                    "heads": {l: h.state_dict() for l, h in heads.items()},
                    "optimizer": opt.state_dict(),
                },
                state_path,
            )

    bar = tqdm(
        total=cfg.steps, initial=step, desc=f"train {cfg.kind}", unit="step", disable=not progress
    )
    while step < cfg.steps:
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr * lr_factor(step, cfg.steps, cfg.warmup)
        idx = batch_indices(len(data), cfg.batch_size, step, cfg.seed)
        ids, vals, lse = data.topk_ids[idx], data.topk_logits[idx], data.lse[idx]
        offsets = feature_offsets(len(idx), cfg.max_offset, step, cfg.seed)
        opt.zero_grad(set_to_none=True)
        for l, head in heads.items():  # one layer's graph at a time keeps memory flat
            z = readout.logits(head_input(head, data, l, idx, offsets), fast=True)
            loss = loss_fn(z, ids, vals, lse)
            loss.backward()
            history[str(l)].append(round(loss.item(), 5))
            if cfg.grad_clip:
                nn.utils.clip_grad_norm_(groups[l], cfg.grad_clip)
        opt.step()
        step += 1
        seconds += time.perf_counter() - t0
        bar.update()
        bar.set_postfix(loss=f"{sum(v[-1] for v in history.values()) / len(heads):.3f}")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            checkpoint()
    bar.close()
    return {"loss": history, "seconds": round(seconds, 1)}


def fit_estimators(
    heads: dict[int, nn.Module],
    readout: Readout,
    fit: TokenData,
    val: TokenData,
    cfg: TrainConfig,
    progress: bool = True,
) -> dict[str, Any]:
    """Cascade stage 3 (see module doc): train each head's confidence estimator on ``fit`` and
    set ``head.threshold`` by F1 on ``val``. Returns per-layer positives rate and F1 stats."""
    report: dict[str, Any] = {}
    for l, head in tqdm(
        heads.items(), desc="confidence estimators", unit="layer", disable=not progress
    ):
        x, y = fit.hidden[l], (top1(readout, fit.hidden[l], head) == fit.topk_ids[:, 0]).float()
        head.fit_feature_stats(x)
        params = list(head.estimator.parameters())
        opt = torch.optim.AdamW(params, lr=cfg.est_lr, weight_decay=0.01)
        loss_fn = nn.BCEWithLogitsLoss()
        for step in range(cfg.est_steps):
            for g in opt.param_groups:
                g["lr"] = cfg.est_lr * lr_factor(step, cfg.est_steps, cfg.warmup)
            idx = batch_indices(len(x), cfg.est_batch_size, step, cfg.seed + l)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(head.confidence_logit(x[idx]), y[idx])
            loss.backward()
            opt.step()
        with torch.no_grad():
            scores = head.confidence(val.hidden[l])
        val_correct = top1(readout, val.hidden[l], head) == val.topk_ids[:, 0]
        choice = select_threshold(scores, val_correct)
        head.threshold = choice["threshold"]
        report[str(l)] = {
            "fit_positive_rate": round(float(y.mean()), 4),
            "final_bce": round(loss.item(), 4),
            **{k: round(v, 4) for k, v in choice.items()},
        }
    return report


def _corpus_digests(data_dir: Path, splits) -> list[str]:
    return sorted(
        {
            p["digest"]
            for s in splits
            for p in json.loads((data_dir / f"{s}-prompts.json").read_text())
        }
    )


def train_heads(
    model: str | None,
    cfg: TrainConfig,
    out: str | Path,
    data_dir: str | Path | None = None,
    progress: bool = True,
) -> Path:
    """The whole ``train-heads`` run (see module doc); returns the head directory ``out``.

    ``data_dir``: where collected shards live (default ``$VLLM_SELFSPEC_HOME/heads/data/<key>``,
    keyed by everything that determines the data, so a second kind on the same layers reuses
    it). Training checkpoints go to ``<out's parent>/.<out name>.work/`` (removed when done)."""
    t_start = time.perf_counter()
    out = Path(out)
    model_path = resolve_model(model)
    tok = AutoTokenizer.from_pretrained(model_path)
    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    lm.requires_grad_(False)
    identity = identity_from_hf(lm)
    lowest = min_exit_layer(cfg.kind)
    bad = [l for l in cfg.layers if not lowest <= l < identity.num_layers]
    if bad:
        raise ValueError(
            f"exit layers must be in [{lowest}, {identity.num_layers - 1}] for this "
            f"{identity.num_layers}-layer model, got {bad}"
        )
    # feature heads read the final layer's output too: the deepest stream collected
    streams = cfg.layers + ((identity.num_layers,) if cfg.kind == "feature" else ())

    spec = CollectSpec(
        identity.fingerprint,
        streams,
        cfg.sources,
        cfg.max_prompts,
        cfg.max_prompt_tokens,
        cfg.max_new_tokens,
        cfg.top_k,
        cfg.seed,
    )
    data_dir = Path(data_dir) if data_dir else home() / "heads" / "data" / spec.key()
    corpus = load_corpus(cfg.sources, tok, model_path)
    data = collect(lm, tok, corpus, TRAINING_SPLITS, spec, data_dir, progress=progress)

    work = out.parent / f".{out.name}.work"
    # one train-heads run of ``out`` at a time: a second waits here (its checkpoints would
    # interleave with the first's in the same work dir)
    with locked(work):
        work.mkdir(parents=True, exist_ok=True)
        run_key = json.dumps(
            {"cfg": asdict(cfg), "data": str(data_dir), "id": identity.to_dict()},
            sort_keys=True,
            default=list,
        )
        if (work / "run.json").is_file() and (work / "run.json").read_text() != run_key:
            shutil.rmtree(work)  # a checkpoint of a different run: start over
            work.mkdir(parents=True)
        (work / "run.json").write_text(run_key)

        torch.manual_seed(cfg.seed)
        heads = {
            l: make_head(cfg.kind, identity.hidden_size, cfg.bottleneck, cfg.max_offset)
            for l in cfg.layers
        }
        readout = Readout(lm)
        fit = fit_transforms(heads, readout, data["train"], cfg, work / "state.pt", progress)
        for h in heads.values():
            for p in transform_parameters(h):
                p.requires_grad_(False)
        est = None
        t_est = time.perf_counter()
        if cfg.kind == "cascade":
            est = fit_estimators(heads, readout, data["fit"], data["val"], cfg, progress)
        t_est = time.perf_counter() - t_est
        for h in heads.values():
            h.eval().requires_grad_(False)

        tokens = {
            s: {"positions": len(d), "generated": int(d.generated.sum())} for s, d in data.items()
        }
        metadata = {
            "model_path": model_path,
            "config": asdict(cfg),
            "data_dir": str(data_dir),
            "tokens": tokens,
            "collect_seconds": round(sum(_shard_seconds(data_dir)), 1),
            "train_seconds": fit["seconds"],
            "estimator_seconds": round(t_est, 1) if est is not None else None,
            "final_loss": {l: v[-1] for l, v in fit["loss"].items()},
            "first_loss": {l: v[0] for l, v in fit["loss"].items()},
            "estimators": est,
            "val": agreement(heads, readout, data["val"]),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "wall_seconds_this_run": round(time.perf_counter() - t_start, 1),
        }
        save_heads(
            out,
            HeadSet(cfg.kind, heads, identity),
            metadata,
            _corpus_digests(data_dir, TRAINING_SPLITS),
        )
        shutil.rmtree(work, ignore_errors=True)
        return out


def _shard_seconds(data_dir: Path) -> list[float]:
    """Capture time recorded in each shard (sums correctly over resumed/cached collections)."""
    secs = []
    for p in sorted(data_dir.glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            secs.append(float((f.metadata() or {}).get("seconds", 0.0)))
    return secs

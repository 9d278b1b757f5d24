"""On-disk format of a head set (documented in docs/heads.md) and its loader.

DIR/config.json         format, kind, layers, base-model identity, head sizes,
                        thresholds (cascade), training metadata
DIR/heads.safetensors   "<layer>.<parameter>" float32 tensors, e.g. "8.T", "8.gate.weight"
DIR/train_prompts.json  digests of every prompt training touched (eval-heads skips them)
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..cachedir import file_sha256, reading, staged
from .identity import CONFIG_FILE, ModelIdentity, read_saved_config
from .modules import KINDS, make_head

FORMAT = "vllm-selfspec-heads"
VERSION = 1
WEIGHTS_FILE = "heads.safetensors"
PROMPTS_FILE = "train_prompts.json"


class HeadsFormatError(ValueError):
    """A head directory is missing files or does not follow the format."""


class HeadSet(Mapping):
    """Exit layer -> head module (``transform``; cascade: ``confidence``, ``threshold``),
    plus the kind, the base model's identity and the full config (``config["training"]`` holds
    the training metadata)."""

    def __init__(
        self,
        kind: str,
        heads: dict[int, nn.Module],
        identity: ModelIdentity,
        config: dict[str, Any] | None = None,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown head kind {kind!r}; expected one of {KINDS}")
        self.kind = kind
        self.heads = dict(sorted(heads.items()))
        self.identity = identity
        self.config = config or {}

    def __getitem__(self, layer: int) -> nn.Module:
        return self.heads[layer]

    def __iter__(self) -> Iterator[int]:
        return iter(self.heads)

    def __len__(self) -> int:
        return len(self.heads)

    @property
    def layers(self) -> list[int]:
        return list(self.heads)

    @property
    def metadata(self) -> dict[str, Any]:
        return self.config.get("training", {})

    @property
    def thresholds(self) -> dict[int, float] | None:
        if self.kind != "cascade":
            return None
        return {l: float(h.threshold) for l, h in self.heads.items()}

    def to(self, *args, **kwargs) -> HeadSet:
        """Move/cast every head in place (e.g. ``.to("cuda", torch.bfloat16)``); returns self."""
        for h in self.heads.values():
            h.to(*args, **kwargs)
        return self


def head_config(
    kind: str, hidden_size: int, bottleneck: int | None, max_offset: int | None = None
) -> dict[str, Any]:
    """The ``head`` section of config.json: what is needed to rebuild the modules."""
    if kind == "adadecode":
        return {"transform": "x @ T", "T_shape": [hidden_size, hidden_size]}
    b = bottleneck or min(512, hidden_size)
    if kind == "feature":
        return {
            "transform": "x + up(silu(gate(u)) * down(u)), u = [rmsnorm(x); f] + offset[o]",
            "f": "the final layer's normed output at position t - o",
            "bottleneck": b,
            "max_offset": max_offset,
        }
    return {
        "transform": "x + up(silu(gate(x)) * down(x))",
        "bottleneck": b,
        "confidence": "sigmoid(mlp((rmsnorm(x) - feature_mean) / feature_std))",
        "estimator_hidden": 256,
    }


def save_heads(
    out: str | Path,
    heads: HeadSet,
    training: dict[str, Any] | None = None,
    train_prompt_digests: list[str] | None = None,
) -> Path:
    """Write ``heads`` to ``out`` atomically (``cachedir.staged``), with the weights' SHA-256 in
    config.json; return ``out``."""

    out = Path(out)
    first = next(iter(heads.values()))
    bottleneck = first.up.weight.shape[1] if heads.kind in ("cascade", "feature") else None
    max_offset = first.max_offset if heads.kind == "feature" else None
    config = {
        "format": FORMAT,
        "version": VERSION,
        "kind": heads.kind,
        "layers": heads.layers,
        "base_model": heads.identity.to_dict(),
        "head": head_config(heads.kind, heads.identity.hidden_size, bottleneck, max_offset),
        "thresholds": (
            {str(l): t for l, t in heads.thresholds.items()} if heads.kind == "cascade" else None
        ),
        "training": training if training is not None else heads.metadata,
    }
    tensors = {
        f"{l}.{k}": v.detach().to("cpu", torch.float32).contiguous()
        for l, h in heads.items()
        for k, v in h.state_dict().items()
    }
    with staged(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
        config["weights_sha256"] = file_sha256(tmp / WEIGHTS_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / PROMPTS_FILE).write_text(
            json.dumps(
                {"digest": "sha256(prompt text)[:16]", "prompts": train_prompt_digests or []}
            )
            + "\n"
        )
    heads.config = config
    return out


def _read_weights(path: Path, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights of a head directory, checked against config.json's SHA-256 (when it has one)
    and for non-finite values: a damaged file is refused at load, with its name, before it can
    draft."""
    f = path / WEIGHTS_FILE
    if not f.is_file():
        raise HeadsFormatError(f"{f}: missing")
    want = config.get("weights_sha256")
    if want is not None and file_sha256(f) != want:
        raise HeadsFormatError(
            f"{f}: its SHA-256 is not the one config.json records (a damaged or replaced file)"
        )
    try:
        tensors = load_file(str(f))
    except Exception as e:  # safetensors raises its own error types for a truncated file
        raise HeadsFormatError(f"{f}: unreadable ({e})") from e
    bad = sorted(k for k, v in tensors.items() if not bool(torch.isfinite(v).all()))
    if bad:
        raise HeadsFormatError(f"{f}: non-finite values (NaN or inf) in {', '.join(bad)}")
    return tensors


def min_exit_layer(kind: str) -> int:
    """The shallowest exit a kind may have: 0 (the embeddings) for feature heads, which read
    the final layer too; 1 for the others."""
    return 0 if kind == "feature" else 1


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of a head directory, checked for format, version and the keys the loader
    reads."""
    config = read_saved_config(path, "head", FORMAT, VERSION, HeadsFormatError)
    required = {"kind": str, "layers": list, "base_model": dict, "head": dict}
    if config.get("kind") == "cascade":
        required["thresholds"] = dict
    for key, typ in required.items():
        if not isinstance(config.get(key), typ):
            raise HeadsFormatError(
                f"{Path(path) / CONFIG_FILE}: {key!r} must be a JSON {typ.__name__}, "
                f"got {config.get(key)!r}"
            )
    return config


def train_prompt_digests(path: str | Path) -> set[str]:
    f = Path(path) / PROMPTS_FILE
    return set(json.loads(f.read_text())["prompts"]) if f.is_file() else set()


def load_heads(path: str | Path, *, expect: ModelIdentity | None) -> HeadSet:
    """Load a head directory. ``expect`` is the identity of the model the heads will run on
    (``identity_from_hf`` / ``identity_from_tensors``); a mismatch raises
    ``HeadsMismatchError``. Pass ``expect=None`` only to inspect heads without a model."""

    with reading(path):  # config and weights of one version, whichever a writer publishes
        return _load_heads(Path(path), expect)


def _load_heads(path: Path, expect: ModelIdentity | None) -> HeadSet:
    path = Path(path)
    config = read_config(path)
    identity = ModelIdentity.from_dict(config["base_model"])
    if expect is not None:
        identity.check(expect, what=f"heads in {path}")
    kind, layers = config["kind"], config["layers"]
    if not all(isinstance(l, int) and not isinstance(l, bool) for l in layers):
        raise HeadsFormatError(f"{path / CONFIG_FILE}: layers must be integers, got {layers}")
    if kind == "cascade" and any(str(l) not in config["thresholds"] for l in layers):
        raise HeadsFormatError(f"{path / CONFIG_FILE}: thresholds must name every layer {layers}")
    if kind not in KINDS:
        raise HeadsFormatError(f"{path}: unknown kind {kind!r}; expected one of {KINDS}")
    lowest = min_exit_layer(kind)
    bad = [l for l in layers if not lowest <= l < identity.num_layers]
    if bad or not layers:
        raise HeadsFormatError(
            f"{path}: exit layers must be in [{lowest}, {identity.num_layers - 1}], got {layers}"
        )
    tensors = _read_weights(path, config)
    heads: dict[int, nn.Module] = {}
    for l in layers:
        head = make_head(
            kind,
            identity.hidden_size,
            config["head"].get("bottleneck"),
            config["head"].get("max_offset"),
        )
        state = {k[len(f"{l}.") :]: v for k, v in tensors.items() if k.startswith(f"{l}.")}
        want = head.state_dict()
        problems = [f"missing {k}" for k in want if k not in state]
        problems += [f"unexpected {k}" for k in state if k not in want]
        problems += [
            f"{k} has shape {tuple(state[k].shape)}, expected {tuple(v.shape)}"
            for k, v in want.items()
            if k in state and state[k].shape != v.shape
        ]
        if problems:
            raise HeadsFormatError(f"{path / WEIGHTS_FILE}: layer {l}: " + "; ".join(problems))
        head.load_state_dict(state)
        if kind == "cascade":
            head.threshold = float(config["thresholds"][str(l)])
        heads[l] = head.eval().requires_grad_(False)
    extra = sorted({k.split(".")[0] for k in tensors} - {str(l) for l in layers})
    if extra:
        raise HeadsFormatError(
            f"{path / WEIGHTS_FILE} has tensors for layers {extra} that config.json does not list"
        )
    return HeadSet(kind, heads, identity, config)

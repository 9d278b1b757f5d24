"""Which base model a set of exit heads belongs to.

Heads are trained against one model's frozen final norm and LM head; loaded onto another model
they silently produce garbage. So every head set (and every draft vocabulary, ``vocab.py``)
records a ``ModelIdentity`` in its config.json (``read_saved_config``) and the loader refuses a
mismatch.

The fingerprint hashes a few deterministic slices of weights every engine has cheaply at hand:

* the embedding rows ``0 .. FINGERPRINT_ROWS-1`` (a vocab-parallel embedding keeps them on
  tensor-parallel rank 0, whatever the TP size), every 7th column;
* the whole final-norm weight (replicated on every rank).

Values are rounded to bfloat16 before hashing, so a float32 checkpoint matches itself loaded as
float32 or bfloat16 (float16-loaded weights are rounded twice and may not match).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

FINGERPRINT_ROWS = 64
FINGERPRINT_COL_STRIDE = 7
#: the config file of every directory saved for a base model (head sets, draft vocabularies)
CONFIG_FILE = "config.json"


class HeadsMismatchError(ValueError):
    """Heads were trained for a different base model than the one they are loaded for."""


@dataclass(frozen=True)
class ModelIdentity:
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    fingerprint: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelIdentity:
        return cls(
            architecture=str(d["architecture"]),
            num_layers=int(d["num_layers"]),
            hidden_size=int(d["hidden_size"]),
            vocab_size=int(d["vocab_size"]),
            fingerprint=str(d["fingerprint"]),
        )

    def check(self, expect: ModelIdentity, what: str = "heads") -> None:
        """Raise ``HeadsMismatchError`` naming every field where ``self`` (what the heads were
        trained for) differs from ``expect`` (the model at hand)."""
        diffs = [
            f"{k}: trained for {v!r}, model has {getattr(expect, k)!r}"
            for k, v in asdict(self).items()
            if v != getattr(expect, k)
        ]
        if diffs:
            raise HeadsMismatchError(
                f"{what} belong to a different base model (" + "; ".join(diffs) + ")"
            )


def read_saved_config(
    path: str | Path, name: str, fmt: str, version: int, error: type[ValueError]
) -> dict[str, Any]:
    """``CONFIG_FILE`` of a directory saved for a base model (a head set, a draft vocabulary),
    checked for its format and version; ``name`` says what such a directory is ("head",
    "draft-vocabulary"), ``error`` is what a missing file or another format raises."""
    f = Path(path) / CONFIG_FILE
    if not f.is_file():
        raise error(f"{path} is not a {name} directory: no {CONFIG_FILE}")
    try:
        config = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise error(f"{f}: unreadable ({e})") from e
    if not isinstance(config, dict):
        raise error(f"{f}: expected a JSON object, got {type(config).__name__}")
    if config.get("format") != fmt or config.get("version") != version:
        raise error(
            f"{f}: expected format {fmt!r} version {version}, got "
            f"{config.get('format')!r} version {config.get('version')!r}"
        )
    return config


def weights_fingerprint(
    embed_weight: torch.Tensor, norm_weight: torch.Tensor, vocab_size: int | None = None
) -> str:
    """sha256 (first 16 hex digits) of bf16-rounded embedding slices + the final-norm weight.

    ``embed_weight`` may be a vocab shard as long as it starts at row 0 (TP rank 0); a vocabulary
    (``vocab_size``) smaller than ``FINGERPRINT_ROWS`` is hashed whole."""
    rows = min(FINGERPRINT_ROWS, vocab_size or FINGERPRINT_ROWS)
    if embed_weight.dim() != 2 or embed_weight.shape[0] < rows:
        raise ValueError(
            f"embedding weight needs >= {rows} rows [vocab, hidden], "
            f"got shape {tuple(embed_weight.shape)}"
        )
    h = hashlib.sha256()
    for t in (embed_weight[:rows, ::FINGERPRINT_COL_STRIDE], norm_weight.reshape(-1)):
        # through float32 first: bf16 from fp32 is the same round-to-nearest vLLM's loader does
        t = t.detach().to("cpu", torch.float32).to(torch.bfloat16).contiguous()
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def identity_from_tensors(
    *,
    architecture: str,
    num_layers: int,
    hidden_size: int,
    vocab_size: int,
    embed_weight: torch.Tensor,
    norm_weight: torch.Tensor,
) -> ModelIdentity:
    """The identity from raw tensors, e.g. a vLLM model's ``model.embed_tokens.weight`` (rank 0)
    and ``model.norm.weight`` with its HF config's architecture / sizes."""
    return ModelIdentity(
        architecture=architecture,
        num_layers=int(num_layers),
        hidden_size=int(hidden_size),
        vocab_size=int(vocab_size),
        fingerprint=weights_fingerprint(embed_weight, norm_weight, vocab_size),
    )


def identity_from_hf(model) -> ModelIdentity:
    """The identity of a transformers ``*ForCausalLM`` (Llama family)."""
    cfg = model.config
    arch = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
    return identity_from_tensors(
        architecture=arch,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        embed_weight=model.get_input_embeddings().weight,
        norm_weight=model.model.norm.weight,
    )

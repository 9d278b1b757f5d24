"""Heads for the embedded model (SmolLM2-135M-Instruct): their default exit layers, their cache
directory, ``$VLLM_SELFSPEC_HOME/heads/<model>-<kind>/`` (``vllm-selfspec train-heads`` writes
there by default), and the lookup of a model's cached heads (``cached_heads``).

Default exits 8, 12, 16, 20, 24 of 30 layers (27%–80% depth, every 4 layers): below ~8 even a
trained head rarely agrees with the final layer (CascadeExit reports 41% at 29% depth), above 24
a draft already costs > 80% of a full step, and a 4-layer spacing gives adaptive policies (DEL,
Cascade) a real choice while training cost stays linear in the number of exits.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..checkpoints import EMBEDDED_NAME, embedded_model_dir, home
from .identity import CONFIG_FILE

EMBEDDED_LAYERS = (8, 12, 16, 20, 24)
#: feature heads' default exit: the embeddings (docs/heads.md, "Feature heads": at exit 0 they
#: agree as often as the adapters at exit 8, and a draft runs no decoder layer)
EMBEDDED_FEATURE_LAYERS = (0,)


def embedded_heads_dir(kind: str) -> Path:
    return home() / "heads" / f"{EMBEDDED_NAME}-{kind}"


def cached_heads(model_path: str | os.PathLike, kind: str) -> Path | None:
    """The cached trained exit heads of ``kind`` for this model, if they exist (today: the
    embedded model's, in ``embedded_heads_dir``)."""
    if Path(model_path).resolve() != embedded_model_dir().resolve():
        return None
    found = embedded_heads_dir(kind)
    return found if (found / CONFIG_FILE).is_file() else None

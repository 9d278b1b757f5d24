"""Heads for the embedded model (SmolLM2-135M-Instruct), trained once on first use.

Cached like the model: ``$VLLM_SELFSPEC_HOME/heads/<model>-<kind>/`` (written atomically by
``io.save_heads``; a file lock keeps two processes from training the same heads at once).

Default exits 8, 12, 16, 20, 24 of 30 layers (27%–80% depth, every 4 layers): below ~8 even a
trained head rarely agrees with the final layer (CascadeExit reports 41% at 29% depth), above 24
a draft already costs > 80% of a full step, and a 4-layer spacing gives adaptive policies (DEL,
Cascade) a real choice while training cost stays linear in the number of exits.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

from ..models import EMBEDDED_NAME, home
from .io import CONFIG_FILE

EMBEDDED_LAYERS = (8, 12, 16, 20, 24)


def embedded_heads_dir(kind: str) -> Path:
    return home() / "heads" / f"{EMBEDDED_NAME}-{kind}"


def ensure_embedded_heads(kind: str, progress: bool = True) -> Path:
    """The embedded model's ``kind`` heads ("adadecode" | "cascade"), trained with the default
    ``TrainConfig`` if not cached yet (about 6 minutes on one CPU thread)."""
    from .train import TrainConfig, train_heads

    out = embedded_heads_dir(kind)
    if (out / CONFIG_FILE).is_file():
        return out
    cfg = TrainConfig(kind=kind, layers=EMBEDDED_LAYERS)  # validates kind
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / CONFIG_FILE).is_file():  # another process may have finished meanwhile
            train_heads(None, cfg, out, progress=progress)
    return out

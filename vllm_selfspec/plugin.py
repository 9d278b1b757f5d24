"""The ``vllm.general_plugins`` entry point: declared, logged patches of vLLM 0.32 classes.

``register()`` runs once in every vLLM process (front end, engine core/scheduler, workers). Each
patch is a ``Patch`` declaration in ``PATCHES`` below (what it replaces, why, and a function
from vLLM's original to the replacement); ``apply`` installs one, logs it at INFO once per process,
and refuses a second, different patch of an attribute already patched. ``register()`` applies
the first six (the fourth on CPU only); the seventh is applied where a selfspec engine config is
built, so only in the process that serves it:

1. ``EngineArgs.create_engine_config``: when the speculative config names a selfspec method,
   read and validate it once (clear errors before anything starts), turn it into vLLM's
   ``custom_class`` speculative config pointing at our proposer (the draft length lives there
   only), store the other selfspec options, resolved, in ``additional_config["selfspec"]``
   (``SelfSpecConfig.stored``; the workers rebuild the config from it without parsing it again)
   and wire the selfspec worker class. The user passes only the speculative config.
2. ``EngineArgs.add_cli_args``: ``--speculative-config`` also takes a path to a JSON file.
3. ``VllmConfig.num_lookahead_tokens``: reserve KV slots for the draft positions, as vLLM does
   for EAGLE (without it, draft KV lands in the shared null block).
4. CPU only, a vLLM 0.32 bug fix: ``rejection_sampler.expand_batch_to_tokens``. vLLM's C++ stand-in
   for the Triton ``expand_kernel`` writes into an int64 *copy* of a float output
   (``vllm/utils/cpu_triton_utils.py: _expand_kernel_impl``), so the per-token temperatures, top-k
   and top-p of speculative sampling are uninitialised memory: every speculative method on CPU
   (vLLM's own ngram included) then corrupts outputs of batches with temperature > 0 requests.
   Replaced by a plain-PyTorch expansion with the same contract. It applies in every vLLM-CPU
   process once this package is installed, selfspec config or not.
5. ``Scheduler.update_from_output`` and 6. ``EngineCore.post_step``: a selfspec worker returns
   the step's drafts with its output (``compat.DRAFTS_ATTR``); the scheduler takes them there,
   and the engine core skips the ``take_draft_token_ids`` RPC that vLLM sends every step after
   it (one round trip to the worker process per step: docs/architecture.md, "The
   patches"). An output without the attribute (any other engine) changes nothing.
7. ``AsyncLLM.__init__``: export the workers' selfspec stats on the API server's ``/metrics``
   (``metrics.py``: a Prometheus collector that pulls them with the ``selfspec_stats`` RPC).

``register()`` also installs the frame-stack chunk cache where a benchmark names one
(``frame_stack.install_from_env``; nothing is patched: vanilla's processes get it as well).

Every vLLM class and module patched here comes from ``compat.py``. The second entry point,
``vllm_cpu_metadata`` (``vllm.platform_plugins``), patches nothing: it lets vLLM-CPU's own
``vllm`` command find its package metadata (docs/user-guide.md, "Serve").
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import compat, frame_stack
from .config import (
    LOSSY_WARNING,
    SelfSpecConfig,
    SelfSpecConfigError,
    methods,
    read_spec,
)
from .policies import POLICIES

logger = logging.getLogger(compat.LOGGER_NAME)


@dataclass(frozen=True)
class Patch:
    """One replacement of a vLLM attribute: ``owner().attr = make(original)``, where
    ``original`` is the attribute as stored on the owner (a function, a ``staticmethod`` or a
    ``property`` object), and ``make`` returns the same kind of object."""

    owner: Callable[[], Any]  # the vLLM class or module patched (a compat accessor)
    attr: str
    why: str  # logged when applied
    make: Callable[[Any], Any]
    applies: Callable[[], bool] = lambda: True  # e.g. CPU only


#: "module.Owner.attr" -> the Patch applied there, in this process
_APPLIED: dict[str, Patch] = {}


def apply(patch: Patch) -> None:
    """Install ``patch`` (once: applying the same declaration again does nothing); a different
    patch of an attribute already patched is refused."""
    if not patch.applies():
        return
    owner = patch.owner()
    where = (
        f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__
    )
    target = f"{where}.{patch.attr}"
    done = _APPLIED.get(target)
    if done is patch:
        return
    if done is not None:
        raise RuntimeError(
            f"vllm-selfspec: {target} is already patched ({done.why}); refusing a second patch "
            f"({patch.why})"
        )
    setattr(owner, patch.attr, patch.make(vars(owner)[patch.attr]))
    _APPLIED[target] = patch
    logger.info("vllm-selfspec patched %s in pid %d: %s", target, os.getpid(), patch.why)


def register() -> None:
    """The plugin entry point (every vLLM process): the version check, the frame-stack cache
    where a benchmark names one (``frame_stack.install_from_env``), then ``AT_START``."""
    compat.check_vllm_version()
    frame_stack.install_from_env()
    for patch in AT_START:
        apply(patch)


def vllm_cpu_metadata() -> None:
    """The ``vllm.platform_plugins`` entry point ``selfspec_cpu_metadata``: it claims no platform
    (returns None) and only lets ``importlib.metadata`` answer for "vllm" with the installed
    "vllm-cpu" (``compat.answer_vllm_metadata_with_cpu_build``; nothing where "vllm" is
    installed). vLLM resolves its platform, calling every platform plugin, while its CLI imports
    its subcommands, before it asks for ``importlib.metadata.version("vllm")``, so with this the
    CPU build's own ``vllm serve`` command starts instead of dying with PackageNotFoundError. The
    general plugins (``register``) load too late for that: vLLM loads them when it builds an
    engine."""
    compat.answer_vllm_metadata_with_cpu_build()
    return None


def is_selfspec_vllm_config(vllm_config) -> bool:
    spec = vllm_config.speculative_config
    return spec is not None and spec.method == "custom_class" and spec.model == compat.PROPOSER_CLS


# ---- 1. the config translation ----------------------------------------------------------------
def translate_engine_args(args) -> SelfSpecConfig | None:
    """Rewrite EngineArgs in place for a selfspec config; return the parsed config (or None)."""
    spec = args.speculative_config
    if spec is None:
        return None
    raw = read_spec(spec)  # the one reading of the user's config (dict, JSON text or file)
    method = raw.get("method")
    if method not in methods():
        if isinstance(spec, (str, os.PathLike)):
            args.speculative_config = raw  # a file path for a vLLM method: vLLM wants the dict
        if method is not None and method not in compat.vllm_spec_methods():
            raise SelfSpecConfigError(
                f"unknown speculative method {method!r}: selfspec methods are "
                f"{sorted(methods())}, vLLM's are {compat.vllm_spec_methods()}"
            )
        return None
    cfg = SelfSpecConfig.parse(raw)
    if args.worker_cls not in ("auto", compat.WORKER_CLS):
        raise SelfSpecConfigError(
            f"selfspec wires its own worker class; remove worker_cls={args.worker_cls!r}"
        )
    if getattr(args, "pipeline_parallel_size", 1) > 1:
        raise SelfSpecConfigError(
            "selfspec does not support pipeline parallelism (the draft needs layers from every "
            "stage); use tensor parallelism instead"
        )
    if getattr(args, "kv_transfer_config", None) is not None:
        raise SelfSpecConfigError(
            "selfspec cannot run with a KV connector (kv_transfer_config): draft steps would "
            "be saved to the connector as if they were target KV"
        )
    args.worker_cls = compat.WORKER_CLS
    args.speculative_config = {
        "method": "custom_class",
        "model": compat.PROPOSER_CLS,
        "num_speculative_tokens": cfg.num_speculative_tokens,
    }
    args.additional_config = {**(args.additional_config or {}), "selfspec": cfg.stored()}
    return cfg


def arctic_inference_patches_vllm() -> bool:
    """Whether ArcticInference's own vLLM plugin is installed and enabled in this process: it
    patches vLLM's model runner and scheduler as this plugin does (context lookup uses only its
    ``suffix_decoding`` module, which ``scripts/install_suffix_decoding.sh`` installs without the
    plugin). Its plugin does nothing unless ``ARCTIC_INFERENCE_ENABLED`` is set."""
    from importlib.metadata import entry_points

    enabled = os.environ.get("ARCTIC_INFERENCE_ENABLED", "").strip().lower()
    if enabled in ("", "0", "false", "no", "off"):
        return False
    allowed = os.environ.get("VLLM_PLUGINS")
    for ep in entry_points(group="vllm.general_plugins"):
        if "arctic_inference" in ep.value and (allowed is None or ep.name in allowed.split(",")):
            return True
    return False


def check_vllm_config(vllm_config, cfg: SelfSpecConfig) -> SelfSpecConfig:
    """Checks that need the resolved model and parallel config (still before serving); stores
    the config with its "auto" options made concrete for the workers."""
    if arctic_inference_patches_vllm():
        raise SelfSpecConfigError(
            "ArcticInference's vLLM plugin is enabled (ARCTIC_INFERENCE_ENABLED) and would patch "
            "vLLM beside selfspec: unset ARCTIC_INFERENCE_ENABLED, or leave its plugin out with "
            "VLLM_PLUGINS (selfspec needs only arctic_inference.suffix_decoding)"
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise SelfSpecConfigError("selfspec does not support pipeline parallelism")
    if vllm_config.kv_transfer_config is not None:
        raise SelfSpecConfigError("selfspec cannot run with a KV connector")
    try:  # the workers read these; a bad value fails here, before serving
        compat.draft_attention_mode()
        compat.compile_drafts_env()
    except ValueError as e:
        raise SelfSpecConfigError(str(e)) from e
    cfg = cfg.resolved(vllm_config.model_config.model)
    cfg.validate_for_model(compat.model_info(vllm_config))
    if (
        POLICIES[cfg.method].deferred
        and not compat.is_cpu()
        and not (vllm_config.model_config.enforce_eager)
    ):
        raise SelfSpecConfigError(
            f"{cfg.method} runs the target forward layer by layer (the last round's tokens enter "
            f"at different depths), which CUDA graphs cannot replay: pass enforce_eager=True "
            f"(--enforce-eager)"
        )
    vllm_config.additional_config["selfspec"] = cfg.stored()
    return cfg


def _create_engine_config(orig):
    def create_engine_config(self, *args, **kwargs):
        cfg = translate_engine_args(self)
        vllm_config = orig(self, *args, **kwargs)
        if cfg is not None:
            cfg = check_vllm_config(vllm_config, cfg)
            logger.info("vllm-selfspec: method %s, options %s", cfg.method, cfg.to_dict())
            if cfg.options.get("lossy"):
                logger.warning(LOSSY_WARNING)
            apply(ASYNC_LLM_METRICS)
        return vllm_config

    return create_engine_config


# ---- 2. --speculative-config FILE ------------------------------------------------------------
def _spec_config_arg(value: str):
    try:
        return read_spec(value)
    except SelfSpecConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _add_cli_args(orig: staticmethod) -> staticmethod:
    def add_cli_args(parser, *args, **kwargs):
        parser = orig.__func__(parser, *args, **kwargs)
        for action in parser._actions:
            if action.dest == "speculative_config":
                action.type = _spec_config_arg
        return parser

    return staticmethod(add_cli_args)


# ---- 3. KV slots for the draft positions -------------------------------------------------------
def _num_lookahead_tokens(orig: property) -> property:
    def num_lookahead_tokens(self) -> int:
        if is_selfspec_vllm_config(self):
            # the drafter writes KV for positions [N-1, N+k-2]: the same contract as EAGLE
            return self.speculative_config.num_speculative_tokens
        return orig.fget(self)

    return property(num_lookahead_tokens, doc=orig.__doc__)


# ---- 4. vLLM 0.32 CPU bug: expand_batch_to_tokens --------------------------------------------
def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """[batch] -> [num_tokens], x[i] repeated for request i's tokens; x == replace_from -> replace_to.

    Same contract as ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens``."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)
    return torch.repeat_interleave(x, counts.to(torch.long), output_size=num_tokens)


# ---- 5, 6. drafts ride with the step's output ----------------------------------------------------
_NO_DRAFTS_ATTR = object()


def _update_from_output(orig):
    def update_from_output(self, scheduler_output, model_runner_output):
        drafts = vars(model_runner_output).pop(compat.DRAFTS_ATTR, _NO_DRAFTS_ATTR)
        out = orig(self, scheduler_output, model_runner_output)
        if drafts is not _NO_DRAFTS_ATTR:
            # what EngineCore.post_step would do next with the drafts it fetched by RPC
            self._selfspec_drafts_taken = True
            if drafts is not None:
                self.update_draft_token_ids(drafts)
        return out

    return update_from_output


def _post_step(orig):
    def post_step(self, model_executed: bool) -> None:
        if vars(self.scheduler).pop("_selfspec_drafts_taken", False):
            return  # the drafts came with the output: no take_draft_token_ids RPC
        orig(self, model_executed)

    return post_step


# ---- 7. selfspec metrics on the OpenAI server's /metrics -------------------------------------
def _async_llm_init(orig):
    def __init__(self, vllm_config, *args, **kwargs):
        orig(self, vllm_config, *args, **kwargs)
        if is_selfspec_vllm_config(vllm_config):
            from . import metrics  # prometheus_client: only in a process that serves selfspec

            metrics.install(self, vllm_config)

    return __init__


ASYNC_LLM_METRICS = Patch(
    compat.async_llm_class,
    "__init__",
    "selfspec stats on the OpenAI server's /metrics",
    _async_llm_init,
)
#: the patches ``register()`` applies in every vLLM process (1-6 of the module docstring)
AT_START = (
    Patch(
        compat.engine_args_class,
        "create_engine_config",
        "a selfspec speculative config -> vLLM's custom_class drafter + worker class + checks",
        _create_engine_config,
    ),
    Patch(
        compat.engine_args_class,
        "add_cli_args",
        "--speculative-config accepts a JSON file path",
        _add_cli_args,
    ),
    Patch(
        compat.vllm_config_class,
        "num_lookahead_tokens",
        "k lookahead KV slots for selfspec drafts",
        _num_lookahead_tokens,
    ),
    Patch(
        compat.rejection_sampler_module,
        "expand_batch_to_tokens",
        "vLLM 0.32's CPU expansion of per-request sampling parameters writes into a copy "
        "(uninitialised temperatures under speculative sampling): a PyTorch expansion instead",
        lambda orig: expand_batch_to_tokens,
        applies=compat.is_cpu,
    ),
    Patch(
        compat.scheduler_class,
        "update_from_output",
        "a selfspec step's drafts come with its output (no take_draft_token_ids RPC)",
        _update_from_output,
    ),
    Patch(
        compat.engine_core_class,
        "post_step",
        "skip the take_draft_token_ids RPC when the drafts came with the output",
        _post_step,
    ),
)
#: every patch, in the order of the module docstring
PATCHES = (*AT_START, ASYNC_LLM_METRICS)

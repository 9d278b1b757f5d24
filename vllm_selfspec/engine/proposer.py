"""The drafting engine: vLLM's ``custom_class`` proposer, driven by the runner mixin (worker.py).

One decode step, as the runner sees it (after the target verified last step's drafts and
vLLM's rejection sampler accepted a prefix):

1. feedback: per request, drafted/accepted counts and, if the policy asked, the residual stream of
   the verified tokens after chosen layers (bounded: ``capture_tokens`` rows per request);
2. policy: per request, the next ``DraftDecision`` (plan, draft length, confidence floor);
3. how much: per request, the free context-lookup draft or the policy's self-draft, and the goodput
   controller's draft lengths for the whole batch (a step whose choice the controller deems not
   worth its own cost, ``GoodputController.look_due``, skips this and drafts nothing);
4. draft: the method's drafting strategy (``DRAFTERS``, drafting.py) drafts the self-drafting
   requests, one forward per draft step for the whole batch; greedy requests draft the argmax,
   sampled ones draw from ``softmax(logits / T)`` and hand that distribution to vLLM's rejection
   sampler, which keeps the target distribution.

This file is method-agnostic: what differs between methods is in their policy
(``vllm_selfspec/policies/``) and their drafter (``DRAFTERS``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np
import torch

from .. import compat
from ..config import LOSSY_WARNING, SelfSpecConfig
from ..goodput import (
    AcceptanceTracker,
    Candidate,
    GoodputController,
    SearchBudget,
    StepCostModel,
    prefer_free,
)
from ..heads import identity_from_tensors, load_heads
from ..lookup import SLOTS, ContextIndex, SharedIndex, TenantView, is_shared
from ..policies import DraftDecision, Feedback
from ..vocab import load_generations, load_vocab
from . import shadow
from .drafters.adadecode import DeferredEngine
from .drafters.cascade import CascadeDrafter
from .drafters.feature import FeatureDrafter
from .drafters.plan import PlanDrafter
from .drafting import DraftContext, Drafter, peak_shapes
from .executor import PlanExecutor
from .knapspec_forward import KnapsackForward, latency_model
from .shadow import ShadowProjector
from .stats import EngineStats

#: the drafting strategies, by the name a policy gives (``Policy.drafter``; drafting.py)
DRAFTERS: dict[str, type[Drafter]] = {
    "plan": PlanDrafter,
    "cascade": CascadeDrafter,
    "deferred": DeferredEngine,
    "feature": FeatureDrafter,
}
logger = logging.getLogger(compat.LOGGER_NAME)


def verified_q(q: torch.Tensor | None, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The rejection sampler's q rows for one request's verified draft tokens ``ids``, from the q
    its drafts were drawn with (None: none kept).

    vLLM may verify fewer or other tokens than were drafted: it cuts drafts at the first one
    its structured-output grammar refuses and pads the rest with -1, and pads requests admitted
    with one token left with -1. A -1 is rejected, and the token sampled in its place comes from
    ``max(p - q, 0)``: its q row must be zeros, or that token would come from a distribution
    other than p. Drafts without a q go as point masses at their tokens (exact for any drafting
    distribution: x is accepted with probability p(x), else the token comes from p without x).

    >>> verified_q(torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]), torch.tensor([1, -1]), None)
    tensor([[0.5000, 0.5000, 0.0000],
            [0.0000, 0.0000, 0.0000]])
    """
    n = len(ids)
    valid = (ids >= 0)[:, None]
    if q is not None and q.shape[0] >= n:
        return q[:n] * valid.to(q.dtype)
    point = like.new_zeros(n, like.shape[1])
    return point.scatter_(1, ids.clamp(min=0).long()[:, None], valid.to(like.dtype))


def is_decode_step(scheduler_output) -> bool:
    """Whether a step decodes only: no new request, and every request scheduled for its one
    sampled token and its drafts. A prefill chunk is not a sample of decoding, however short:
    with prefix caching (vLLM's default) a request whose prompt is cached but for its last few
    tokens is scheduled for those few, which would be counted as drafts the step verified, at
    the price of a prefill and a new request's admission."""
    per_req = scheduler_output.num_scheduled_tokens
    if not per_req or scheduler_output.scheduled_new_reqs:
        return False
    spec = scheduler_output.scheduled_spec_decode_tokens
    return all(n == 1 + len(spec.get(r, ())) for r, n in per_req.items())


@dataclasses.dataclass
class _Step:
    """What the phases of one decode step share (``SelfSpecProposer.propose_selfspec``)."""

    runner: Any
    ib: Any  # runner.input_batch
    #: per batch row, the tokens the verification sampled (empty: a prefill chunk, discarded)
    sampled: list[list[int]]
    #: request id -> the draft tokens verified this step (-1: vLLM's placeholders)
    scheduled: dict[str, list[int]]
    sampling_metadata: Any
    #: per batch row, the tokens it drafts this step (the result)
    drafts: list[list[int]]
    t_start: float
    decode_step: bool  # no prefill chunk: the target forward is a step-cost sample
    target_seconds: float  # the target forward's time, from the runner's execute_model
    #: (batch row, request id, policy state) of the rows that sampled a token
    entries: list[tuple[int, str, Any]] = dataclasses.field(default_factory=list)
    t_look: float = 0.0  # when the choice of drafts began


class SelfSpecProposer:
    """Instantiated by vLLM (``speculative_config.model``) in every worker process."""

    def __init__(self, vllm_config) -> None:
        opts = compat.selfspec_options(vllm_config)
        if opts is None:
            raise RuntimeError(
                "SelfSpecProposer needs the selfspec plugin's config: pass a selfspec "
                'speculative_config such as {"method": "layerskip", ...}, not custom_class'
            )
        self.vllm_config = vllm_config
        #: the draft length: vLLM's speculative_config is its one home (the scheduler's lookahead
        #: slots and the rejection sampler read it there too)
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.config = SelfSpecConfig.from_stored(opts, self.k)
        self.info = compat.model_info(vllm_config)
        if self.config.draft_vocab_size is not None:  # the draft reads N of V LM-head rows
            self.info = dataclasses.replace(
                self.info,
                draft_head_layers=(
                    self.info.lm_head_layers * self.config.draft_vocab_size / self.info.vocab_size
                ),
            )
        self.policy = self.config.make_policy(self.info)
        #: Cascade's lossy sampler: drafts are accepted unverified (worker.UnverifiedAcceptance)
        self.lossy = bool(getattr(self.policy, "lossy", False))
        if self.lossy:
            logger.warning(LOSSY_WARNING)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.capture_layers = tuple(sorted(set(self.policy.capture_layers)))
        #: the layers vLLM's EAGLE-3 hook returns; layer 0 (the embeddings) is never taken from
        #: it: the hook hands back the embedding tensor itself, which the first layer's fused
        #: add + norm may update in place on GPU. ``_capture`` embeds the rows' tokens instead.
        self.aux_layers = tuple(layer for layer in self.capture_layers if layer > 0)
        self.capture_tokens = self.config.capture_tokens
        self.states: dict[str, Any] = {}
        self.stats = EngineStats()
        #: measured seconds of target forwards and draft steps (goodput/costs.py), read by timed
        #: policies and the controller
        self.costs = StepCostModel()
        self.policy.costs = self.costs
        #: per request and draft position: P(accepted | the drafts before it accepted)
        self.acceptance = AcceptanceTracker(self.k)
        self._rates: dict[str, Any] = {}
        #: the batch-wide choice of draft lengths (None: each policy's own lengths)
        self.controller = GoodputController(self.costs) if self.config.goodput else None
        #: under the controller, plan searches (KnapSpec's) and hidden-state capture with shadow
        #: projections (DEL's) each take at most a share of the time: a shadow row is a full
        #: LM-head projection per exit, dearer than the target's whole stack on a large-vocabulary
        #: model (Gemma-3-270M; docs/architecture.md, "The goodput controller")
        self.search_budget = SearchBudget() if self.controller is not None else None
        self.shadow_budget = SearchBudget() if self.controller is not None else None
        #: context lookup (lookup.py): per request its suffix tree; acceptance per slot (source,
        #: match length, the tree's estimate); the slots of the lookup drafts each request awaits
        #: verification of
        self.lookup = self.config.lookup
        self._indexes: dict[str, ContextIndex] = {}
        self._prompt_lens: dict[str, int] = {}
        #: whose finished outputs a request drafts from ("tenant", "global", "off"; lookup.py),
        #: and per request what of the shared index it sees (its tenant's outputs, datastore)
        self.sharing = self.lookup.get("shared", "off")
        self._views: dict[str, TenantView] = {}
        #: the outputs of finished requests (identical on every TP rank: same requests, order)
        #: and the datastore's sequences (the model's corpus generations), pinned; loaded with the
        #: model, where the target's identity can be checked
        self.shared_index: SharedIndex | None = None
        self.lookup_acceptance = AcceptanceTracker(SLOTS)
        self._lookup_rates: dict[str, Any] = {}
        self._lookup_round: dict[str, list[int]] = {}
        self._tp = vllm_config.parallel_config.tensor_parallel_size
        self._last_seconds = 0.0  # selfspec's time in the previous step (its draft steps)
        self._last_start: float | None = None  # when the previous step's proposal began
        self.runner = None
        self.executor: PlanExecutor | None = None
        #: what a drafter uses of the engine, and the method's drafter (set in load_model)
        self.ctx: DraftContext | None = None
        self.drafter: Drafter | None = None
        #: q of every request whose drafts await verification (None: greedy drafts); kept per
        #: request because a request may be verified steps later (token budget, preemption)
        self._pending_q: dict[str, torch.Tensor | None] = {}

    # ---- vLLM wiring ---------------------------------------------------------------------------
    def propose(self, *args, **kwargs):  # vLLM's custom_class API; our runner hook replaces it
        raise RuntimeError(
            f"the selfspec drafter was called without its runner hooks: the worker class must "
            f"be {compat.WORKER_CLS} (the plugin sets it; do not override worker_cls)"
        )

    def bind_runner(self, runner) -> None:
        self.runner = runner

    def load_model(self, target_model) -> None:  # called by the runner's load_model
        # draft forwards run compiled where vLLM compiles the target (its default mode), unless
        # the deployment asks for them eager (compat.compiles_drafts)
        compiled = compat.compiles_drafts(self.vllm_config)
        self.executor = PlanExecutor(
            target_model, compat.compile_options(self.vllm_config) if compiled else None
        )
        self.shadow = ShadowProjector(
            self.executor,
            self.info.vocab_size,
            self.vllm_config.parallel_config.tensor_parallel_size,
        )
        self.shadow_heads = [self.policy.head_for_layer(layer) for layer in self.capture_layers]
        heads_path = getattr(self.policy, "heads_path", None)
        if heads_path:
            self._load_heads(target_model, heads_path)
        if self.config.draft_vocab_size is not None:
            self._load_draft_vocab(self.config.draft_vocab, self.config.draft_vocab_size)
        if self.sharing != "off" or self.lookup.get("datastore"):
            store = self.lookup.get("datastore")
            pinned = load_generations(store, expect=self._identity()) if store else ()
            self.shared_index = SharedIndex(self.lookup, pinned=pinned)
        self.ctx = DraftContext(self, self.runner, self.executor, self.shadow)
        self.drafter = DRAFTERS[self.policy.drafter](self.ctx)

    def bind_attention(self) -> str:
        """Choose who runs draft attention, once the KV cache exists (before ``warm_up``, which
        compiles for it): a line for the log."""
        why = self.ctx.bind_attention(compat.draft_attention_mode())
        return "the paged kernel" if why is None else f"vLLM's attention backend ({why})"

    def warm_up(self) -> float:
        """Compiles the draft forwards before serving (nothing eagerly); returns the seconds."""
        t0 = time.perf_counter()
        param = self.executor.layout.norm.weight
        self.executor.warm_up(
            lambda n: compat.warm_up_context(self.vllm_config, n),
            self.info.hidden_size,
            param.dtype,
            param.device,
        )
        return time.perf_counter() - t0

    def _identity(self):
        """The target's identity (heads.identity) on TP rank 0 (None elsewhere): rank 0 holds
        the fingerprinted embedding rows."""
        if compat.tp_rank() != 0:
            return None
        lay, info = self.executor.layout, self.info
        return identity_from_tensors(
            architecture=info.architecture,
            num_layers=info.num_layers,
            hidden_size=info.hidden_size,
            vocab_size=info.vocab_size,
            embed_weight=lay.embed_weight,
            norm_weight=lay.norm.weight,
        )

    def _load_draft_vocab(self, path: str, size: int) -> None:
        self.executor.set_draft_vocab(load_vocab(path, size, expect=self._identity()))

    def _load_heads(self, target_model, path: str) -> None:
        """Trained exit heads into the executor's head slots ("heads@<layer>"), after checking
        they were trained for this model (rank 0 holds the fingerprinted embedding rows)."""
        heads = load_heads(path, expect=self._identity())
        param = self.executor.layout.norm.weight
        for layer, head in heads.items():
            self.executor.heads[f"heads@{layer}"] = head.to(device=param.device, dtype=param.dtype)
        if self.executor.num_layers != self.info.num_layers:
            raise RuntimeError(
                f"model has {self.executor.num_layers} layers, config says {self.info.num_layers}"
            )

    def on_request_finished(self, req_id: str) -> None:
        self.states.pop(req_id, None)
        self._rates.pop(req_id, None)
        index = self._indexes.pop(req_id, None)
        prompt_len = self._prompt_lens.pop(req_id, None)
        view = self._views.pop(req_id, None)
        if index is not None and view is not None and self.sharing != "off":
            self.shared_index.add(index.tokens[prompt_len:], view.tenant)
        self._lookup_rates.pop(req_id, None)
        self._lookup_round.pop(req_id, None)
        self._pending_q.pop(req_id, None)
        if self.drafter is not None:
            self.drafter.forget(req_id)

    def forget_outputs(self) -> None:
        """Forget the finished requests' outputs in the shared lookup index; the datastore stays
        (vllm_selfspec.forget_outputs)."""
        if self.shared_index is not None:
            self.shared_index.forget()

    def reserve_peak_memory(self) -> int:
        """Allocate, then free, the largest tensors one step of drafting holds at once at
        ``max_num_seqs`` requests (``drafting.peak_shapes``); returns their bytes. vLLM's
        start-up profile (``profile_run``, which measures the peak allocation while it runs)
        then leaves room for them: vLLM runs no dummy step of a ``custom_class`` drafter, so
        without this a full batch of sampled requests could run out of memory after start-up
        said it fits."""
        ex = self.executor
        vocab = self.info.vocab_size
        shapes = peak_shapes(
            max_seqs=self.vllm_config.scheduler_config.max_num_seqs,
            k=self.k,
            vocab=vocab,
            draft_vocab=vocab if ex.vocab_ids is None else int(ex.vocab_ids.numel()),
            hidden=self.info.hidden_size,
            capture_layers=len(self.capture_layers),
            capture_tokens=self.capture_tokens,
            chunk_rows=shadow.CHUNK_ROWS,
        )
        held = [torch.empty(s, dtype=torch.float32, device=self.runner.device) for s in shapes]
        total = sum(t.numel() * t.element_size() for t in held)
        del held
        return total

    def draft_probs(self, req_ids: list[str], spec_decode_metadata) -> torch.Tensor | None:
        """q of every draft token verified now, in the rejection sampler's order (vLLM's runner
        asks at verification: ``_get_spec_decode_draft_probs``); None when no request verifying
        drafts has a q (greedy, or lookup drafts only): vLLM's sampler then reads every draft as
        a point mass, as it does its own ngram drafts (no [drafts, vocabulary] tensor made).

        A verified request without a q gets point masses at its draft tokens. That is exact for
        any drafting distribution: accepting x with probability p(x), else sampling from p
        without x, yields p (a greedy request's q is not read at all). It covers vLLM's
        placeholder drafts (-1, rejected unread: a row of zeros), which the scheduler gives a
        request admitted with one token left to compute, beside running decodes (vLLM's own
        lookup then dropped every request's q for the whole step, with "Missing cached draft
        probabilities")."""
        verified = [(r, n) for r, n in zip(req_ids, spec_decode_metadata.num_draft_tokens) if n]
        qs = [self._pending_q.get(r) for r, _ in verified]
        like = next((q for q in qs if q is not None), None)
        if like is None:
            return None
        tokens = spec_decode_metadata.draft_token_ids
        rows: list[torch.Tensor] = []
        start = 0
        for (_, n), q in zip(verified, qs):
            ids, start = tokens[start : start + n], start + n
            rows.append(verified_q(q, ids, like))
        return torch.cat(rows)

    def forget_drafts(self, req_ids) -> None:
        """The scheduler dropped these requests' drafts (preempted): their q is stale."""
        for req_id in req_ids:
            self._pending_q.pop(req_id, None)

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_selfspec(
        self,
        runner,
        scheduler_output,
        sampled_token_ids: list[list[int]],
        sampling_metadata,
        aux_hidden_states,
        spec_decode_metadata,
        common_attn_metadata,
        sample_hidden_states=None,
    ) -> list[list[int]]:
        """One decode step's drafts (one list per batch row), after the target verified the last
        step's drafts. The runner mixin calls it where vLLM would call its own drafter.

        The phases, in order (each a method below):

        * stats (``_start_step``): count the step; a decode step's target forward (timed from
          the runner's ``execute_model``) is a sample of the step-cost model; under TP every
          rank takes rank 0's costs. Requests seen for the first time get their states.
        * due (``_due``): what this step is due for under the goodput controller: costly
          feedback, a plan search, a choice of drafts (without it: all three).
        * feedback (``_capture_feedback``, ``_observe``): the verified rows' hidden states and
          shadow tokens for the policies that asked; per request its verification outcome
          (``_verification``: placeholder drafts, acceptance per draft position or per lookup
          slot, counters), then the drafter's and the policy's ``observe``.
        * settle (``_settle``): the controller learns what its last choice achieved: this step's
          tokens over the wall clock since that choice.
        * budgets (``_search``): the search and shadow budgets tick; at most one due plan search
          (KnapSpec's) runs, within its budget.
        * room, lookup (``_rounds``): per request the policy's ``DraftDecision`` and the room
          left to draft (``_room``: draft length k, max_model_len, seeded sampling, min_tokens);
          with context lookup, the request's free lookup draft (``_lookup``).
        * choice (``_choose``): per request its self-draft or its lookup draft
          (``_candidates``), and the controller's draft lengths for the whole batch
          (``_control``).
        * dispatch (``_take_lookup_drafts``, ``_dispatch``): lookup drafts go out as they are;
          the method's drafter drafts the rest, one forward per draft step for the batch.
        """
        self.drafter.step_inputs(sampled_token_ids, sample_hidden_states, spec_decode_metadata)
        step = self._start_step(runner, scheduler_output, sampled_token_ids, sampling_metadata)
        feedback_due, search_due, look = self._due()
        captured = self._capture_feedback(
            step, aux_hidden_states, common_attn_metadata, feedback_due
        )
        emitted, searches = self._observe(step, captured, search_due)
        self._settle(step, emitted)
        self._search(step, searches)
        active, lookups = self._rounds(step, look)
        active, cands = self._choose(step, active, lookups, look)
        active = self._take_lookup_drafts(step, active, cands, lookups)
        self._dispatch(step, active)
        return step.drafts

    def _start_step(self, runner, scheduler_output, sampled_token_ids, sampling_metadata) -> _Step:
        """The step's shared inputs; its count, its target forward's cost sample, the states of
        requests seen for the first time (a prefill chunk that sampled nothing takes no part)."""
        ib = runner.input_batch
        self.stats.steps += 1
        t_start = time.perf_counter()
        per_req = scheduler_output.num_scheduled_tokens
        # a decode/verify step: its target forward, timed from the runner's execute_model to
        # here, is a sample of the step-cost line in requests and draft tokens
        decode_step = is_decode_step(scheduler_output)
        target_seconds = t_start - getattr(runner, "_selfspec_t0", t_start)
        if decode_step and target_seconds > 0:
            self.costs.add_target(len(per_req), sum(per_req.values()), target_seconds)
        if (self.policy.timed or self.controller is not None) and self._tp > 1:
            self.costs.freeze(compat.broadcast_from_tp_rank0(self.costs.state()))
        step = _Step(
            runner=runner,
            ib=ib,
            sampled=sampled_token_ids,
            scheduled=scheduler_output.scheduled_spec_decode_tokens,
            sampling_metadata=sampling_metadata,
            drafts=[[] for _ in ib.req_ids],
            t_start=t_start,
            decode_step=decode_step,
            target_seconds=target_seconds,
        )
        for i, req_id in enumerate(ib.req_ids):
            if not sampled_token_ids[i]:  # a prefill chunk that sampled nothing, or discarded
                continue
            if req_id not in self.states:  # a new request (a policy's state may be None)
                self.states[req_id] = self.policy.new_state()
                self._rates[req_id] = self.acceptance.new_state()
                self._lookup_rates[req_id] = self.lookup_acceptance.new_state()
            step.entries.append((i, req_id, self.states[req_id]))
        return step

    def _capture_feedback(self, step: _Step, aux_hidden_states, common_attn_metadata, due: bool):
        """Costly feedback for self-drafting (DEL's shadow projections, captured hidden states),
        when due and the policy asks for it: batch row -> ``_capture``'s tuple."""
        have_aux = aux_hidden_states is not None or not self.aux_layers
        if not (self.capture_layers and have_aux and due):
            return {}
        t_shadow = time.perf_counter()
        with self.stats.timer("shadow"):
            rows = [
                i
                for i, _, state in step.entries
                if not self.policy.shadow or self.policy.wants_shadow(state)
            ]
            captured = self._capture(
                step.ib,
                rows,
                step.sampled,
                step.scheduled,
                aux_hidden_states,
                common_attn_metadata,
            )
        if self.shadow_budget is not None:
            self.shadow_budget.spend(time.perf_counter() - t_shadow)
        return captured

    def _observe(self, step: _Step, captured: dict, search_due: bool):
        """Each request's verification outcome to its drafter and its policy; returns the tokens
        the step emitted and the (batch row, state) pairs whose plan search is due."""
        emitted = 0
        due: list[tuple[int, Any]] = []
        with self.stats.timer("policy"):
            for i, req_id, state in step.entries:
                sampled = step.sampled[i]
                n_drafted, n_accepted, slots = self._verification(step, i, req_id)
                emitted += len(sampled)
                # the policy and its drafter hear of their own drafts only (a lookup round is a
                # plain step to them)
                own = (n_drafted, n_accepted) if slots is None else (0, 0)
                fb = Feedback(*own, int(step.ib.num_tokens_no_spec[i]))
                if i in captured:
                    fb.hidden, fb.targets, fb.shadow_tokens, fb.shadow_conf = captured[i]
                self.drafter.verified(req_id, *own, sampled, fb)
                self.policy.observe(state, fb)
                if search_due and self.policy.wants_optimise(state):
                    due.append((i, state))
        return emitted, due

    def _verification(self, step: _Step, i: int, req_id: str):
        """What the target's verification of batch row ``i`` showed: (drafted, accepted, the
        slots of its lookup drafts or None for a self-draft or none), recorded in the
        acceptance trackers and the stats."""
        st = self.stats
        sampled = step.sampled[i]
        # vLLM's -1 placeholder drafts (a request padded at admission) are not drafts
        verified = step.scheduled.get(req_id, ())
        n_drafted = sum(t >= 0 for t in verified)
        st.placeholder_drafts += len(verified) - n_drafted
        if req_id not in self._pending_q:  # every drafting request leaves one (greedy: None)
            st.draft_probs_missing += n_drafted
        self._pending_q.pop(req_id, None)  # its drafts (if any) were verified just now
        n_accepted = len(sampled) - 1 if n_drafted else 0
        slots = self._lookup_round.pop(req_id, None)
        if slots is not None:  # lookup drafts: measured per slot
            self.lookup_acceptance.observe(self._lookup_rates[req_id], n_drafted, n_accepted, slots)
            st.lookup_drafted += n_drafted
            st.lookup_accepted += n_accepted
            st.lookup_shared_accepted += sum(map(is_shared, slots[:n_accepted]))
        else:
            self.acceptance.observe(self._rates[req_id], n_drafted, n_accepted)
        st.generated_tokens += len(sampled)
        st.target_rounds += 1
        st.target_layers += self.info.num_layers
        st.drafted_tokens += n_drafted
        st.accepted_tokens += n_accepted
        return n_drafted, n_accepted, slots

    def _settle(self, step: _Step, emitted: int) -> None:
        """What the controller's last choice achieved: this step's tokens over the wall clock
        since it was made (its draft steps, the engine's cycle, this step's forward and
        sampling); a step with a prefill chunk tells nothing about decoding (seconds 0)."""
        if self.controller is None:
            return
        cycle = step.t_start - self._last_start if self._last_start is not None else 0.0
        self.controller.settle(emitted, len(step.entries), cycle if step.decode_step else 0.0)

    def _search(self, step: _Step, due: list[tuple[int, Any]]) -> None:
        """The time budgets tick with the last cycle; under the controller one due plan search a
        step at most, its time spent from the search budget."""
        if self.search_budget is not None:
            self.search_budget.tick(step.target_seconds + self._last_seconds)
            self.shadow_budget.tick(step.target_seconds + self._last_seconds)
            due = due[:1]  # one search a step at most, within the budget
        if due:
            t_search = time.perf_counter()
            with self.stats.timer("optimise"):
                self._optimise(step.runner, due)
            if self.search_budget is not None:
                self.search_budget.spend(time.perf_counter() - t_search)

    def _rounds(self, step: _Step, look: bool):
        """Per request its policy's next round, cut to the room it has, and its lookup draft:
        ([(batch row, decision, draft length)], {batch row: (tokens, slots)}). A step
        without a choice (``GoodputController.look_due``) drafts nothing: no round is proposed,
        and the lookup indexes catch up with their tokens at the next choice."""
        active: list[tuple[int, DraftDecision, int]] = []
        wanted: list[tuple[int, str, int, int]] = []
        step.t_look = time.perf_counter()
        with self.stats.timer("policy"):
            for i, req_id, state in step.entries if look else ():
                n = int(step.ib.num_tokens_no_spec[i])
                decision = self.policy.propose(state)
                room = self._room(step, i, req_id, n)
                g = min(decision.num_tokens, room)
                active.append((i, decision, max(g, 0)))
                if self.lookup and room > 0:
                    wanted.append((i, req_id, n, room))
        lookups: dict[int, tuple[list[int], list[int]]] = {}
        if wanted:
            requests = len(step.entries)  # how far a lookup draft runs (``factor_for``)
            with self.stats.timer("lookup"):
                for i, req_id, n, room in wanted:
                    lookups[i] = self._lookup(step.ib, i, req_id, n, room, requests)
        return active, lookups

    def _room(self, step: _Step, i: int, req_id: str, n: int) -> int:
        """How many tokens batch row ``i`` (``n`` tokens so far) may draft this step."""
        # draft positions n-1 .. n+g-2 and the next verification must fit max_model_len
        room = min(self.k, self.max_model_len - n)
        # sampled requests with their own seed draft nothing: the rejection sampler draws from
        # the request's generator once per draft token, and how many drafts a request gets
        # depends on timing (the controller) and the batch, so its output would not be
        # reproducible run to run, as vanilla vLLM's is (vLLM keeps only such rows' generators)
        if i in step.sampling_metadata.generators:
            room = 0
            self.stats.seeded_rounds += 1
        # min_tokens: vLLM 0.32 masks the stop tokens of a verification's bonus token by the
        # output length before the step, so a bonus token at or past min_tokens could not be
        # EOS where vanilla's could (vLLM issue #41758); drafts end before
        min_tokens = step.runner.requests[req_id].sampling_params.min_tokens
        if min_tokens:
            outputs = n - int(step.ib.num_prompt_tokens[i])
            if outputs < min_tokens:
                room = min(room, min_tokens - 1 - outputs)
        return room

    def _choose(self, step: _Step, active, lookups, look: bool):
        """Per request its self-draft or its lookup draft, and under the controller the batch's
        draft lengths: (the rounds with their lengths, the candidates or None)."""
        cands = None
        if active and (self.controller is not None or lookups):
            with self.stats.timer("controller"):
                cands = self._candidates(step.ib.req_ids, active, lookups)
                if self.controller is not None:
                    active = self._control(active, cands)
        if self.controller is not None and step.entries and look:
            self.controller.looked(time.perf_counter() - step.t_look)
        return active, cands

    def _take_lookup_drafts(self, step: _Step, active, cands, lookups):
        """The chosen lookup drafts go out as they are (no draft step); a policy whose round
        was cut hears of it (``Policy.capped``). Returns the rounds left to self-draft."""
        req_ids = step.ib.req_ids
        for j, (i, decision, g) in enumerate(active):
            if cands is not None and cands[j].free:  # a lookup round: no draft step
                if g > 0:
                    step.drafts[i], slots = lookups[i][0][:g], lookups[i][1][:g]
                    self._lookup_round[req_ids[i]] = slots
                    # no q kept: a lookup draft had probability 1, and ``draft_probs`` hands
                    # drafts without a q over as point masses
                    self._pending_q[req_ids[i]] = None
                    self.stats.draft_length_hist[g] += 1
                active[j] = (i, decision, 0)
                self.policy.capped(self.states[req_ids[i]], 0)
            elif cands is not None and g < cands[j].max_tokens:
                self.policy.capped(self.states[req_ids[i]], g)
        return [a for a in active if a[2] > 0]

    def _dispatch(self, step: _Step, active) -> None:
        """The method's drafter drafts the self-drafting rounds; the step's own time is kept for
        the next step's budgets and settlement."""
        if active:
            with self.stats.timer("draft"):
                self._draft(step.runner, active, step.sampling_metadata, step.drafts)
        self._last_seconds = time.perf_counter() - step.t_start
        self._last_start = step.t_start

    # ---- how much to draft: context lookup and the goodput controller ------------------------
    def _due(self) -> tuple[bool, bool, bool]:
        """What this step is due for: (costly feedback for self-drafting: hidden-state capture
        and shadow projections; a plan search; a choice of drafts). Without the controller all
        of them; with it, feedback around self-drafts and before probes
        (``GoodputController.self_feedback_due``), within their time budgets (smaller while
        only probes run: ``GoodputController.feedback_allowed``), and a choice
        where it is worth its cost (``GoodputController.look_due``). Under TP rank 0's answer
        (a search and a choice run collectives)."""
        if self.controller is None:
            return True, True, True
        feedback = self.controller.feedback_allowed(self.shadow_budget)
        search = self.controller.feedback_allowed(self.search_budget, search=True)
        look = self.controller.look_due()
        if self._tp > 1:
            feedback, search, look = compat.broadcast_from_tp_rank0((feedback, search, look))
        return feedback, search, look

    def _lookup(self, ib, i: int, req_id: str, n: int, room: int, requests: int):
        """The request's lookup draft (tokens, slots) in a step of ``requests`` requests, its
        index brought up to date."""
        index = self._indexes.get(req_id)
        if index is None:
            index = self._indexes[req_id] = ContextIndex(self.lookup)
            self._prompt_lens[req_id] = int(ib.num_prompt_tokens[i])
            if self.shared_index is not None:
                tenant = (
                    compat.request_tenant(self.runner, req_id) if self.sharing == "tenant" else ""
                )
                self._views[req_id] = self.shared_index.view(tenant)
        if len(index) < n:
            index.extend(ib.token_ids_cpu[i, len(index) : n].tolist())
        return index.propose(room, self._views.get(req_id), requests)

    def _candidates(self, req_ids, active, lookups) -> list[Candidate]:
        """Per request its option for this step: its policy's self-draft, or the free lookup
        draft (``goodput.prefer_free``, each as the controller prices it: ``weighed``)."""
        coef = self.costs.draft_coefficients()
        v1 = self.costs.token_seconds() or 0.0
        ctl = self.controller
        cands = []
        for i, decision, g in active:
            layers = decision.plan.layer_cost
            row = plan = 0.0
            if coef is not None:
                row, plan = float(coef[2]) * layers, float(coef[0] + coef[1] * layers)
            cand = Candidate(g, self.acceptance.cumulative(self._rates[req_ids[i]], g), row, plan)
            tokens, slots = lookups.get(i, ((), ()))
            if tokens:
                free = Candidate(
                    len(tokens),
                    self.lookup_acceptance.cumulative(
                        self._lookup_rates[req_ids[i]], len(tokens), slots
                    ),
                    free=True,
                )
                # as the controller will price them: a self-draft it would cut gives way
                weighed = (free, cand) if ctl is None else ctl.weighed(free, cand, v1)
                if prefer_free(*weighed, v1):
                    cand = free
            cands.append(cand)
        return cands

    def _control(self, active, cands):
        """The goodput controller's draft lengths for the whole batch (rank 0's under TP)."""
        choice = self.controller.choose(cands)
        tokens, probe = choice.tokens, choice.probe
        if self._tp > 1:  # each rank timed its own steps: draft what rank 0 chose
            tokens, probe = compat.broadcast_from_tp_rank0((tokens, probe))
        st = self.stats
        st.controller_cut_tokens += sum(
            c.max_tokens - min(c.max_tokens, t) for c, t in zip(cands, tokens)
        )
        st.controller_probes += int(probe)
        if not any(t and not c.free for c, t in zip(cands, tokens)):
            st.controller_plain_steps += 1
        return [(i, d, min(c.max_tokens, t)) for (i, d, _), c, t in zip(active, cands, tokens)]

    def _optimise(self, runner, due) -> None:
        """Searching policies (KnapSpec): run their search on the live model, per request."""
        if self.policy.needs_latency and self.policy.latency is None:
            self.policy.latency = latency_model(self.ctx)
        tables = self.ctx.kv_groups().tables(runner.input_batch)
        for i, state in due:
            self.policy.optimise(state, KnapsackForward(self.ctx, [t[i] for t in tables]))
            self.stats.optimisations += 1

    # ---- feedback: hidden states of the verified tokens ---------------------------------------
    def _capture(self, ib, batch_rows, sampled_token_ids, scheduled, aux, common_attn_metadata):
        """Per batch row i: (hidden [n_layers, m, d], targets [m], shadow tokens, shadow probs)
        for its last m = min(verified rows, capture_tokens) verified rows. Policies with
        ``shadow`` get the projected tokens and no hidden states (and vice versa)."""
        qsl = common_attn_metadata.query_start_loc_cpu.tolist()
        rows: list[int] = []
        spans: list[tuple[int, int, int]] = []  # (batch row, start in rows, m)
        for i in batch_rows:
            q_len = qsl[i + 1] - qsl[i]
            valid = len(sampled_token_ids[i]) if scheduled.get(ib.req_ids[i]) else q_len
            m = min(valid, self.capture_tokens)
            spans.append((i, len(rows), m))
            rows.extend(range(qsl[i] + valid - m, qsl[i] + valid))
        if not rows:
            return {}
        layers = []
        if self.capture_layers[0] == 0:  # the rows' input tokens, embedded (see aux_layers)
            inputs = []
            for i, _, m in spans:
                n = int(ib.num_tokens_no_spec[i])  # row t predicts token n-m+t, at n-m-1+t
                inputs.append(ib.token_ids_cpu[i, n - m - 1 : n - 1])
            ids = torch.from_numpy(np.concatenate(inputs).astype(np.int64))
            layers.append(self.executor.layout.embed(ids.to(self.runner.device)))
        if aux:
            idx = torch.tensor(rows, device=aux[0].device)
            layers.extend(a.index_select(0, idx) for a in aux)
        hidden = torch.stack(layers)  # [n_layers, rows, d]
        tokens = probs = None
        if self.policy.shadow:
            tokens, probs = self.shadow.project(hidden, self.shadow_heads)
            self.stats.shadow_rows += tokens.numel()
        out = {}
        for i, off, m in spans:
            n = int(ib.num_tokens_no_spec[i])  # includes this step's sampled tokens
            targets = torch.from_numpy(ib.token_ids_cpu[i, n - m : n].astype(np.int64))
            if tokens is None:
                out[i] = (hidden[:, off : off + m], targets, None, None)
            else:
                out[i] = (None, targets, tokens[:, off : off + m], probs[:, off : off + m])
        return out

    # ---- drafting --------------------------------------------------------------------------------
    def _draft(self, runner, active, sampling_metadata, drafts: list[list[int]]) -> None:
        ib = runner.input_batch
        greedy = sampling_metadata.all_greedy
        probs = None
        if not greedy:
            probs = torch.zeros(
                len(active), self.k, self.info.vocab_size, dtype=torch.float32, device=runner.device
            )
        self.drafter.draft(runner, active, sampling_metadata, probs, drafts)
        for j, (i, _, _) in enumerate(active):
            if drafts[i]:
                self._pending_q[ib.req_ids[i]] = (
                    None if probs is None else probs[j, : len(drafts[i])]
                )

    def stats_dict(self) -> dict[str, Any]:
        d = self.stats.as_dict()
        d["policy"] = self.policy.describe()
        target, draft = self.costs.target_line(), self.costs.draft_coefficients()
        # measured: target forward = v0 + v_row * requests + v_tok * draft tokens (+ v_ver if
        # any); a draft step = d0 + d1 * layers + d2 * layers * rows (seconds)
        d["costs"] = {
            "target_forward_s": None if target is None else list(target),
            "draft_step_s": None if draft is None else list(draft),
            # per shape measured: [requests, draft tokens, samples, seconds over a plain step]
            "verify_excess_s": self.costs.shapes(),
            # draft steps left out as carrying one-time costs (goodput.StepCostModel)
            "rejected_draft_samples": self.costs.rejected_draft_samples,
        }
        if self.controller is not None:  # per kind of draft: what it achieved, its calibration
            d["controller"] = self.controller.state()
        d["draft_vocab_size"] = self.config.draft_vocab_size
        d["live_requests"] = len(self.states)
        if self.lookup:  # what context lookup holds: bounded per request and shared
            shared = self.shared_index
            d["lookup_index"] = {
                "requests": len(self._indexes),
                "request_positions": sum(ix.hi - ix.lo for ix in self._indexes.values()),
                "request_bytes": sum(ix.memory_bytes() for ix in self._indexes.values()),
                "shared_output_tokens": 0 if shared is None else shared.size,
                "shared_tenants": 0 if shared is None else len(shared.tables),
                "datastore_tokens": 0 if shared is None else shared.datastore_tokens,
                "shared_bytes": 0 if shared is None else shared.memory_bytes(),
            }
        d.update(self.drafter.describe())
        return d

"""What a drafting strategy is, and what of the engine it may use.

The proposer (proposer.py) decides, per request and step, whether and how much to draft: feedback,
policy, context lookup, the goodput controller. *How* the drafts are made is a drafting strategy,
a ``Drafter`` named by the method's policy (``Policy.drafter``) and looked up in
``proposer.DRAFTERS``:

=============  ============================  =====================================================
name           file                          drafts
=============  ============================  =====================================================
``plan``       drafters/plan.py              each request's layer plan (layerskip, DEL, KnapSpec)
``cascade``    drafters/cascade.py           exits walked shallowest first (Cascade)
``deferred``   drafters/adadecode.py         deferred-layer rounds, finished by the target
``feature``    drafters/feature.py           feature heads, no decoder layer
=============  ============================  =====================================================

A drafter sees the engine through one ``DraftContext`` (and vLLM's runner it drafts for, whose
input batch it reads): the model's executor and layout, the measured costs it reports its draft
steps to, the stats, the policy and its per-request states, attention metadata over the
target's paged KV cache, and ``pick`` (the draft token of each row, with the q that sampled
rows hand the rejection sampler). A new method adds a policy file and, if none of these drafts
the way it needs, a drafter file in ``drafters/`` and one ``DRAFTERS`` entry; the proposer does
not change.

One step, as a drafter sees it::

    drafter.step_inputs(sampled, sample_hidden_states, spec_decode_metadata)   # every step
    drafter.verified(req_id, n_drafted, n_accepted, sampled, feedback)         # per request
    drafter.draft(runner, active, sampling_metadata, probs, drafts)            # drafting rows
    ...                                # next step's target forward:
    drafter.target_forward(runner, input_ids, positions)    # None: the model's own forward
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import compat
from . import draft_attention
from .draft_attention import DraftAttention
from .kv_groups import KVGroups

#: the token ``DraftContext.pick`` returns for a row with no valid draft: its round ends there
NO_DRAFT = -1


def finite_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(valid [n] bool, logits with every row of a non-finite value replaced by zeros, the
    number of such rows): the rows a draft distribution can come from, and logits that
    ``argmax``, ``softmax`` and ``torch.multinomial`` (which raises on NaN and inf) can take
    whole. A replaced row's token is never drafted. One host sync; no copy when all are valid."""
    valid = torch.isfinite(logits).all(dim=-1)
    invalid = len(valid) - int(valid.sum())
    if not invalid:
        return valid, logits, 0
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    return valid, torch.where(valid[:, None], logits, zero), invalid


def peak_shapes(
    max_seqs: int,
    k: int,
    vocab: int,
    draft_vocab: int,
    hidden: int,
    capture_layers: int,
    capture_tokens: int,
    chunk_rows: int,
) -> list[tuple[int, ...]]:
    """The float32 tensors one engine step of drafting may hold at once, at its largest
    (``max_seqs`` requests, all sampled, each drafting ``k``):

    * the q of every draft step of the sampled requests, [max_seqs, k, vocab] (the proposer's
      ``probs``), and the q handed to the rejection sampler at verification, [max_seqs * k,
      vocab];
    * one draft step's logits and their softmax over the draft vocabulary, and that q over the
      full vocabulary;
    * with shadow tokens: the captured rows, [layers, max_seqs * capture_tokens, hidden], and a
      projected chunk's logits and softmax.

    >>> peak_shapes(2, 3, 10, 4, 8, capture_layers=0, capture_tokens=4, chunk_rows=256)
    [(2, 3, 10), (6, 10), (2, 4), (2, 4), (2, 10)]
    """
    shapes = [(max_seqs, k, vocab), (max_seqs * k, vocab)]
    shapes += [(max_seqs, draft_vocab), (max_seqs, draft_vocab), (max_seqs, vocab)]
    if capture_layers:
        rows = max_seqs * capture_tokens
        shapes += [(capture_layers, rows, hidden)]
        shapes += [(min(rows, chunk_rows), draft_vocab)] * 2
    return shapes


@dataclass
class RoundStart:
    """What every draft round starts from, for the ``active`` requests of one step."""

    rows: list[int]  # their batch rows
    gammas: list[int]  # the most drafts each may make
    rows_t: torch.Tensor  # ``rows`` as a tensor (CPU)
    pos0: torch.Tensor  # the position of the token each just sampled (CPU, int64)
    tok: torch.Tensor  # that token: the first draft step's input (CPU, int64)
    temps: torch.Tensor | None  # every batch row's temperature (None: all greedy)

    @classmethod
    def of(cls, runner, active, sampling_metadata) -> RoundStart:
        ib = runner.input_batch
        rows = [i for i, _, _ in active]
        pos0 = torch.from_numpy(ib.num_tokens_no_spec[rows].astype(np.int64)) - 1
        return cls(
            rows=rows,
            gammas=[g for _, _, g in active],
            rows_t=torch.tensor(rows, dtype=torch.long),
            pos0=pos0,
            tok=torch.from_numpy(ib.token_ids_cpu[rows, pos0.numpy()].astype(np.int64)),
            temps=None if sampling_metadata.all_greedy else sampling_metadata.temperature,
        )


class DraftContext:
    """The engine state a drafter uses: one per proposer, built when the model is loaded.

    Everything here is shared with the proposer (the same objects), so a drafter's draft steps
    land in the same cost model and stats the controller and the bench read."""

    def __init__(self, proposer, runner, executor, shadow) -> None:
        vllm_config = proposer.vllm_config
        self.vllm_config = vllm_config
        #: the target's facts (``model_info.ModelInfo``; the draft head's cost with draft_vocab_size)
        self.info = proposer.info
        #: the method's policy, and its state per request id (created by the proposer)
        self.policy = proposer.policy
        self.states: dict[str, Any] = proposer.states
        #: runs layer plans, exits and heads over the target's own weights (executor.py)
        self.executor = executor
        #: batched LM-head projections of hidden rows (shadow.py)
        self.shadow = shadow
        #: measured step costs (goodput.StepCostModel): every draft step reports itself here
        self.costs = proposer.costs
        #: the engine's counters (stats.EngineStats)
        self.stats = proposer.stats
        #: drafts per request and round at most (num_speculative_tokens), and the model's length
        self.k: int = proposer.k
        self.max_model_len: int = proposer.max_model_len
        #: tensor-parallel size: decisions that differ per rank must be rank 0's (compat)
        self.tp: int = vllm_config.parallel_config.tensor_parallel_size
        #: vLLM's model runner (its device, input batch and KV caches)
        self.runner = runner
        #: draws of sampled drafts; seeded alike on every TP rank, so every rank drafts the same
        self.generator = torch.Generator()
        self.generator.manual_seed(vllm_config.model_config.seed or 0)
        self._set_forward_context, self._CommonAttentionMetadata, _ = compat.runner_internals()
        self._kv: KVGroups | None = None  # built on first use (after vLLM's KV-cache init)
        #: whether draft attention runs the paged kernel (``bind_attention``), not vLLM's backend
        self.paged = False

    # ---- attention over the target's paged KV cache --------------------------------------------
    def kv_groups(self) -> KVGroups:
        """The target's KV-cache groups with the drafter's own metadata builders (built once)."""
        if self._kv is None:
            self._kv = KVGroups(
                self.runner, self.vllm_config, self.executor.layout.attn_layer_names
            )
        return self._kv

    def bind_attention(self, mode: str) -> str | None:
        """Choose who runs draft attention (``compat.DRAFT_ATTENTION_ENV``; ``mode``: its value),
        once vLLM allocated the KV cache. Returns why the paged kernel is not used (None: it
        is). ``"paged"`` the kernel cannot serve raises ``NotImplementedError``."""
        if mode == "backend":
            return "the backend was chosen"
        if mode == "auto" and self.runner.device.type != "cuda":
            return "not on CUDA"
        try:
            draft_attention.bind_layers(self.executor.layout, self.kv_groups())
        except NotImplementedError as e:
            if mode == "paged":
                raise NotImplementedError(
                    f"selfspec: {compat.DRAFT_ATTENTION_ENV}=paged, but the paged kernel "
                    f"cannot serve this model: {e}"
                ) from e
            return str(e)
        self.paged = self.executor.paged = True
        return None

    def paged_rows(self, tables, slots, positions, req_indices, max_context: int):
        """``DraftAttention`` of rows for the paged kernel (``draft_attention.PagedRows``)."""
        rows = draft_attention.PagedRows(tables, slots, positions, req_indices, max_context)
        return DraftAttention.paged(rows, lambda n: compat.warm_up_context(self.vllm_config, n))

    def rows_attention(
        self,
        tables: list[torch.Tensor],
        q_lens: list[int],
        seq_lens: torch.Tensor,
        slots: list[torch.Tensor],
        positions: torch.Tensor,
        draft_index: int = 0,
    ) -> DraftAttention:
        """The attention of rows grouped by request (``q_lens`` consecutive rows each, the last at
        position ``seq_lens - 1``) that write their KV at ``slots``; ``tables`` and ``slots``:
        one per KV-cache group (``kv_groups.KVGroups``)."""
        if self.paged:
            dev = positions.device
            req = torch.repeat_interleave(
                torch.arange(len(q_lens), device=dev), torch.tensor(q_lens, device=dev)
            )
            return self.paged_rows(tables, slots, positions, req, int(seq_lens.max()))
        md, slot_map = self.rows_metadata(tables, q_lens, seq_lens, slots, positions, draft_index)
        return DraftAttention.backend(self.forward_context, md, int(sum(q_lens)), slot_map)

    def step_attention(self, tables: list[torch.Tensor], pos: torch.Tensor, step: int):
        """The attention of one draft step of a round: one row per request at ``pos``, each
        writing its KV there."""
        slots = self.kv_groups().slots(tables, pos)
        return self.rows_attention(
            tables, [1] * pos.shape[0], pos.cpu() + 1, slots, pos, draft_index=step
        )

    def forward_context(self, metadata, num_tokens: int, slot_mapping: dict):
        """vLLM's forward context for a partial forward of ``num_tokens`` rows: attention reads
        ``metadata`` (per layer) and writes KV at ``slot_mapping`` (per layer; {} writes none)."""
        return self._set_forward_context(
            metadata, self.vllm_config, num_tokens=num_tokens, slot_mapping=slot_mapping
        )

    def common_metadata(self, **fields):
        """vLLM's ``CommonAttentionMetadata`` (the fields of vLLM 0.32)."""
        return self._CommonAttentionMetadata(**fields)

    def rows_metadata(
        self,
        tables: list[torch.Tensor],
        q_lens: list[int],
        seq_lens: torch.Tensor,
        slots: list[torch.Tensor],
        positions: torch.Tensor,
        draft_index: int = 0,
    ):
        """Attention metadata for rows grouped by request (``q_lens`` consecutive rows each, the
        last at position ``seq_lens - 1``), for every attention layer, and its slot-mapping
        dict; ``tables`` and ``slots``: one per KV-cache group (``kv_groups.KVGroups``)."""
        dev = positions.device
        qsl_cpu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        qsl_cpu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
        seq_cpu = seq_lens.to(torch.int32).cpu()
        cm = self.common_metadata(
            query_start_loc=qsl_cpu.to(dev),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_cpu.to(dev),
            seq_lens_cpu_upper_bound=seq_cpu,
            num_reqs=len(q_lens),
            num_actual_tokens=int(qsl_cpu[-1]),
            max_query_len=max(q_lens),
            max_seq_len=int(seq_cpu.max()),
            block_table_tensor=tables[0],
            slot_mapping=slots[0],
            causal=True,
            positions=positions,
        )
        return self.kv_groups().metadata(cm, tables, slots, draft_index=draft_index)

    # ---- draft tokens ------------------------------------------------------------------------------
    def pick(self, logits, batch_rows, temps, probs, J, step: int) -> torch.Tensor:
        """Draft tokens from one draft step's ``logits`` [n, draft vocabulary] (float32) of the
        batch rows ``batch_rows``: the argmax for greedy rows; for sampled ones a draw from
        ``softmax(logits / T)``, whose distribution (over the full vocabulary) goes to
        ``probs[J, step]`` for the rejection sampler. Token ids, on the logits' device.

        A row whose logits are not all finite (a damaged head, an overflow in a shortened
        model) has no valid draft distribution: its token is ``NO_DRAFT``, its round ends
        there (the drafters keep only tokens >= 0), and ``stats.invalid_draft_rows`` counts
        it. The target's verification never sees it, so the output is what it would be."""
        valid, logits, invalid = finite_rows(logits)
        self.stats.invalid_draft_rows += invalid
        vocab_ids = self.executor.vocab_ids  # logits column -> token id (None: the identity)
        nxt = logits.argmax(dim=-1)
        if temps is not None:
            t = temps[batch_rows.to(temps.device)].to(logits.device)
            sampled_rows = t > 0
            if bool(sampled_rows.any()):
                q = torch.softmax(logits / torch.where(sampled_rows, t, 1.0)[:, None], -1)
                draw = torch.multinomial(q.cpu(), 1, generator=self.generator).squeeze(1)
                nxt = torch.where(sampled_rows, draw.to(nxt.device), nxt)
                if vocab_ids is not None:  # q over the draft vocabulary, 0 elsewhere
                    q = q.new_zeros(len(logits), self.info.vocab_size).index_copy_(1, vocab_ids, q)
                probs[J.to(probs.device), step] = q.to(probs.dtype)
        tokens = nxt if vocab_ids is None else vocab_ids[nxt]
        return torch.where(valid, tokens, NO_DRAFT)

    def count_rounds(self, drafts: list[list[int]], rows: list[int], plans=None) -> None:
        """The stats of one draft round of the batch ``rows``: the draft-length histogram, the
        rounds that drafted, and (``plans``: the rows' layer plans) which plans drafted."""
        st = self.stats
        for j, i in enumerate(rows):
            d = len(drafts[i])
            st.draft_length_hist[d] += 1
            st.draft_rounds += bool(d)
            if d and plans is not None:
                plan = plans[j]
                st.plan_hist[plan.describe()] += 1
                st.plans[plan] += 1
                st.skipped_attn += plan.num_layers - sum(plan.attn)
                st.skipped_mlp += plan.num_layers - sum(plan.mlp)


class Drafter:
    """One drafting strategy (see the module docstring). Subclasses implement ``draft``; the
    other hooks default to nothing."""

    def __init__(self, ctx: DraftContext) -> None:
        self.ctx = ctx

    def step_inputs(self, sampled_token_ids, sample_hidden_states, spec_decode_metadata) -> None:
        """Every step, before any other hook: what the step sampled, the model's output at its
        logits rows, and what it verified (vLLM's spec-decode metadata, None: nothing)."""

    def verified(
        self, req_id: str, n_drafted: int, n_accepted: int, sampled: list[int], feedback
    ) -> None:
        """The request's last round was verified this step (``n_drafted`` 0: it drafted none
        from this drafter): count what the drafter's stats need, and add to ``feedback``
        (``policies.Feedback``, handed to the policy after this) what its policy learns from."""

    def draft(self, runner, active, sampling_metadata, probs, drafts: list[list[int]]) -> None:
        """One draft round for the ``active`` requests ((batch row, decision, max drafts)): append
        each row's drafts to ``drafts[row]`` and, for sampled requests, the q each draft was
        drawn from to ``probs[j, step]`` (j: the request's index in ``active``; None: all
        greedy). Report each draft step to ``ctx.costs.add_draft``."""
        raise NotImplementedError(f"{type(self).__name__} must implement draft")

    def target_forward(self, runner, input_ids, positions):
        """The next target forward, in place of the model's own (None: the model's own)."""
        return None

    def forget(self, req_id: str) -> None:
        """The request finished or was removed: drop what is kept of it."""

    def describe(self) -> dict:
        """The drafter's own figures for the engine's stats (``vllm_selfspec.get_stats``)."""
        return {}

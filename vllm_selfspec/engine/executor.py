"""Run a LayerPlan on the target model's own modules (the partial forward of a draft step).

Sub-layers run in vLLM's fused (pending, residual) form: a decoder layer returns
``(pending_delta, residual)`` and the next fused add+RMSNorm folds the pending delta into the
residual stream. Skipping a sub-layer leaves the pending delta for the next norm. With nothing
skipped this is bit-identical to the model's own decoder-layer forward (the textbook
``x + f(norm(x))`` is not). The family's norms and blocks come from its layout adapter
(``layouts.model_layout``: Llama/Mistral/Qwen, Gemma 2/3). Must run inside vLLM's forward
context (attention finds its KV cache and metadata there).

Compiled (``PlanExecutor(model, compile_options=...)``, in vLLM's default mode, unless
``VLLM_SELFSPEC_COMPILE_DRAFTS=0``: ``compat.compiles_drafts``): each decoder
layer, and each attention or MLP sub-layer, runs through one ``torch.compile``d function shared
by every layer (*regional* compilation: a layer's weights are its inputs, and vLLM's attention op
takes its layer's name as an input, not a constant), so a draft of any depth, plan, exit walk or
deferred round reuses a handful of graphs, compiled once at start-up (``warm_up``): token
counts are dynamic (one graph for a single row, one for more).
"""

from __future__ import annotations

import torch

from ..compat import linear
from ..plans import LM_HEAD, LayerPlan
from . import draft_attention
from .layouts import model_layout


def _norm(norm, h: torch.Tensor, res: torch.Tensor | None):
    if res is None:  # first sub-layer: the residual stream starts as the embeddings
        return norm(h), h
    return norm(h, res)


# The functions the executor compiles (regionally: one graph serves every layer). Eagerly they
# are plain calls. ``res`` is never None in a compiled call (``PlanExecutor._stream``), so one
# graph serves the first layer too. ``paged``: attention is the drafter's own paged kernel
# (engine/draft_attention.py), a constant of the graph.
def whole_layer(lay, layer, positions, h, res, paged=False):
    """A whole decoder layer: vLLM's own forward, ``(pending, residual)``; paged, its two
    sub-layers (the same operations)."""
    if not paged:
        return layer(positions, h, res)
    h, res = attn_sublayer(lay, layer, positions, h, res, True)
    return mlp_sublayer(lay, layer, h, res)


def attn_sublayer(lay, layer, positions, h, res, paged=False):
    """The attention sub-layer of ``layer`` alone (the MLP's pending delta is left for later)."""
    x, res = _norm(lay.attn_norm(layer), h, res)
    return lay.attn(layer, positions, x, paged), res


def mlp_sublayer(lay, layer, h, res):
    """The MLP sub-layer of ``layer`` alone."""
    x, res = _norm(lay.mlp_norm(layer), h, res)
    return lay.mlp(layer, x), res


class PlanExecutor:
    def __init__(self, model, compile_options: dict | None = None) -> None:
        self.layout = model_layout(model)
        self.num_layers = len(self.layout.layers)
        #: whether draft forwards run compiled (``compile_options``: Inductor's options; None:
        #: eager), and the three layer functions they run through
        self.compiled = compile_options is not None
        #: whether draft forwards may run the paged attention kernel (``engine/draft_attention``;
        #: set once its cache views are bound): the layer functions are compiled for it too
        self.paged = False
        self.whole_layer, self.attn_sublayer, self.mlp_sublayer = (
            (whole_layer, attn_sublayer, mlp_sublayer)
            if compile_options is None
            else tuple(
                torch.compile(f, dynamic=True, options=compile_options)
                for f in (whole_layer, attn_sublayer, mlp_sublayer)
            )
        )
        #: trained exit heads by name (``plan.head``): modules with ``transform(x) -> x'`` on the
        #: pre-norm residual stream; the model's own final norm + LM head then give the logits.
        #: ``"lm_head"`` (no transform) is always there.
        self.heads: dict[str, torch.nn.Module] = {}
        #: the reduced draft vocabulary (``set_draft_vocab``): logits column j is token
        #: ``vocab_ids[j]``; None = the full vocabulary (column j is token j)
        self.vocab_ids: torch.Tensor | None = None
        self.vocab_weight: torch.Tensor | None = None  # their LM-head rows

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Draft logits over the tokens ``ids`` only (their LM-head rows, copied once)."""
        self.vocab_weight = self.layout.lm_head_rows(ids)
        self.vocab_ids = ids.to(self.vocab_weight.device)
        self._vocab_linear = linear(self.vocab_weight)

    def run(
        self, plan: LayerPlan, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(pending, residual)`` after the plan's last layer (the stream is their sum)."""
        h = self.layout.embed(input_ids)
        return self.run_layers(plan, h, self._stream(h), positions, 0, plan.exit_layer)

    def set_capture_layers(self, layers: tuple[int, ...]) -> None:
        """The target forward also returns the residual stream after ``layers`` (the family's
        hook; where the family has none, its forward runs through ``whole_layer``)."""
        run = None
        if self.compiled:  # the target's forward: vLLM's attention, under the runner's metadata

            def run(layer, positions, h, res):
                return self.whole_layer(self.layout, layer, positions, h, res)

        self.layout.set_capture_layers(layers, run)

    def _stream(self, h: torch.Tensor) -> torch.Tensor | None:
        """The residual stream entering the first layer: None (vLLM's own first-layer form)
        eagerly; zeros when compiled (``h + 0 == h``, and one graph serves every layer)."""
        return torch.zeros_like(h) if self.compiled else None

    @torch.inference_mode()
    def warm_up(self, context, hidden_size: int, dtype, device) -> None:
        """Compiles the layer functions for one row and for several, before serving (else the
        first draft steps would): under ``context(num_tokens)``, a forward context without
        attention metadata, where attention returns at once and writes no KV."""
        if not self.compiled:
            return
        lay = self.layout
        for n in (1, 2):
            h = torch.zeros(n, hidden_size, dtype=dtype, device=device)
            pos = torch.zeros(n, dtype=torch.long, device=device)
            with context(n):
                # every layer: a family whose layers differ (Gemma's sliding and global ones)
                # compiles each kind here; the others only pass the graphs' guards. Paged:
                # vLLM's attention too (AdaDecode finishes rounds in the target's forward)
                for layer in lay.layers:
                    for paged in (False, True) if self.paged else (False,):
                        self.whole_layer(lay, layer, pos, h, h.clone(), paged)
                        self.attn_sublayer(lay, layer, pos, h, h.clone(), paged)
                    self.mlp_sublayer(lay, layer, h, h.clone())

    def run_layers(
        self,
        plan: LayerPlan,
        h: torch.Tensor,
        res: torch.Tensor | None,
        positions: torch.Tensor,
        start: int,
        end: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The plan's sub-layers of layers ``start .. end-1`` on ``(pending, residual)``."""
        lay = self.layout
        paged = draft_attention.active()
        for i in range(start, end):
            layer = lay.layers[i]
            run_attn, run_mlp = plan.attn[i], plan.mlp[i]
            if run_attn and run_mlp:
                h, res = self.whole_layer(lay, layer, positions, h, res, paged)
                continue
            if run_attn:
                h, res = self.attn_sublayer(lay, layer, positions, h, res, paged)
            if run_mlp:
                h, res = self.mlp_sublayer(lay, layer, h, res)
        return h, res

    def run_mixed(
        self, plans: list[LayerPlan], input_ids: torch.Tensor, positions: torch.Tensor, context
    ) -> list[torch.Tensor]:
        """One draft step of B rows with different plans, in one pass: each sub-layer runs once,
        on the rows whose plan includes it (attention under ``context(rows)``, the forward
        context of those rows' attention metadata); a row leaves at its plan's exit through its
        head. Returns each row's logits over the draft vocabulary.

        The residual stream starts at zero for every row (``h + 0 == h``), so rows whose first
        sub-layers differ share one tensor; uniform groups use ``run`` (bit-identical to vLLM)."""
        h = self.layout.embed(input_ids)
        res = torch.zeros_like(h)
        logits: list[torch.Tensor | None] = [None] * len(plans)
        depth = max(p.exit_layer for p in plans)
        with context(list(range(len(plans)))):  # for the sub-layers other than attention
            self._run_mixed_layers(plans, h, res, positions, context, depth, logits)
        return logits

    def _run_mixed_layers(self, plans, h, res, positions, context, depth, logits) -> None:
        everyone = list(range(len(plans)))
        for i in range(depth):
            layer = self.layout.layers[i]
            attn = [r for r, p in enumerate(plans) if p.exit_layer > i and p.attn[i]]
            mlp = [r for r, p in enumerate(plans) if p.exit_layer > i and p.mlp[i]]
            if attn == mlp == everyone:  # the whole layer on every row: vLLM's own forward
                h, res = self.whole_layer(
                    self.layout, layer, positions, h, res, draft_attention.active()
                )
            else:
                for rows, is_attn in ((attn, True), (mlp, False)):
                    if rows:
                        h, res = self._sublayer(layer, is_attn, rows, h, res, positions, context)
            for plan in dict.fromkeys(p for p in plans if p.exit_layer == i + 1):
                rows = [r for r, p in enumerate(plans) if p == plan]
                idx = torch.tensor(rows, device=h.device)
                out = self.logits(plan, h[idx], res[idx])
                for j, r in enumerate(rows):
                    logits[r] = out[j]

    def _sublayer(self, layer, attn: bool, rows, h, res, positions, context):
        """One attention or MLP sub-layer on ``rows`` only (the others keep their pending
        delta for a later norm)."""
        lay = self.layout
        idx = torch.tensor(rows, device=h.device)
        if attn:
            with context(rows):
                x, r = self.attn_sublayer(
                    lay, layer, positions[idx], h[idx], res[idx], draft_attention.active()
                )
        else:
            x, r = self.mlp_sublayer(lay, layer, h[idx], res[idx])
        h, res = h.clone(), res.clone()
        h[idx], res[idx] = x, r
        return h, res

    def run_cascade(
        self,
        plan: LayerPlan,
        exits,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        max_exit: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor, int]:
        """One Cascade draft step for B rows: ``(logits [B, V'] or None when no row exits,
        exit index per row or -1, layers run)``. Row b walks ``exits[0 .. max_exit[b]]``
        shallowest first and takes the first exit whose confidence clears its threshold; all rows
        go deeper together while any is undecided (rows with no exit get logits of zeros; the
        caller drops them)."""
        h, start = self.layout.embed(input_ids), 0
        res = self._stream(h)
        chosen = torch.full((input_ids.shape[0],), -1, dtype=torch.long, device=h.device)
        max_exit = max_exit.to(h.device)
        logits = None
        for e, ex in enumerate(exits):
            h, res = self.run_layers(plan, h, res, positions, start, ex.layer)
            start = ex.layer
            x = h if res is None else h + res
            head = self.heads[ex.head]
            go = (chosen < 0) & (max_exit >= e) & (head.confidence(x) >= ex.threshold)
            if bool(go.any()):
                rows = go.nonzero().squeeze(1)
                out = self.project(self.layout.norm(head.transform(x.index_select(0, rows))))
                if logits is None:
                    logits = out.new_zeros(input_ids.shape[0], out.shape[1])
                logits[rows] = out
                chosen[rows] = e
            if not bool(((chosen < 0) & (max_exit > e)).any()):
                break
        return logits, chosen, start

    def logits(self, plan: LayerPlan, h: torch.Tensor, res: torch.Tensor | None) -> torch.Tensor:
        """Logits of the plan's head over the draft vocabulary (see ``vocab_ids``). The LM-head
        path uses the model's fused final add+RMSNorm, bit-identical to the target's own last
        step (over the full vocabulary)."""
        if plan.head == LM_HEAD:
            x = _norm(self.layout.norm, h, res)[0]
        else:
            head = self.heads.get(plan.head)
            if head is None:
                raise KeyError(f"plan asks for head {plan.head!r}, loaded: {sorted(self.heads)}")
            x = self.layout.norm(head.transform(h if res is None else h + res))
        return self.project(x)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Final-normed rows -> logits over the draft vocabulary."""
        if self.vocab_weight is None:
            return self.layout.compute_logits(x)
        lay = self.layout
        logits = self._vocab_linear(x)
        if lay.logit_soft_cap is not None:  # as vLLM's LogitsProcessor
            logits = torch.tanh(logits / lay.logit_soft_cap) * lay.logit_soft_cap
        return logits * lay.logit_scale if lay.logit_scale != 1.0 else logits

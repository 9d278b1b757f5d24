"""KnapSpec: training-free attention/MLP sub-layer skipping chosen by a knapsack DP (the KnapSpec
paper, §3, Algorithm 1; the search itself is in ``knapspec_knapsack.py``).

Per request:

* **Data.** The engine hands over the residual stream entering the first layer (the embeddings,
  ``capture_layers = (0,)``) of the verified rows, with the tokens they predict; the policy keeps
  the rows of the last ``history_rounds`` rounds (m; the prompt's last ``capture_tokens`` rows at
  prefill). The rows of consecutive rounds are consecutive positions; a gap (e.g. after a
  preemption) restarts the history. The full model's states after each sub-layer, which the DP
  compares against, are computed inside the search (one more member of each batched sub-layer
  call, over the request's KV cache) rather than captured at every layer of every target forward:
  that capture cost 3-6% of the target's step at batch 16 on the CPU (docs/methods.md, "`knapspec`"), while
  the search runs once per ``interval`` steps.
* **Optimisation** every ``interval`` steps (T), at the first step, and whenever the context has
  grown enough that the knapsack weights (w_attn, w_mlp) at the current length change: the engine
  runs ``optimise`` with sub-layers on the live model over the request's own KV cache; the DP
  (τ = ``tau``) and the TPT grid search over γ ≤ D (``num_speculative_tokens``) pick the skip set
  and draft length. The sub-layer latency model is measured by the engine at start-up.
* **Before its own search** a request drafts with the latest search's choice (any request's):
  under the goodput controller searches wait for their time budget (``goodput.SearchBudget``,
  smaller while the controller chooses no self-draft: ``GoodputController.feedback_allowed``),
  and the skip set that suits one request of a model is a good start for the next.
* **Drafting** with that skip set for γ tokens, stopping early when a draft token's top-1
  probability falls below ``min_confidence`` (0.7; dynamic draft exit).

Every decision is a pure function of replicated data (captured hidden states are all-reduced,
sampled tokens, context lengths) plus rank 0's latency model and step costs, so TP ranks agree.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model_info import ModelInfo
from ..plans import LayerPlan
from . import knapspec_knapsack
from .base import DraftDecision, Feedback, Policy
from .options import is_int, is_number


@dataclass
class KnapSpecState:
    #: (first position, embeddings [1, m, d]) of the last rounds that captured rows
    rounds: deque = field(default_factory=deque)
    steps: int = 0  # steps since the last optimisation
    context_len: int = 0
    decision: DraftDecision | None = None
    choice: knapspec_knapsack.Choice | None = None

    @property
    def num_rows(self) -> int:
        return sum(h.shape[1] for _, h in self.rounds)


def _number(config: dict, key: str, lo: float, hi: float, integer: bool, allow_none: bool = False):
    v = config[key]
    if v is None and allow_none:
        return None
    ok = is_int(v) if integer else is_number(v)
    if not ok or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        extra = " or null (off)" if allow_none else ""
        raise ValueError(f"knapspec: {key} must be {kind} in [{lo}, {hi}]{extra}, got {v!r}")
    return v


class KnapSpecPolicy(Policy):
    name = "knapspec"
    options = {"interval": 64, "history_rounds": 5, "tau": 0.5, "min_confidence": 0.7}
    #: D = 10 (the paper's); 16 prompt rows seed the first search (its cost grows with the rows)
    # draft_vocab_size "auto": the reduced draft vocabulary when the model has a map (measured
    # faster: docs/methods.md, "Cheap draft steps")
    common_defaults = {
        "num_speculative_tokens": 10,
        "capture_tokens": 16,
        "draft_vocab_size": "auto",
    }
    timed = True
    needs_latency = True

    @classmethod
    def validate(
        cls, config: dict[str, Any], model: ModelInfo, heads: dict[str, Any] | None = None
    ) -> None:
        _number(config, "interval", 1, 10**9, integer=True)
        _number(config, "history_rounds", 1, 10**4, integer=True)
        _number(config, "tau", -1.0, 1.0, integer=False)
        _number(config, "min_confidence", 0.0, 1.0, integer=False, allow_none=True)

    def setup(self) -> None:
        self.validate(self.config, self.model)
        self.interval = int(self.config["interval"])
        self.history_rounds = int(self.config["history_rounds"])
        self.tau = float(self.config["tau"])
        conf = self.config["min_confidence"]
        self.min_confidence = None if conf is None else float(conf)
        L = self.model.num_layers
        #: the rows' embeddings only: the DP computes the full model's states itself
        self.capture_layers = (0,)
        self.no_draft = DraftDecision(LayerPlan.full(L), 0)
        #: the latest search's decision: a request drafts with it until its own search
        self.latest: DraftDecision | None = None

    def new_state(self) -> KnapSpecState:
        return KnapSpecState()

    def observe(self, state: KnapSpecState, feedback: Feedback) -> None:
        state.steps += 1
        state.context_len = feedback.context_len
        if feedback.hidden is None or feedback.hidden.shape[1] == 0:
            return
        m = feedback.hidden.shape[1]
        first = feedback.context_len - m - 1  # row t predicts token n-m+t: it sits at n-m-1+t
        if state.rounds:
            p, h = state.rounds[-1]
            if p + h.shape[1] != first:  # not contiguous with the history: start over
                state.rounds.clear()
        state.rounds.append((first, feedback.hidden.clone()))  # own it: the view pins the batch
        while len(state.rounds) > self.history_rounds:
            state.rounds.popleft()

    def wants_optimise(self, state: KnapSpecState) -> bool:
        if not state.rounds:
            return False
        if state.choice is None or state.steps >= self.interval:
            return True
        lat = self.latency
        return lat is not None and lat.weights(state.context_len) != state.choice.weights

    def verify_ratio(self) -> list[float] | None:
        """Verification of γ drafts relative to a plain step, from the engine's measured costs."""
        if self.costs is None:
            return None
        base = self.costs.verify_seconds(1)
        if base is None:
            return None
        return [self.costs.verify_seconds(g + 1) / base for g in range(self.max_draft_tokens + 1)]

    def optimise(self, state: KnapSpecState, model: Any) -> None:
        if self.latency is None:
            raise RuntimeError("knapspec: the engine must set the latency model before optimise")
        first = state.rounds[0][0]
        hidden = torch.cat([h for _, h in state.rounds], dim=1)  # [1, r, d]
        positions = torch.arange(first, first + hidden.shape[1])
        refs = {0: hidden[0]}  # X(k), k > 0: the full model's sub-layers, run by the DP
        choice = knapspec_knapsack.search(
            refs,
            lambda s, x: model.sublayer(s, x, positions),
            model.predict,
            self.latency,
            self.model.num_layers,
            state.context_len,
            self.max_draft_tokens,
            self.tau,
            self.verify_ratio(),
            model.predict_target,
        )
        state.choice, state.steps = choice, 0
        if choice.gamma == 0:
            state.decision = self.no_draft
        else:
            plan = LayerPlan.skip(self.model.num_layers, choice.skip_attn, choice.skip_mlp)
            state.decision = DraftDecision(plan, choice.gamma, self.min_confidence)
        self.latest = state.decision

    def propose(self, state: KnapSpecState) -> DraftDecision:
        return state.decision or self.latest or self.no_draft

    def describe(self) -> dict[str, Any]:
        return {
            "method": self.name,
            "interval": self.interval,
            "history_rounds": self.history_rounds,
            "tau": self.tau,
            "min_confidence": self.min_confidence,
            "d_max": self.max_draft_tokens,
            "latency": None if self.latency is None else self.latency.to_dict(),
        }

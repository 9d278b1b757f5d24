"""LayerSkip: a static plan and a static draft length — the LS(E-γ) baseline of the DEL paper.

* ``exit_layer: E``  draft with the first E decoder layers, then the model's final norm + LM head
  (``E == num_layers`` is the full model: the correctness canary, 100% acceptance);
* ``skip_attn`` / ``skip_mlp``: 0-based layer indices whose attention / MLP sub-layer the draft
  skips (a fixed skip set; with no ``exit_layer`` the draft runs to the last layer);
* the draft length is the config's ``num_speculative_tokens`` every round.
"""

from __future__ import annotations

from typing import Any

from ..model_info import ModelInfo
from ..plans import LayerPlan
from .base import DraftDecision, Policy
from .options import is_int, is_int_list


class LayerSkipPolicy(Policy):
    name = "layerskip"
    options = {"exit_layer": None, "skip_attn": [], "skip_mlp": []}

    @classmethod
    def validate(
        cls, config: dict[str, Any], model: ModelInfo, heads: dict[str, Any] | None = None
    ) -> None:
        cls.make_plan(config, model)

    @staticmethod
    def make_plan(config: dict[str, Any], model: ModelInfo) -> LayerPlan:
        L = model.num_layers
        for key in ("skip_attn", "skip_mlp"):
            if config[key] is not None and not is_int_list(config[key]):
                raise ValueError(
                    f"layerskip: {key} must be a list of 0-based layer indices, got {config[key]!r}"
                )
        skip_attn = list(config["skip_attn"] or [])
        skip_mlp = list(config["skip_mlp"] or [])
        E = config["exit_layer"]
        if E is None:
            E = L if (skip_attn or skip_mlp) else max(1, L // 2)
        if not is_int(E) or not 1 <= E <= L:
            raise ValueError(
                f"layerskip: exit_layer must be an integer in [1, {L}] for this {L}-layer "
                f"model (E = {L} is the full model), got {E!r}"
            )
        for key, lst in (("skip_attn", skip_attn), ("skip_mlp", skip_mlp)):
            bad = [i for i in lst if not is_int(i) or not 0 <= i < E]
            if bad:
                raise ValueError(
                    f"layerskip: {key} must hold 0-based layer indices below exit_layer={E} "
                    f"(the model has {L} layers), got {bad}"
                )
        return LayerPlan.skip(L, skip_attn, skip_mlp, exit_layer=E)

    def setup(self) -> None:
        self.decision = DraftDecision(
            self.make_plan(self.config, self.model), self.max_draft_tokens
        )

    def propose(self, state: Any) -> DraftDecision:
        return self.decision

    def describe(self) -> dict[str, Any]:
        return {
            "method": self.name,
            "plan": self.decision.plan.describe(),
            "num_speculative_tokens": self.max_draft_tokens,
        }

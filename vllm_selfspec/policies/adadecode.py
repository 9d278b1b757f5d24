"""AdaDecode: early predictions from lightweight intermediate LM heads, with the early tokens'
deeper layers deferred and run once, in parallel with the next tokens (AdaDecode §2).

A token goes through the layers one by one; after each layer with a trained head (a d×d matrix
``T`` in front of the model's own final norm and LM head, model frozen:
``vllm-selfspec train-heads --kind adadecode``) the head predicts the next token. If that
token's probability exceeds ``threshold`` (γ) the next token starts at layer 0 at once, and the
early token's remaining layers wait: they run together with the next tokens' passes over those
layers, and the last of them in the next target forward, which also verifies the early tokens
with the full model (greedy: equality; sampling: min(1, p/q) with residual resampling; vLLM's
rejection sampler). The output is exactly vanilla vLLM's. The schedule is
``adadecode_schedule.py`` (beside this file); the engine side ``engine/drafters/adadecode.py``.

Options:

* ``heads``: "auto" (the model's cached AdaDecode heads; a clear error saying how to train them
  when there are none) or a head directory;
* ``threshold``: γ, in (0, 1] (default 0.85, the paper's; 1 never predicts early);
* ``exit_layers``: the heads to use (default: every trained one), a subset of the heads' layers;
* ``num_speculative_tokens``: the most early predictions per round (default 5, the paper's limit);
* ``draft_vocab_size``: "auto" by default: the heads' logits over the model's 4096 most frequent
  tokens when its map is cached (the confidence is then a probability over those tokens).

There is no per-request statistic: the paper's rule is a fixed threshold.
"""

from __future__ import annotations

from typing import Any

from ..model_info import ModelInfo
from ..plans import LayerPlan
from .base import DraftDecision, Policy
from .options import is_int_list, is_number


class AdaDecodePolicy(Policy):
    name = "adadecode"
    options = {"heads": "auto", "threshold": 0.85, "exit_layers": None}
    common_defaults = {"num_speculative_tokens": 5, "draft_vocab_size": "auto"}
    #: every draft walk evaluates a head at each exit it passes, so the head's cost counts more
    #: than for other methods: 4096 tokens measured faster than 8192 at the same acceptance
    #: (docs/methods.md, "`adadecode`")
    auto_draft_vocab_size = 4096
    #: the engine drafts with the deferred-layer schedule and resumes the rows in the next target
    #: forward (engine/drafters/adadecode.py) instead of drafting with a layer plan
    deferred = True
    drafter = "deferred"
    head_kind = "adadecode"

    @staticmethod
    def exits(config: dict[str, Any], heads: dict[str, Any] | None) -> tuple[int, ...]:
        """The configured exits among the heads' layers (empty without ``heads``)."""
        if heads is None:
            return ()
        trained = tuple(sorted(int(layer) for layer in heads["layers"]))
        layers = config["exit_layers"]
        if layers is None:
            return trained
        if not is_int_list(layers) or not layers or any(x not in trained for x in layers):
            raise ValueError(
                f"adadecode: exit_layers must be a non-empty subset of the trained "
                f"heads' layers {list(trained)}, got {layers!r}"
            )
        return tuple(sorted(set(layers)))

    @classmethod
    def validate(
        cls, config: dict[str, Any], model: ModelInfo, heads: dict[str, Any] | None = None
    ) -> None:
        cls.exits(config, heads)
        t = config["threshold"]
        if not is_number(t) or not 0 < t <= 1:
            raise ValueError(f"adadecode: threshold (γ) must be in (0, 1], got {t!r}")

    def setup(self) -> None:
        self.validate(self.config, self.model, self.heads)
        self.exit_layers = self.exits(self.config, self.heads)
        if not self.exit_layers:
            raise ValueError(
                "adadecode: heads must be resolved to a directory before the engine "
                "starts (SelfSpecConfig.resolved)"
            )
        #: the engine loads these heads into its head slots ("heads@<layer>")
        self.heads_path = self.config["heads"]
        self.threshold = float(self.config["threshold"])
        # the plan is only the engine's record of the deepest layer a draft walk reaches
        self.decision = DraftDecision(
            LayerPlan.prefix(
                self.model.num_layers, self.exit_layers[-1], f"heads@{self.exit_layers[-1]}"
            ),
            self.max_draft_tokens,
        )

    def head_for_layer(self, layer: int) -> str:
        return f"heads@{layer}"

    def propose(self, state: Any) -> DraftDecision:
        return self.decision

    def describe(self) -> dict[str, Any]:
        return {
            "method": self.name,
            "heads": self.heads_path,
            "threshold": self.threshold,
            "exit_layers": list(self.exit_layers),
            "num_speculative_tokens": self.max_draft_tokens,
        }

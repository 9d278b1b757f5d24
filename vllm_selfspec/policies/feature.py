"""Feature heads: draft from the token's embedding and the final layer's output at the verified
position, through a trained head, the model's own final norm and LM head; no decoder layer runs.

A feature head (``vllm-selfspec train-heads --kind feature``; ``heads.FeatureHead``) at exit 0
reads two things the engine already has: the embedding of the token just sampled, and the target's
final-layer output at the position that sampled it (what the last verification computed, as
Hydra's and EAGLE's draft heads read it). Draft token j reads the embedding of draft j-1 and the
same final-layer output, j positions back (the head is trained for offsets 1..max_offset; later
drafts reuse the last). On the embedded model it agrees with the final layer about as often as the
Cascade adapter at exit 8 (docs/heads.md, "Feature heads") at a fraction of the draft's cost: a
draft step is one adapter and one LM-head pass over the batch's rows. The draft length per round
is the goodput controller's to cut, from the measured acceptance per draft position.

Options:

* ``heads``: "auto" (the model's cached feature heads; a clear error saying how to train them when
  there are none) or a head directory. The heads must have an exit at layer 0: the engine drafts
  only there (heads at deeper exits are for ``eval-heads``);
* ``num_speculative_tokens``: the most drafts per round (default 3);
* ``draft_vocab_size``: "auto" by default (the model's 8192 most frequent tokens when its map is
  cached: the LM-head pass is most of a draft step).
"""

from __future__ import annotations

from typing import Any

from ..model_info import ModelInfo
from ..plans import LayerPlan
from .base import DraftDecision, Policy

#: the exit the engine drafts feature heads at: the embeddings (no decoder layer runs)
EXIT = 0


class FeaturePolicy(Policy):
    name = "feature"
    options = {"heads": "auto"}
    common_defaults = {"num_speculative_tokens": 3, "draft_vocab_size": "auto"}
    head_kind = "feature"
    #: the engine drafts with engine/drafters/feature.py (the head on the embedding and the
    #: target's final-layer output) instead of running a layer plan
    drafter = "feature"

    @classmethod
    def validate(
        cls, config: dict[str, Any], model: ModelInfo, heads: dict[str, Any] | None = None
    ) -> None:
        if heads is not None and EXIT not in [int(layer) for layer in heads["layers"]]:
            raise ValueError(
                f"feature: the heads have exits {heads['layers']}; the engine drafts feature "
                f"heads at exit {EXIT} only (the token's embedding: no decoder layer runs); "
                f"train them with `vllm-selfspec train-heads --kind feature --layers {EXIT}`"
            )

    def setup(self) -> None:
        if self.heads is None:
            raise ValueError(
                "feature: heads must be resolved to a directory before the engine starts "
                "(SelfSpecConfig.resolved)"
            )
        self.validate(self.config, self.model, self.heads)
        #: the engine loads these heads into its head slots ("heads@<layer>")
        self.heads_path = self.config["heads"]
        # the plan is the engine's record of what a draft runs: no layer, then the head
        self.decision = DraftDecision(
            LayerPlan.prefix(self.model.num_layers, EXIT, f"heads@{EXIT}"), self.max_draft_tokens
        )

    def propose(self, state: Any) -> DraftDecision:
        return self.decision

    def describe(self) -> dict[str, Any]:
        return {
            "method": self.name,
            "heads": self.heads_path,
            "exit_layer": EXIT,
            "num_speculative_tokens": self.max_draft_tokens,
        }

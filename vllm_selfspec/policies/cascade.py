"""Cascade: CascadeExit's trained exit adapters and confidence estimators as a drafter.

Each draft token walks the exits from the shallowest to the deepest (CascadeExit §3.3): after the
exit's layers, the exit's confidence estimator says whether its adapter's top-1 would equal the
full model's; at the first exit whose confidence clears its threshold the token is drafted from
that exit's adapter (+ the model's own final norm and LM head). If no exit clears its threshold
the request's draft round ends there. vLLM then verifies the drafts with the full model, so the
output is exactly vanilla vLLM's (the paper's §8.5 hybrid: cascade as the drafter of a
speculative loop over one shared paged KV cache).

Within a round a draft token exits no deeper than the previous one did (the first token may
use every exit): a deeper exit would attend, in the layers past the previous token's exit, to KV
slots that token never wrote. On the embedded model, letting tokens go deeper cut acceptance from
30% to 8% at the trained thresholds. The round ends at the first token with no confident exit up
to that cap. The engine runs the rows of one draft step together, layer by layer, and goes deeper
only while some row is still undecided (rows that exited ride along; memory-bound steps cost
little more per row).

Options:

* ``heads``: "auto" (the model's cached cascade heads; a clear error saying how to train them when
  there are none) or a head directory (``vllm-selfspec train-heads --kind cascade``);
* ``exit_layers``: the exits to use (default: every trained exit), a subset of the heads' layers;
* ``thresholds``: null (the trained, F1-selected thresholds), one number for every exit, or
  ``{"layer": threshold}`` overriding some of them;
* ``num_speculative_tokens``: the most tokens a round drafts (default 6);
* ``draft_vocab_size``: "auto" by default (the adapters' logits over the model's 8192 most
  frequent tokens when its map is cached; see config.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..plans import LayerPlan
from .base import DraftDecision, ModelInfo, Policy

HEAD_KIND = "cascade"


@dataclass(frozen=True)
class CascadeExit:
    layer: int  # decoder layers run before this exit
    head: str  # the engine's head slot ("heads@<layer>")
    threshold: float  # exit when the estimator's confidence >= threshold


def _train_hint(model_path: str | None = None) -> str:
    model = f" --model {model_path} --out HEADS_DIR" if model_path else ""
    return (f"train them once with `vllm-selfspec train-heads --kind {HEAD_KIND}{model}` "
            f"(about 10 minutes on a CPU for the embedded model), then pass "
            f"\"heads\": HEADS_DIR or leave \"heads\": \"auto\" for the embedded model")


class CascadePolicy(Policy):
    name = "cascade"
    options = {"heads": "auto", "exit_layers": None, "thresholds": None}
    # the reduced draft vocabulary when the model has a map, as DEL and KnapSpec
    common_defaults = {"num_speculative_tokens": 6, "draft_vocab_size": "auto"}

    @classmethod
    def resolve(cls, config: dict[str, Any], model_path: str) -> dict[str, Any]:
        if config.get("heads", "auto") == "auto":
            from ..models import cached_heads

            found = cached_heads(model_path, HEAD_KIND)
            if found is None:
                raise ValueError(f"cascade: no trained cascade heads are cached for the model "
                                 f"{model_path}; {_train_hint(model_path)}")
            config["heads"] = str(found)
        return config

    @staticmethod
    def _heads_config(config: dict[str, Any], model: ModelInfo) -> dict[str, Any] | None:
        """The heads' config.json, checked against the model (None while still "auto")."""
        heads = config.get("heads", "auto")
        if heads == "auto":
            return None
        if not isinstance(heads, str) or not heads:
            raise ValueError(f"cascade: heads must be \"auto\" or a head directory, got {heads!r}")
        from ..heads.io import read_config

        try:
            hc = read_config(heads)
        except ValueError as e:
            raise ValueError(f"cascade: heads: {e}; {_train_hint()}") from e
        if hc.get("kind") != HEAD_KIND:
            raise ValueError(f"cascade: the heads in {heads} are of kind {hc.get('kind')!r}; "
                             f"cascade needs kind {HEAD_KIND!r} (adapters with confidence "
                             f"estimators): {_train_hint()}")
        base = hc["base_model"]
        for key in ("num_layers", "hidden_size", "vocab_size"):
            if base[key] != getattr(model, key):
                raise ValueError(f"cascade: the heads in {heads} were trained for a model with "
                                 f"{key}={base[key]}, this model has {getattr(model, key)}")
        return hc

    @classmethod
    def exits(cls, config: dict[str, Any], model: ModelInfo) -> tuple[CascadeExit, ...]:
        """The configured exits, shallowest first (empty while ``heads`` is still "auto")."""
        hc = cls._heads_config(config, model)
        if hc is None:
            return ()
        trained = {int(layer): float(t) for layer, t in (hc.get("thresholds") or {}).items()}
        layers = config.get("exit_layers")
        if layers is None:
            layers = sorted(trained)
        bad = [x for x in layers if x not in trained]
        if not layers or bad:
            raise ValueError(f"cascade: exit_layers must be a non-empty subset of the trained "
                             f"exits {sorted(trained)}, got {layers!r}")
        over = config.get("thresholds")
        if over is None:
            over = {}
        elif isinstance(over, (int, float)) and not isinstance(over, bool):
            over = {str(layer): over for layer in layers}
        if not isinstance(over, dict):
            raise ValueError(f"cascade: thresholds must be null, a number or {{\"layer\": "
                             f"number}}, got {over!r}")
        thresholds = dict(trained)
        for key, t in over.items():
            if not str(key).isdigit() or int(key) not in trained:
                raise ValueError(f"cascade: thresholds names exit {key!r}; trained exits are "
                                 f"{sorted(trained)}")
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t <= 1:
                raise ValueError(f"cascade: the threshold of exit {key} must be in [0, 1], "
                                 f"got {t!r}")
            thresholds[int(key)] = float(t)
        return tuple(CascadeExit(layer, f"heads@{layer}", thresholds[layer])
                     for layer in sorted(set(layers)))

    @classmethod
    def validate(cls, config: dict[str, Any], model: ModelInfo) -> None:
        cls.exits(config, model)

    def __init__(self, config: dict[str, Any], model: ModelInfo, max_draft_tokens: int) -> None:
        super().__init__(config, model, max_draft_tokens)
        self.cascade = self.exits(config, model)
        if not self.cascade:
            raise ValueError("cascade: heads must be resolved to a directory before the engine "
                             "starts (SelfSpecConfig.resolved)")
        #: the engine loads these heads into its head slots
        self.heads_path = config["heads"]
        deepest = self.cascade[-1]
        self.decision = DraftDecision(LayerPlan.prefix(model.num_layers, deepest.layer,
                                                       deepest.head),
                                      max_draft_tokens, cascade=self.cascade)

    def propose(self, state: Any) -> DraftDecision:
        return self.decision

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, "heads": self.heads_path,
                "exits": {e.layer: e.threshold for e in self.cascade},
                "num_speculative_tokens": self.max_draft_tokens}

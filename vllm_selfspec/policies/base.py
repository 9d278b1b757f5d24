"""The policy interface: one method = one small policy file (pure Python/tensor logic, no vLLM).

The engine calls, per request and per decode step:

1. ``observe(state, feedback)`` after the target verified the request's last drafts, with what
   happened (drafted/accepted counts) and, if the policy asked for them in ``capture_layers``,
   the residual stream of the verified tokens after those layers plus the tokens they must predict;
2. ``propose(state)`` for the next draft round: a ``LayerPlan``, a draft length and an optional
   confidence floor under which drafting stops early.

State is whatever ``new_state()`` returns; the engine creates it on a request's first step and
drops it when vLLM removes the request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from ..plans import LayerPlan


@dataclass(frozen=True)
class ModelInfo:
    """What a policy may know about the target model."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    architecture: str
    #: the LM head's weight count in decoder layers (V·d / weights per layer): what reading the
    #: head costs a memory-bound step, in the unit of TPL's "loaded layers"
    lm_head_layers: float = 0.0
    #: the same for the draft's head (less with a reduced draft vocabulary); None: lm_head_layers
    draft_head_layers: float | None = None


@dataclass
class Feedback:
    """What the last verification of one request showed."""

    num_drafted: int  # draft tokens the target verified this step (0 on prefill / plain decode)
    num_accepted: int  # of those, how many it accepted
    context_len: int  # tokens in the request after this step (prompt + output)
    # Captured hidden states (only when the policy sets capture_layers):
    # hidden[j, t] = residual stream after capture_layers[j] layers at the t-th captured row,
    # targets[t] = the token that row must predict (the verified next token). None otherwise.
    hidden: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    # Shadow tokens (only when the policy sets shadow=True and wants_shadow(state) said yes):
    # the exit head's greedy token and its probability for every (capture layer, captured row).
    shadow_tokens: torch.Tensor | None = None  # [n_layers, m] int64
    shadow_conf: torch.Tensor | None = None  # [n_layers, m] float32
    # Cascade: per draft step of the verified round, (deepest exit index it could use, exit
    # index it drafted from or -1 when none was confident), in order
    cascade_steps: list[tuple[int, int]] | None = None


@dataclass(frozen=True)
class DraftDecision:
    plan: LayerPlan
    num_tokens: int  # draft length for this round; 0 = plain decode step
    min_confidence: float | None = None  # stop drafting when the draft top-1 prob falls below
    #: Cascade: exits (``policies.cascade.CascadeExit``) each draft token walks, shallowest first;
    #: the token comes from the first exit whose confidence clears its threshold, and the round
    #: ends when none does. ``plan`` then runs to the deepest exit.
    cascade: tuple | None = None


class Policy(ABC):
    """Base class of every self-speculative method's policy."""

    #: method name as used in the config ("layerskip", "del", ...)
    name: str = ""
    #: option name -> default; the config validator rejects any other key
    options: dict[str, Any] = {}

    def __init__(self, config: dict[str, Any], model: ModelInfo, max_draft_tokens: int) -> None:
        self.config = config
        self.model = model
        self.max_draft_tokens = max_draft_tokens

    #: layer counts after which the engine captures the residual stream for observe()
    capture_layers: tuple[int, ...] = ()
    #: project the captured rows through each layer's exit head into shadow tokens (batched over
    #: the whole batch by the engine); the policy then sees tokens and confidences, not hidden
    shadow: bool = False
    #: defaults this method gives the common options (e.g. its own num_speculative_tokens)
    common_defaults: dict[str, Any] = {}
    #: set by the engine: measured step costs, ``draft_seconds(layers)`` and
    #: ``verify_seconds(tokens_per_request)`` (each None until measured); rank-identical under TP
    costs: Any = None
    #: whether decisions read ``costs`` (the engine then shares rank 0's costs under TP)
    timed: bool = False
    #: policies that search on the live model (KnapSpec) set this; the engine then measures the
    #: sub-layer latency model once (``policies.knapsack.LatencyModel``, rank 0's under TP) and
    #: stores it in ``latency`` before the first ``optimise``
    needs_latency: bool = False
    latency: Any = None
    #: draft_vocab_size "auto" for this method (None: config.AUTO_DRAFT_VOCAB_SIZE)
    auto_draft_vocab_size: int | None = None
    #: AdaDecode: the engine drafts with the deferred-layer schedule (vllm_selfspec/deferred.py)
    #: and the next target forward resumes the round's tokens at their depth
    deferred: bool = False

    @classmethod
    def resolve(cls, config: dict[str, Any], model_path: str) -> dict[str, Any]:
        """Options with machine-dependent defaults made concrete (e.g. "auto" -> a file path),
        once, in the front end; every worker then sees the same values."""
        return config

    @classmethod
    def validate(cls, config: dict[str, Any], model: ModelInfo) -> None:
        """Raise ValueError for option values impossible on this model (called before serving)."""

    def new_state(self) -> Any:
        return None

    def observe(self, state: Any, feedback: Feedback) -> None:
        """Update the request's statistics after a verification step."""

    def wants_shadow(self, state: Any) -> bool:
        """Whether this step's captured rows of the request should be projected (cost control)."""
        return True

    def wants_optimise(self, state: Any) -> bool:
        """Whether the engine should call ``optimise`` for this request now (after observe)."""
        return False

    def optimise(self, state: Any, model: Any) -> None:
        """Search the request's plan on the live model. ``model`` runs sub-layers on candidate
        states over the request's own KV cache (``sublayer(s, states, positions)``) and predicts
        tokens (``predict(states)``); see engine/knapsack_forward.py. Timed as "optimise"."""
        raise NotImplementedError(f"{type(self).__name__} does not search on the model")

    def head_for_layer(self, layer: int) -> str:
        """The exit head drafts and shadow tokens at ``layer`` read logits from."""
        return "lm_head"

    @abstractmethod
    def propose(self, state: Any) -> DraftDecision:
        """The plan and draft length of the request's next draft round."""

    def capped(self, state: Any, num_tokens: int) -> None:
        """The engine lets the round just proposed draft only ``num_tokens`` tokens (the goodput
        controller's cut, or a free lookup draft instead: 0), so a policy that learns from its
        own rounds does not mistake the cut for its drafts stopping."""

    def describe(self) -> dict[str, Any]:
        """Static facts for results and logs."""
        return {"method": self.name}


# ---- trained heads (AdaDecode, Cascade): one lookup and one check for every method -------------
def train_hint(kind: str, model_path: str | None = None) -> str:
    """How to get heads of ``kind`` (ends every heads error)."""
    model = f" --model {model_path} --out HEADS_DIR" if model_path else ""
    return (
        f"train them once with `vllm-selfspec train-heads --kind {kind}{model}` "
        f"(15-20 minutes on a 2-core CPU for the embedded model), then pass "
        f'"heads": HEADS_DIR or leave "heads": "auto" for the embedded model'
    )


def resolve_heads(
    config: dict[str, Any], model_path: str, method: str, kind: str, label: str
) -> dict[str, Any]:
    """``heads: "auto"`` -> the model's cached heads of ``kind``, or a clear error."""
    if config.get("heads", "auto") == "auto":
        from ..models import cached_heads

        found = cached_heads(model_path, kind)
        if found is None:
            raise ValueError(
                f"{method}: no trained {label} heads are cached for the model "
                f"{model_path}; {train_hint(kind, model_path)}"
            )
        config["heads"] = str(found)
    return config


def heads_config(
    config: dict[str, Any], model: ModelInfo, method: str, kind: str, need: str = ""
) -> dict[str, Any] | None:
    """The heads' config.json, checked to be of ``kind`` and for this model's sizes (None while
    ``heads`` is still "auto"); ``need`` says what that kind is, for the error."""
    heads = config.get("heads", "auto")
    if heads == "auto":
        return None
    if not isinstance(heads, str) or not heads:
        raise ValueError(f'{method}: heads must be "auto" or a head directory, got {heads!r}')
    from ..heads.io import read_config

    try:
        hc = read_config(heads)
    except ValueError as e:
        raise ValueError(f"{method}: heads: {e}; {train_hint(kind)}") from e
    if hc.get("kind") != kind:
        raise ValueError(
            f"{method}: the heads in {heads} are of kind {hc.get('kind')!r}; "
            f"{method} needs kind {kind!r}{need}: {train_hint(kind)}"
        )
    base = hc["base_model"]
    for key in ("num_layers", "hidden_size", "vocab_size"):
        if base[key] != getattr(model, key):
            raise ValueError(
                f"{method}: the heads in {heads} were trained for a model with "
                f"{key}={base[key]}, this model has {getattr(model, key)}"
            )
    return hc

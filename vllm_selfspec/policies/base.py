"""The policy interface: one method = one small policy file (pure Python/tensor logic, no vLLM).

The engine calls, per request and per decode step:

1. ``observe(state, feedback)`` after the target verified the request's last drafts, with what
   happened (drafted/accepted counts) and, if the policy asked for them in ``capture_layers``,
   the residual stream of the verified tokens after those layers plus the tokens they must predict;
2. ``propose(state)`` for the next draft round: a ``LayerPlan``, a draft length and an optional
   confidence floor under which drafting stops early.

State is whatever ``new_state()`` returns; the engine creates it on a request's first step and
drops it when vLLM removes the request.

A policy reads no files: ``SelfSpecConfig.make_policy`` (config.py) builds it from its options,
every default merged in, and the config.json of its trained heads, if it has any.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from ..model_info import ModelInfo
from ..plans import LayerPlan


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
    #: option name -> default; the config validator rejects any other key, and merges these
    #: defaults in (config.py), so a policy reads ``config[name]`` for every option
    options: dict[str, Any] = {}
    #: the kind of trained heads (``vllm-selfspec train-heads --kind``) the method drafts through
    #: (None: none). Its ``heads`` option names them ("auto": the model's cached ones); config.py
    #: finds them and reads and checks their config.json, and hands it to ``validate`` and the
    #: constructor as ``heads``
    head_kind: str | None = None
    #: the method also runs without its heads (``heads: "none"``; "auto" finds none: "none")
    heads_optional: bool = False

    def __init__(
        self,
        config: dict[str, Any],
        model: ModelInfo,
        max_draft_tokens: int,
        heads: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.max_draft_tokens = max_draft_tokens
        #: the trained heads' config.json (None: no heads, or ``heads`` still "auto")
        self.heads = heads
        self.setup()

    def setup(self) -> None:
        """What the method builds from ``config``, ``model``, ``max_draft_tokens`` and
        ``heads`` (set above), raising ValueError for values it cannot run with; every policy
        shares the constructor, and a method puts its own construction here."""

    #: layer counts after which the engine captures the residual stream for observe() (0: the
    #: stream entering the first layer, the rows' embeddings)
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
    #: sub-layer latency model once (``policies.knapspec_knapsack.LatencyModel``, rank 0's under
    #: TP) and stores it in ``latency`` before the first ``optimise``
    needs_latency: bool = False
    latency: Any = None
    #: draft_vocab_size "auto" for this method (None: config.AUTO_DRAFT_VOCAB_SIZE)
    auto_draft_vocab_size: int | None = None
    #: the next target forward resumes the last round's tokens at the depth their draft reached
    #: (AdaDecode's deferred layers): the target forward runs layer by layer
    deferred: bool = False
    #: the engine's drafting strategy, by name (``engine.proposer.DRAFTERS``, engine/drafting.py):
    #: "plan" drafts through the layer plan of each ``DraftDecision``
    drafter: str = "plan"

    @classmethod
    def validate(
        cls, config: dict[str, Any], model: ModelInfo, heads: dict[str, Any] | None = None
    ) -> None:
        """Raise ValueError for option values impossible on this model and these heads (called
        before serving)."""

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
        tokens (``predict(states)``); see engine/knapspec_forward.py. Timed as "optimise"."""
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

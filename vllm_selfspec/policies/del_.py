"""DEL: dynamic exit layer and draft length from shadow tokens (the DEL paper, §4 and App. A).

Per request and per round:

* **Shadow tokens.** After each verification the engine projects the verified tokens' residual
  stream at every candidate exit layer through that layer's exit head (batched over the batch) and
  hands the policy, per (layer ℓ, verified row), the greedy token and its probability.
* **Statistics.** Per layer: ``c^ℓ`` = shadow tokens equal to the verified token, ``tcs^ℓ`` /
  ``fcs^ℓ`` = summed confidence of matched / mismatched shadow tokens; ``u`` = verified rows. Every
  round decays the running sums by ``omega`` (``S(a) = Σ ω^{r-i-1} a[i]``).
  The paper counts rows up to the first mismatch of the current exit layer, because its shadow
  pass also sees the rejected drafts' positions; the engine only captures verified rows (all of
  them on the target's path), so every captured row is valid context and ``u`` is their count.
* **Acceptance** ``α_ℓ = S(c^ℓ) / S(u)``; **threshold** ``τ_ℓ = ½ (S(tcs^ℓ)/S(c^ℓ) +
  S(fcs^ℓ)/S(u − c^ℓ))``.
* **Selection** ``(E, γ) = argmax TPL(ℓ, d) = (1 − α_ℓ^{d+1}) / ((1 − α_ℓ)(dℓ + L))`` over the
  candidate layers and ``d ∈ [0, d_max]`` (``d = 0``: a plain decode step, chosen when no exit pays
  off); drafting stops early when a draft token's top-1 probability is below ``τ_E``.
  Beyond the paper, the objective counts what that stop costs: with ``β_ℓ`` the decayed share of
  shadow tokens that cleared ``τ_ℓ`` and ``a_ℓ`` the acceptance among them, a round emits
  ``1 + Σ_{i≤d} (β a)^i`` tokens for ``Σ_{i<d} β^i`` draft steps (the failing token's step is
  paid); β = 1 is the paper's formula. Without it, rounds whose first draft token is usually
  below ``τ`` pay a draft step for nothing (docs/methods.md, "`del`").
  Once a layer has drafted for real, β is the decayed pass rate of its real draft steps (read
  from how many drafts the last round kept), not the shadow estimate.
  ``cost``: ``"layers"`` is the paper's TPL with the LM head counted as the ``h`` layers its weights
  amount to (``d(ℓ+h) + L + h``: h ≈ 0.6 for Llama-2-7B, 8 for the embedded SmolLM2-135M);
  the draft's head counts less with a reduced draft vocabulary (``draft_vocab_size``);
  ``"time"`` is tokens per second with the engine's measured seconds per draft step (a line in
  ℓ) and per verification (a line in tokens per request), falling back to layers until measured.
* The first round uses the statistics of the last ``capture_tokens`` prompt tokens.

Options (paper defaults): ``omega`` 0.95, ``num_speculative_tokens`` (d_max) 18. Cost control —
one shadow row costs a full LM-head projection (on the embedded model, vocab 49152 x hidden 576:
about a fifth of the whole model per row), and the paper projects all L layers of every round:

* ``exit_layers``: candidate exits (default: the trained heads' layers, else 6 layers evenly
  spread over [L/4, L-2]);
* ``shadow_every``: project a request's verified rows every N-th round (default 4); while no exit
  pays off the interval doubles after each projection, up to 8N, and snaps back when one does
  (the statistics simply do not move in between);
* ``capture_tokens``: prompt tokens that initialise the statistics at prefill (default 8; the
  paper's 32 costs 4x more LM-head rows per request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..model_info import ModelInfo
from ..plans import LayerPlan
from .base import DraftDecision, Feedback, Policy
from .options import is_int, is_int_list, is_number

#: real draft steps at a layer (decayed) after which their confidence-stop rate replaces the
#: shadow tokens' estimate of it
MIN_REAL_STEPS = 4.0


def default_exit_layers(num_layers: int, count: int = 6) -> tuple[int, ...]:
    lo, hi = max(1, math.ceil(num_layers / 4)), max(1, num_layers - 2)
    if hi <= lo:
        return tuple(range(1, num_layers))
    return tuple(sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)}))


def round_expectations(
    accept: np.ndarray, max_draft: int, pass_rate: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Expected (emitted tokens, draft steps, drafts verified) of a round, per candidate layer
    (rows) and draft cap d = 0..max_draft (columns), when drafting stops at the confidence
    threshold: a draft token passes it with probability β (``pass_rate``) and, having passed,
    matches the target with probability a (``accept``). The token that fails the threshold is
    dropped but its draft step is paid. β = 1 is the paper's model: (1 − a^{d+1}) / (1 − a)
    tokens for d steps."""
    a = np.clip(np.asarray(accept, dtype=np.float64), 0.0, 1.0)[:, None]
    b = (
        np.ones_like(a)
        if pass_rate is None
        else np.clip(np.asarray(pass_rate, dtype=np.float64), 0.0, 1.0)[:, None]
    )
    i = np.arange(1, max_draft + 1)[None, :]
    zero = np.zeros((a.shape[0], 1))
    tokens = 1.0 + np.concatenate([zero, np.cumsum((a * b) ** i, axis=1)], axis=1)
    steps = np.concatenate([zero, np.cumsum(b ** (i - 1), axis=1)], axis=1)
    drafts = np.concatenate([zero, np.cumsum(b**i, axis=1)], axis=1)
    return tokens, steps, drafts


def tpl_table(
    alpha: np.ndarray,
    layers: np.ndarray,
    num_layers: int,
    max_draft: int,
    head_layers: float = 0.0,
    pass_rate: np.ndarray | None = None,
    draft_head_layers: float | None = None,
) -> np.ndarray:
    """TPL(ℓ, d) for every candidate layer (rows) and draft cap d = 0..max_draft (columns).
    ``head_layers`` > 0 also counts the LM head read by every target step, and by every draft
    step unless ``draft_head_layers`` says otherwise (a reduced draft vocabulary);
    ``pass_rate`` (with ``alpha`` then the acceptance of passing drafts) counts the draft steps
    the confidence stop wastes (``round_expectations``)."""
    tokens, steps, _ = round_expectations(alpha, max_draft, pass_rate)
    draft_head = head_layers if draft_head_layers is None else draft_head_layers
    cost = steps * (layers[:, None] + draft_head) + num_layers + head_layers
    return tokens / cost


def tpt_table(
    alpha: np.ndarray,
    draft_seconds: np.ndarray,
    verify_seconds,
    max_draft: int,
    pass_rate: np.ndarray | None = None,
) -> np.ndarray:
    """Tokens per second: draft_seconds[ℓ] per draft step at each candidate layer,
    ``verify_seconds(tokens)`` for a verification of that many tokens per request (a line)."""
    tokens, steps, drafts = round_expectations(alpha, max_draft, pass_rate)
    v1 = verify_seconds(1.0)
    cost = steps * draft_seconds[:, None] + v1 + (verify_seconds(2.0) - v1) * drafts
    return tokens / cost


@dataclass
class DELState:
    """Decayed sums S(·) of one request, one entry per candidate layer."""

    n: int
    s_u: float = 0.0
    s_c: np.ndarray = field(default=None)
    s_tcs: np.ndarray = field(default=None)
    s_fcs: np.ndarray = field(default=None)
    s_pass: np.ndarray = field(default=None)  # rows whose confidence cleared τ_ℓ
    s_pass_c: np.ndarray = field(default=None)  # ... and matched
    s_steps: np.ndarray = field(default=None)  # draft steps really run at each layer
    s_stops: np.ndarray = field(default=None)  # ... that the confidence stop dropped
    last: tuple[int, int] | None = None  # (layer index, draft cap) of the last proposal
    rounds: int = 0
    next_shadow: int = 0  # the round of the next projection
    interval: int = 1  # rounds between projections (backs off while no exit pays off)

    def __post_init__(self) -> None:
        for name in ("s_c", "s_tcs", "s_fcs", "s_pass", "s_pass_c", "s_steps", "s_stops"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(self.n))


class DELPolicy(Policy):
    name = "del"
    options = {
        "exit_layers": None,
        "omega": 0.95,
        "shadow_every": 4,
        "dynamic_threshold": True,
        "cost": "layers",
        "heads": "auto",
    }
    # draft_vocab_size "auto": the reduced draft vocabulary when the model has a map (measured
    # faster with trained heads: docs/methods.md, "Cheap draft steps")
    common_defaults = {
        "num_speculative_tokens": 18,
        "capture_tokens": 8,
        "draft_vocab_size": "auto",
    }
    shadow = True
    #: drafts and shadow tokens read through trained AdaDecode heads when the model has them
    #: (lightweight: one d x d matrix per exit), else through the model's own LM head
    head_kind = "adadecode"
    heads_optional = True

    @staticmethod
    def _head_layers(heads: dict[str, Any] | None) -> tuple[int, ...]:
        return () if heads is None else tuple(int(layer) for layer in heads["layers"])

    @classmethod
    def validate(
        cls, config: dict[str, Any], model: ModelInfo, heads: dict[str, Any] | None = None
    ) -> None:
        cls._exit_layers(config, model, heads)
        omega = config["omega"]
        if not is_number(omega) or not 0 < omega <= 1:
            raise ValueError(f"del: omega must be in (0, 1], got {omega!r}")
        if config["cost"] not in ("layers", "time"):
            raise ValueError(f'del: cost must be "layers" or "time", got {config["cost"]!r}')
        if not isinstance(config["dynamic_threshold"], bool):
            raise ValueError(
                f"del: dynamic_threshold must be true or false, got {config['dynamic_threshold']!r}"
            )
        every = config["shadow_every"]
        if not is_int(every) or every < 1:
            raise ValueError(f"del: shadow_every must be a positive integer, got {every!r}")

    @staticmethod
    def _exit_layers(
        config: dict[str, Any], model: ModelInfo, heads: dict[str, Any] | None
    ) -> tuple[int, ...]:
        L = model.num_layers
        layers = config["exit_layers"]
        if layers is None:
            return DELPolicy._head_layers(heads) or default_exit_layers(L)
        bad = not is_int_list(layers) or any(not 1 <= x < L for x in layers)
        if not layers or bad:
            raise ValueError(
                f"del: exit_layers must be a non-empty list of layer counts in "
                f"[1, {L - 1}] for this {L}-layer model, got {layers!r}"
            )
        return tuple(sorted(set(layers)))

    def setup(self) -> None:
        self.validate(self.config, self.model, self.heads)
        self.head_layers = self._head_layers(self.heads)
        #: trained exit heads the engine loads (None: the model's own LM head everywhere)
        self.heads_path = self.config["heads"] if self.heads is not None else None
        self.capture_layers = self._exit_layers(self.config, self.model, self.heads)
        self.layers = np.array(self.capture_layers, dtype=np.float64)
        self.omega = float(self.config["omega"])
        self.every = int(self.config["shadow_every"])
        self.dynamic_threshold = bool(self.config["dynamic_threshold"])
        self.cost = self.config["cost"]
        self.timed = self.cost == "time"
        self.plans = {
            l: LayerPlan.prefix(self.model.num_layers, l, self.head_for_layer(l))
            for l in self.capture_layers
        }
        self.no_draft = DraftDecision(LayerPlan.full(self.model.num_layers), 0)

    def head_for_layer(self, layer: int) -> str:
        return f"heads@{layer}" if layer in self.head_layers else "lm_head"

    def new_state(self) -> DELState:
        return DELState(len(self.capture_layers), interval=self.every)

    def wants_shadow(self, state: DELState) -> bool:
        return state.rounds >= state.next_shadow

    def observe(self, state: DELState, feedback: Feedback) -> None:
        state.rounds += 1
        # real-draft evidence fades every round, so a layer that stopped drafting is tried
        # again once the shadow estimate alone says it pays
        state.s_steps *= self.omega
        state.s_stops *= self.omega
        if state.last is not None:  # what the confidence stop did to the last real draft
            j, cap = state.last
            kept = feedback.num_drafted
            stopped = int(kept < cap)
            state.s_steps[j] += kept + stopped
            state.s_stops[j] += stopped
            state.last = None
        if feedback.shadow_tokens is None:
            return
        match = (feedback.shadow_tokens == feedback.targets[None, :]).numpy()  # [layers, m]
        conf = feedback.shadow_conf.float().numpy()
        # which rows the confidence stop (with the thresholds as they stand) would have let pass
        floors = np.array(
            [
                self.threshold(state, j) if self.dynamic_threshold else None
                for j in range(len(self.layers))
            ],
            dtype=np.float64,
        )
        passed = ~(conf < np.nan_to_num(floors, nan=-1.0)[:, None])
        w = self.omega
        state.s_u = w * state.s_u + match.shape[1]
        state.s_c = w * state.s_c + match.sum(1)
        state.s_tcs = w * state.s_tcs + (conf * match).sum(1)
        state.s_fcs = w * state.s_fcs + (conf * ~match).sum(1)
        state.s_pass = w * state.s_pass + passed.sum(1)
        state.s_pass_c = w * state.s_pass_c + (passed & match).sum(1)
        # project every `shadow_every` rounds while drafting pays off; while it does not, back
        # off (x2 per projection, up to 8x): the estimates then only watch for a change
        drafting = self._choose(state)[1] > 0
        state.interval = self.every if drafting else min(2 * state.interval, 8 * self.every)
        state.next_shadow = state.rounds + state.interval - 1

    def alpha(self, state: DELState) -> np.ndarray:
        return state.s_c / state.s_u if state.s_u > 0 else np.zeros(len(self.layers))

    def threshold(self, state: DELState, j: int) -> float | None:
        matched, missed = state.s_c[j], state.s_u - state.s_c[j]
        if matched <= 0 or missed <= 0:
            return None  # no evidence on one side: do not stop on confidence
        return 0.5 * (state.s_tcs[j] / matched + state.s_fcs[j] / missed)

    def gate(self, state: DELState) -> tuple[np.ndarray, np.ndarray]:
        """(β, a) per layer: the share of shadow tokens that cleared the confidence threshold and
        the acceptance among those (β = 1, a = α without the dynamic threshold)."""
        if not self.dynamic_threshold or state.s_u <= 0:
            return np.ones(len(self.layers)), self.alpha(state)
        beta = state.s_pass / state.s_u
        # where real drafts ran often enough, their pass rate replaces the shadow estimate
        real = state.s_steps >= MIN_REAL_STEPS
        beta = np.where(real, 1.0 - state.s_stops / np.maximum(state.s_steps, 1e-9), beta)
        accept = np.divide(
            state.s_pass_c, state.s_pass, out=np.zeros(len(self.layers)), where=state.s_pass > 0
        )
        return beta, accept

    def _choose(self, state: DELState) -> tuple[int, int]:
        """(candidate layer index, draft cap) maximising the objective; cap 0 = no draft."""
        if state.s_u <= 0:
            return 0, 0
        table = self.table(state)
        j, d = np.unravel_index(int(np.argmax(table)), table.shape)  # first max: d = 0 on ties
        return int(j), int(d)

    def propose(self, state: DELState) -> DraftDecision:
        j, d = self._choose(state)
        if d == 0:
            return self.no_draft
        state.last = (j, d)
        floor = self.threshold(state, j) if self.dynamic_threshold else None
        return DraftDecision(self.plans[self.capture_layers[j]], d, floor)

    def capped(self, state: DELState, num_tokens: int) -> None:
        if state.last is not None:
            state.last = (state.last[0], num_tokens) if num_tokens > 0 else None

    def table(self, state: DELState) -> np.ndarray:
        """The objective over (candidate layer, draft cap): TPT when measured, else TPL; both
        count the draft steps the confidence stop wastes."""
        beta, accept = self.gate(state)
        if self.cost == "time" and self.costs is not None:
            draft = [self.costs.draft_seconds(layer) for layer in self.capture_layers]
            if None not in draft and self.costs.verify_seconds(1.0) is not None:
                return tpt_table(
                    accept, np.array(draft), self.costs.verify_seconds, self.max_draft_tokens, beta
                )
        return tpl_table(
            accept,
            self.layers,
            self.model.num_layers,
            self.max_draft_tokens,
            self.model.lm_head_layers,
            beta,
            self.model.draft_head_layers,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "method": self.name,
            "cost": self.cost,
            "heads": self.heads_path,
            "exit_layers": list(self.capture_layers),
            "omega": self.omega,
            "shadow_every": self.every,
            "d_max": self.max_draft_tokens,
            "dynamic_threshold": self.dynamic_threshold,
        }

"""Cascade: CascadeExit's trained exit adapters and confidence estimators as a drafter
(lossless, the default) or as an early-exit sampler (``lossy: true``, changes outputs).

Each draft token walks the exits from the shallowest to the deepest (CascadeExit §3.3): after the
exit's layers, the exit's confidence estimator says whether its adapter's top-1 would equal the
full model's; at the first exit whose confidence clears its threshold the token is drafted from
that exit's adapter (+ the model's own final norm and LM head). If no exit clears its threshold
the request's draft round ends there. vLLM then verifies the drafts with the full model, so the
output is exactly vanilla vLLM's (the paper's §8.5 hybrid: cascade as the drafter of a
speculative loop over one shared paged KV cache).

Within a round a draft token exits no deeper than the previous one did (the first token may
use every exit): a deeper exit would attend, in the layers past the previous token's exit, to KV
slots that token never wrote (letting them go deeper halved acceptance on the embedded model:
docs/methods.md, "`cascade`"). The round ends at the first token with no confident exit up to that
cap. The engine runs the rows of one draft step together, layer by layer, and goes deeper only
while some row is still undecided (rows that exited ride along; memory-bound steps cost little
more per row).

**When to walk** (``adaptive``, beyond the paper). A walk that finds no confident exit costs the
layers it ran for nothing, and on a small model that is most of a full step. So per request and
per draft token the policy decides how deep the walk may go (or whether to draft at all) by an
optimal-stopping recursion over the exits, from decayed per-request statistics:
``p_i`` = P(confident at exit i | reached it undecided) and ``a_i`` = P(the target accepts a token
drafted at exit i | its prefix was accepted), with priors from the estimator's held-out scores
recorded by training, worth ``PRIOR_WEIGHT`` observations. For a token whose prefix is
accepted with probability π, arriving undecided at exit i is worth
``V_i = p_i (π a_i G − c_v − c_h) + (1 − p_i) max(0, V_{i+1} − Δ_i t)``, with G the seconds of a
target step (what an accepted token saves), c_v the seconds one more verified token adds, c_h an
exit's head, t seconds per layer and Δ_i the layers between exits i and i+1 — the engine's measured
step costs (``costs``), or layer counts until measured. The walk goes on past exit i while
continuing is worth something, and the token is drafted only if ``V_0`` beats the cost of the
first ``exit_0`` layers. π is the product of ``a`` over the round's earlier tokens. A request
whose (decayed) walk count is below ``EXPLORE_BELOW`` walks anyway, so it learns its own rates
first and tries again now and then after it stopped drafting.

Options:

* ``heads``: "auto" (the model's cached cascade heads; a clear error saying how to train them when
  there are none) or a head directory (``vllm-selfspec train-heads --kind cascade``);
* ``exit_layers``: the exits to use (default: every trained exit), a subset of the heads' layers;
* ``thresholds``: null (the trained, F1-selected thresholds), one number for every exit, or
  ``{"layer": threshold}`` overriding some of them;
* ``lossy``: false (default). **true changes the output**: the cascade sampler of CascadeExit —
  every drafted token (its exit's confidence cleared the threshold) is emitted *without*
  verification, and only the token after them comes from the full model. The full model still
  runs over the drafted tokens in the next step (that pass is where their deeper layers' KV is
  completed, so later tokens see a complete cache). Start-up warns, and
  ``get_stats(llm)["unverified_tokens"]`` (and ``["unverified_tokens_by_request"]``) and the
  ``vllm:selfspec_unverified_tokens_total`` metric count the tokens that came from unverified exits;
* ``adaptive``: true (default): the walk rule above; false: every token walks to the deepest
  allowed exit (the paper's cascade);
* ``omega``: 0.95, the per-round decay of the per-request exit statistics;
* ``num_speculative_tokens``: the most tokens a round drafts (default 6);
* ``draft_vocab_size``: "auto" by default (the adapters' logits over the model's 8192 most
  frequent tokens when its map is cached; see config.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..model_info import ModelInfo
from ..plans import LayerPlan
from .base import DraftDecision, Feedback, Policy
from .options import is_int_list, is_number

#: observations the priors of p_i and a_i are worth
PRIOR_WEIGHT = 2.0
#: prior of p_i, P(confident at exit i | reached undecided), when training recorded no rates
PRIOR_CONFIDENT = 0.5
#: a request walks to the deepest exit, whatever the statistics say, while its decayed count of
#: walks is below this: evidence fades every round, so a request that stopped drafting tries
#: again now and then (about every 23 rounds at omega = 0.95), and a new one starts by trying
EXPLORE_BELOW = 0.3
#: layers an exit's adapter + confidence estimator cost (3 d x d/… matrices: ~1/4 of a layer)
ADAPTER_LAYERS = 0.25
#: until the verify cost is measured: one more verified token costs this share of a target step
VERIFY_TOKEN_SHARE = 0.1


@dataclass(frozen=True)
class CascadeExit:
    layer: int  # decoder layers run before this exit
    head: str  # the engine's head slot ("heads@<layer>")
    threshold: float  # exit when the estimator's confidence >= threshold


@dataclass
class CascadeState:
    """Decayed per-exit counts of one request (index = position in the cascade)."""

    reached: np.ndarray  # walks that reached the exit undecided
    confident: np.ndarray  # of those, walks whose estimator cleared the threshold there
    drafted: np.ndarray  # drafted tokens whose prefix was accepted (so their verdict is theirs)
    accepted: np.ndarray  # of those, accepted by the target
    rounds: int = 0


class CascadePolicy(Policy):
    name = "cascade"
    options = {
        "heads": "auto",
        "exit_layers": None,
        "thresholds": None,
        "lossy": False,
        "adaptive": True,
        "omega": 0.95,
    }
    # the reduced draft vocabulary when the model has a map, as DEL and KnapSpec
    common_defaults = {"num_speculative_tokens": 6, "draft_vocab_size": "auto"}
    head_kind = "cascade"
    #: each draft token walks the exits (engine/drafters/cascade.py)
    drafter = "cascade"

    @staticmethod
    def exits(config: dict[str, Any], heads: dict[str, Any] | None) -> tuple[CascadeExit, ...]:
        """The configured exits of the heads, shallowest first (empty without ``heads``)."""
        if heads is None:
            return ()
        trained = {int(layer): float(t) for layer, t in (heads.get("thresholds") or {}).items()}
        layers = config["exit_layers"]
        if layers is None:
            layers = sorted(trained)
        bad = not is_int_list(layers) or any(x not in trained for x in layers)
        if not layers or bad:
            raise ValueError(
                f"cascade: exit_layers must be a non-empty subset of the trained "
                f"exits {sorted(trained)}, got {layers!r}"
            )
        over = config["thresholds"]
        if over is None:
            over = {}
        elif is_number(over):
            over = {str(layer): over for layer in layers}
        if not isinstance(over, dict):
            raise ValueError(
                f'cascade: thresholds must be null, a number or {{"layer": number}}, got {over!r}'
            )
        thresholds = dict(trained)
        for key, t in over.items():
            if not str(key).isdigit() or int(key) not in trained:
                raise ValueError(
                    f"cascade: thresholds names exit {key!r}; trained exits are {sorted(trained)}"
                )
            if not is_number(t) or not 0 <= t <= 1:
                raise ValueError(
                    f"cascade: the threshold of exit {key} must be in [0, 1], got {t!r}"
                )
            thresholds[int(key)] = float(t)
        return tuple(
            CascadeExit(layer, f"heads@{layer}", thresholds[layer]) for layer in sorted(set(layers))
        )

    @classmethod
    def validate(
        cls, config: dict[str, Any], model: ModelInfo, heads: dict[str, Any] | None = None
    ) -> None:
        cls.exits(config, heads)
        for key in ("lossy", "adaptive"):
            if not isinstance(config[key], bool):
                raise ValueError(f"cascade: {key} must be true or false, got {config[key]!r}")
        omega = config["omega"]
        if not is_number(omega) or not 0 < omega <= 1:
            raise ValueError(f"cascade: omega must be in (0, 1], got {omega!r}")

    def setup(self) -> None:
        self.cascade = self.exits(self.config, self.heads)
        if not self.cascade:
            raise ValueError(
                "cascade: heads must be resolved to a directory before the engine "
                "starts (SelfSpecConfig.resolved)"
            )
        #: the engine loads these heads into its head slots
        self.heads_path = self.config["heads"]
        #: drafts are emitted without verification (changes outputs; see the module docstring)
        self.lossy = bool(self.config["lossy"])
        self.adaptive = bool(self.config["adaptive"])
        self.timed = self.adaptive  # the walk rule reads the measured step costs
        self.omega = float(self.config["omega"])
        self.layers = np.array([e.layer for e in self.cascade], dtype=np.float64)
        self.prior_confident, self.prior_accept = self._priors()
        deepest = self.cascade[-1]
        self.decision = DraftDecision(
            LayerPlan.prefix(self.model.num_layers, deepest.layer, deepest.head),
            self.max_draft_tokens,
            cascade=self.cascade,
        )

    def _priors(self) -> tuple[np.ndarray, np.ndarray]:
        """Priors of p_i and a_i from the estimators' held-out scores recorded by training:
        P(confident) = recall · positive rate / precision, and the precision (the share of
        confident exits that agree with the final layer); 0.5 when not recorded."""
        est = self.heads.get("training", {}).get("estimators", {})
        p, a = [], []
        for e in self.cascade:
            r = est.get(str(e.layer), {})
            prec, rec, pos = (r.get(k) for k in ("precision", "recall", "fit_positive_rate"))
            a.append(float(prec) if prec else 0.5)
            p.append(min(1.0, rec * pos / prec) if prec and rec and pos else PRIOR_CONFIDENT)
        return np.array(p), np.array(a)

    def new_state(self) -> CascadeState:
        n = len(self.cascade)
        return CascadeState(*(np.zeros(n) for _ in range(4)))

    def observe(self, state: CascadeState, feedback: Feedback) -> None:
        state.rounds += 1
        for arr in (state.reached, state.confident, state.drafted, state.accepted):
            arr *= self.omega
        accepted_left = feedback.num_accepted
        judged = True  # the drafts so far were all accepted: the next verdict is its own
        for cap, chosen in feedback.cascade_steps or ():
            state.reached[: (chosen if chosen >= 0 else cap) + 1] += 1
            if chosen < 0:
                break
            state.confident[chosen] += 1
            if judged:
                state.drafted[chosen] += 1
                if accepted_left > 0:
                    state.accepted[chosen] += 1
                    accepted_left -= 1
                else:
                    judged = False

    def rates(self, state: CascadeState) -> tuple[np.ndarray, np.ndarray]:
        """(p_i, a_i) with their priors."""
        w = PRIOR_WEIGHT
        p = (state.confident + w * self.prior_confident) / (state.reached + w)
        a = (state.accepted + w * self.prior_accept) / (state.drafted + w)
        return p, a

    def _cost_model(self) -> tuple[float, float, float, float, float]:
        """(t per layer, t per draft step, G per target step, c_v per verified token, c_h per
        head): measured seconds when the engine has them, else layers."""
        m = self.model
        head = (
            m.draft_head_layers if m.draft_head_layers is not None else m.lm_head_layers
        ) + ADAPTER_LAYERS
        G = m.num_layers + m.lm_head_layers
        t, step0, c_v, c_h = 1.0, 0.0, VERIFY_TOKEN_SHARE * G, head
        costs = self.costs
        if costs is not None:
            d0, d1 = costs.draft_seconds(0), costs.draft_seconds(1)
            v1, v2 = costs.verify_seconds(1), costs.verify_seconds(2)
            if None not in (d0, d1, v1, v2) and d1 > d0:
                # a measured draft step's intercept holds its heads, metadata and overheads
                t, step0, G, c_v, c_h = d1 - d0, d0, v1, max(0.0, v2 - v1), 0.0
        return t, step0, G, c_v, c_h

    def walk_cap(self, state: CascadeState, prefix_prob: float) -> int:
        """The deepest exit (index) a draft token's walk should try, -1: do not draft it."""
        n = len(self.cascade)
        if not self.adaptive or state.reached[0] < EXPLORE_BELOW:
            return n - 1
        p, a = self.rates(state)
        t, step0, G, c_v, c_h = self._cost_model()
        gaps = np.diff(self.layers) * t
        cont = np.zeros(n + 1)  # cont[i]: value of walking on from exit i-1 to exit i
        value = 0.0
        for i in range(n - 1, -1, -1):
            value = p[i] * (prefix_prob * a[i] * G - c_v - c_h) + (1 - p[i]) * cont[i + 1]
            if i > 0:
                cont[i] = max(0.0, value - gaps[i - 1])
        if value - (self.layers[0] * t + step0) <= 0:
            return -1
        cap = 0
        while cap + 1 < n and cont[cap + 1] > 0:
            cap += 1
        return cap

    def acceptance(self, state: CascadeState, exit_index: int) -> float:
        return float(self.rates(state)[1][exit_index])

    def propose(self, state: Any) -> DraftDecision:
        return self.decision

    def describe(self) -> dict[str, Any]:
        return {
            "method": self.name,
            "heads": self.heads_path,
            "lossy": self.lossy,
            "adaptive": self.adaptive,
            "exits": {e.layer: e.threshold for e in self.cascade},
            "num_speculative_tokens": self.max_draft_tokens,
        }

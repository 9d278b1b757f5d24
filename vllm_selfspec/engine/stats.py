"""Engine counters and the per-method time breakdown (draft / verify / policy / shadow /
optimise / controller).

"shadow" is the hidden-state capture of verified tokens (and, for methods that project it, the
shadow-token work); "optimise" is a searching policy's plan search on the model (KnapSpec's DP);
"verify" is the rest of the runner step: the target forward and sampling."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

TIME_KEYS = ("draft", "policy", "lookup", "shadow", "optimise", "controller", "step")


@dataclass
class EngineStats:
    steps: int = 0  # engine steps that sampled at least one token
    generated_tokens: int = 0  # tokens emitted (accepted drafts + one target token per round)
    target_rounds: int = 0  # per-request target forwards that emitted tokens
    drafted_tokens: int = 0  # draft tokens verified by the target
    accepted_tokens: int = 0
    draft_rounds: int = 0  # per-request rounds that proposed >= 1 draft token
    draft_layers: float = 0.0  # decoder layers run by draft steps, summed over requests
    draft_forwards: int = 0  # partial forwards run by draft steps (one per step, every plan)
    target_layers: float = 0.0  # decoder layers run by target forwards, summed over requests
    shadow_rows: int = 0  # (layer, token) rows projected into shadow tokens
    optimisations: int = 0  # per-request plan searches (KnapSpec)
    skipped_attn: int = 0  # attention sub-layers the draft plans skipped, summed over draft rounds
    skipped_mlp: int = 0
    draft_length_hist: Counter = field(default_factory=Counter)
    plan_hist: Counter = field(default_factory=Counter)
    plans: Counter = field(default_factory=Counter)  # LayerPlan -> draft rounds that drafted
    # Cascade: draft tokens per emitting exit layer ("none": draft steps where no exit was
    # confident, which end the round), and of those the target accepted
    exit_drafted: Counter = field(default_factory=Counter)
    exit_accepted: Counter = field(default_factory=Counter)
    # AdaDecode: early predictions per predicting head layer, and of those the target accepted;
    # draft walks that found no confident head (each ends its round)
    early_predicted: Counter = field(default_factory=Counter)
    early_accepted: Counter = field(default_factory=Counter)
    unconfident_walks: int = 0
    # draft rows whose logits were not all finite: no valid draft distribution, so no draft
    invalid_draft_rows: int = 0
    # Cascade lossy mode: tokens emitted from exits without verification (total, per request)
    unverified_tokens: int = 0
    unverified_by_request: dict = field(default_factory=dict)
    # AdaDecode's layer computations ((token, layer) pairs) of decode rows: in draft steps, in the
    # target forwards that finish them, the rows those forwards verified, and the tokens the
    # requests emitted from those forwards
    draft_token_layers: int = 0
    verify_token_layers: int = 0
    verify_rows: int = 0
    decode_tokens: int = 0
    # AdaDecode rounds the next target forward resumed at their depth, and rounds it could not
    # (the request was not scheduled in that step, or not with the round's tokens): those run
    # from layer 0 again
    rounds_resumed: int = 0
    rounds_dropped: int = 0
    # the goodput controller: draft tokens the policies proposed and the controller did not let
    # run, steps in which no request drafted (a paid draft), and its probes
    controller_cut_tokens: int = 0
    controller_plain_steps: int = 0
    controller_probes: int = 0
    # context-lookup drafts (lookup.py) verified, and of those accepted (also in the totals)
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    # of the accepted lookup drafts, those the shared index proposed (other requests' outputs,
    # the datastore): a longer match there than in the request's own context
    lookup_shared_accepted: int = 0
    # draft tokens verified whose request left no draft distribution q (a sampled one's go as
    # point masses: exact, lower acceptance; expected 0), and vLLM's -1 placeholder drafts
    # verified (requests the scheduler padded at admission; never drafted, not counted as drafts)
    draft_probs_missing: int = 0
    placeholder_drafts: int = 0
    # rounds of sampled requests with their own seed, decoded without drafts (reproducibility)
    seeded_rounds: int = 0
    # verifying steps: all-greedy ones verified by one argmax per logits row (greedy_verify.py),
    # and those that went through vLLM's rejection sampler
    greedy_verifications: int = 0
    sampled_verifications: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIME_KEYS, 0.0))

    @contextmanager
    def timer(self, key: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[key] += time.perf_counter() - t0

    def reset(self) -> None:
        self.__init__()

    def as_dict(self) -> dict[str, Any]:
        s = self.seconds
        host = s["policy"] + s["lookup"] + s["controller"]  # deciding, without forwards
        other = s["draft"] + s["shadow"] + s["optimise"] + host
        layers = self.draft_layers + self.target_layers
        return {
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "target_rounds": self.target_rounds,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.drafted_tokens
            if self.drafted_tokens
            else None,
            "draft_rounds": self.draft_rounds,
            "draft_layers": self.draft_layers,
            "draft_forwards": self.draft_forwards,
            "target_layers": self.target_layers,
            "tokens_per_layer": self.generated_tokens / layers if layers else None,
            "shadow_rows": self.shadow_rows,
            "invalid_draft_rows": self.invalid_draft_rows,
            "unverified_tokens": self.unverified_tokens,
            "unverified_tokens_by_request": dict(self.unverified_by_request),
            "optimisations": self.optimisations,
            "controller_cut_tokens": self.controller_cut_tokens,
            "controller_plain_steps": self.controller_plain_steps,
            "controller_probes": self.controller_probes,
            "lookup_drafted_tokens": self.lookup_drafted,
            "draft_probs_missing": self.draft_probs_missing,
            "placeholder_drafts": self.placeholder_drafts,
            "seeded_rounds": self.seeded_rounds,
            "greedy_verifications": self.greedy_verifications,
            "sampled_verifications": self.sampled_verifications,
            "lookup_accepted_tokens": self.lookup_accepted,
            "lookup_shared_accepted_tokens": self.lookup_shared_accepted,
            # where the emitted tokens came from: accepted lookup drafts, accepted self-drafts,
            # the target (one per request and verification)
            "token_sources": {
                "lookup": self.lookup_accepted,
                "self_draft": self.accepted_tokens - self.lookup_accepted,
                "target": self.generated_tokens - self.accepted_tokens,
            },
            # per draft round: sub-layers the plan skipped (layers past an early exit included)
            "skipped_attn_per_round": self.skipped_attn / self.draft_rounds
            if self.draft_rounds
            else None,
            "skipped_mlp_per_round": self.skipped_mlp / self.draft_rounds
            if self.draft_rounds
            else None,
            "draft_length_hist": dict(sorted(self.draft_length_hist.items())),
            "plan_hist": dict(self.plan_hist.most_common()),
            **plan_histograms(self.plans),
            **(
                {
                    "cascade_exits": {
                        str(k): {
                            "drafted": n,
                            "accepted": self.exit_accepted[k],
                            "acceptance": self.exit_accepted[k] / n if n and k != "none" else None,
                        }
                        for k, n in sorted(self.exit_drafted.items(), key=_exit_order)
                    }
                }
                if self.exit_drafted
                else {}
            ),
            **(
                {
                    "early_predictions": {
                        str(k): {
                            "predicted": n,
                            "accepted": self.early_accepted[k],
                            "acceptance": self.early_accepted[k] / n,
                        }
                        for k, n in sorted(self.early_predicted.items())
                    },
                    "unconfident_walks": self.unconfident_walks,
                }
                if self.early_predicted or self.unconfident_walks
                else {}
            ),
            # seconds inside the runner: verify = the target step minus the selfspec parts
            "time_s": {
                "draft": s["draft"],
                "policy": s["policy"],
                "lookup": s["lookup"],
                "shadow": s["shadow"],
                "optimise": s["optimise"],
                "controller": s["controller"],
                "verify": max(0.0, s["step"] - other),
                "total": s["step"],
            },
            # the host time of a step's decisions, no forward in it (microseconds per engine
            # step): bookkeeping and policies, context lookup (indexing, drafting), the
            # controller's choice (benchmarks/lookup_host.py measures the same offline)
            "host_us_per_step": {
                "policy": 1e6 * s["policy"] / max(self.steps, 1),
                "lookup": 1e6 * s["lookup"] / max(self.steps, 1),
                "controller": 1e6 * s["controller"] / max(self.steps, 1),
                "total": 1e6 * host / max(self.steps, 1),
            },
        }


def layer_computations(st: EngineStats, num_layers: int) -> dict[str, Any]:
    """AdaDecode's (token, layer) computations per emitted token of decode steps, beside what
    vanilla decoding (``num_layers`` per token) and a draft-then-verify method with the same
    drafts (the drafts' layers + every verified row through all layers) compute."""
    n = st.decode_tokens or 1
    ours = st.draft_token_layers + st.verify_token_layers
    draft_then_verify = st.draft_token_layers + st.verify_rows * num_layers
    return {
        "rounds_resumed": st.rounds_resumed,
        "rounds_dropped": st.rounds_dropped,
        "tokens": st.decode_tokens,
        "draft": st.draft_token_layers,
        "verify": st.verify_token_layers,
        "verified_rows": st.verify_rows,
        "per_token": ours / n,
        "vanilla_per_token": float(num_layers),
        "draft_then_verify_per_token": draft_then_verify / n,
        "saved_vs_vanilla": 1 - ours / (n * num_layers) if st.decode_tokens else None,
        "saved_vs_draft_then_verify": 1 - ours / draft_then_verify if draft_then_verify else None,
    }


def _exit_order(item) -> tuple[int, int]:
    key = item[0]
    return (1, 0) if key == "none" else (0, key)


def builtin(obj: Any) -> Any:
    """``obj`` with numpy scalars and arrays made Python numbers and lists, in dicts, lists and
    tuples: the statistics leave the engine through vLLM's msgpack encoder, which refuses numpy
    types (a numpy float in the controller's state once hung the benchmark: the engine's output
    thread died on it and the caller waited for ever)."""
    if isinstance(obj, dict):
        return {k: builtin(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(builtin(v) for v in obj)
    if hasattr(obj, "tolist") and type(obj).__module__ == "numpy":
        return obj.tolist()  # a numpy scalar's tolist() is its Python number
    return obj


def merge(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Stats of TP ranks are replicas: rank 0's are the engine's (kept for a clear API)."""
    return dicts[0] if dicts else {}


def plan_histograms(plans: Counter) -> dict[str, Any]:
    """Draft rounds per chosen exit layer, and per skipped sub-layer below the exit
    ({"attn": {layer: rounds}, "mlp": {...}}, 0-based layers; layers past an exit not counted)."""
    exits: Counter = Counter()
    skipped: dict[str, Counter] = {"attn": Counter(), "mlp": Counter()}
    for plan, rounds in plans.items():
        exits[plan.exit_layer] += rounds
        for kind, flags in (("attn", plan.attn), ("mlp", plan.mlp)):
            for layer, runs in enumerate(flags):
                if not runs:
                    skipped[kind][layer] += rounds
    return {
        "exit_layer_hist": dict(sorted(exits.items())),
        "skipped_sublayer_hist": {k: dict(sorted(c.items())) for k, c in skipped.items()},
    }

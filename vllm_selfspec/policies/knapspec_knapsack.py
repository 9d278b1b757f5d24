"""KnapSpec's search (the KnapSpec paper, §3 and Algorithm 1), as pure tensor logic (no vLLM).

The target's 2L sub-layers are flattened: sub-layer ``s`` (0-based) is the attention of layer
``s // 2`` when ``s`` is even and its MLP when ``s`` is odd. A draft plan is the set of sub-layers
it skips.

* **Latency model** (§3.4): ``t_MLP`` constant, ``t_Attn(n) = c2·n + c3`` in the context length n,
  fitted from timings; integer knapsack weights ``w = round(t / Δ)`` with ``Δ = min(t_Attn(n),
  t_MLP)``.
* **Parallel DP** (Algorithm 1): ``g[i, j]`` = the hidden states of the r recent rows after
  sub-layer i having skipped weight j, chosen between *execute* (``f_i(g[i-1, j])``) and *skip*
  (``g[i-1, j-w_i]``) by the mean cosine similarity to the full model's states ``X(i)``. All live
  budgets of one sub-layer go through ONE batched ``sublayer(s, states[B, r, d])`` call. Pruning:
  similarity ≤ τ, and skipped weight > K/2 (``K = L(w_attn + w_mlp)``). ``g[i, 0]`` is ``X(i)``.
* **TPT selection** (§3.5): for every surviving budget, backtrack its skip set, estimate α̂ by
  top-1 agreement of its final states with the full model's on the r rows (Eq. 9), and take
  ``argmax_{S, γ ≤ D} (1 − α̂^{γ+1}) / (1 − α̂) / (γ·t_draft(S, n) + t_target(γ))``. γ = 0 (no
  draft: a plain decode step) is a candidate too, chosen when no skip set pays off.

Beyond the paper: the latency model also holds the LM head's time, which every draft and target
step pays (on small models it outweighs many sub-layers; the draft's may be a reduced vocabulary),
and the target's time may grow with the tokens it verifies (``verify_ratio``, measured by the
engine).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

#: upper bound of one sub-layer's knapsack weight: bounds the DP table (K ≤ L·(1 + MAX_WEIGHT))
#: when attention grows far beyond the MLP at long contexts
MAX_WEIGHT = 16

SubLayerFn = Callable[[int, torch.Tensor], torch.Tensor]
PredictFn = Callable[[torch.Tensor], torch.Tensor]


def is_attention(s: int) -> bool:
    return s % 2 == 0


# ---- (a) the latency model --------------------------------------------------------------------
@dataclass(frozen=True)
class LatencyModel:
    """Seconds of one row through one sub-layer, and of the LM head."""

    t_mlp: float
    c2: float  # attention seconds per context token
    c3: float  # attention seconds at context 0
    t_head: float = 0.0  # the draft's LM head (a reduced draft vocabulary makes it cheaper)
    t_target_head: float | None = None  # the target's LM head (None: same as the draft's)

    @classmethod
    def fit(
        cls,
        attn: Sequence[tuple[int, float]],
        t_mlp: float,
        t_head: float = 0.0,
        t_target_head: float | None = None,
    ) -> LatencyModel:
        """Least-squares line through (context length, attention seconds) samples; a negative
        slope (noise) is clamped to 0, leaving the mean as the constant."""
        ns = np.array([n for n, _ in attn], dtype=np.float64)
        ts = np.array([t for _, t in attn], dtype=np.float64)
        if len(ns) == 0 or t_mlp <= 0 or (ts <= 0).any():
            raise ValueError("latency fit needs positive timings and at least one attention sample")
        c2 = 0.0
        if len(set(ns.tolist())) > 1:
            c2 = float(np.polyfit(ns, ts, 1)[0])
        c2 = max(c2, 0.0)
        c3 = float(ts.mean() - c2 * ns.mean())
        if c3 <= 0:  # keep t_Attn positive at short contexts
            c3 = float(ts.min()) * 1e-3
        return cls(
            t_mlp=float(t_mlp),
            c2=c2,
            c3=c3,
            t_head=float(t_head),
            t_target_head=None if t_target_head is None else float(t_target_head),
        )

    def t_attn(self, n: int) -> float:
        return self.c2 * n + self.c3

    def weights(self, n: int) -> tuple[int, int]:
        """(w_attn, w_mlp) at context n: rounded ratios to Δ = min(t_Attn(n), t_MLP)."""
        ta, tm = self.t_attn(n), self.t_mlp
        delta = min(ta, tm)
        return (
            min(MAX_WEIGHT, max(1, round(ta / delta))),
            min(MAX_WEIGHT, max(1, round(tm / delta))),
        )

    def draft_seconds(self, n_attn: np.ndarray, n_mlp: np.ndarray, n: int) -> np.ndarray:
        """One draft step running n_attn attention and n_mlp MLP sub-layers at context n."""
        return self.t_head + n_attn * self.t_attn(n) + n_mlp * self.t_mlp

    def target_seconds(self, num_layers: int, n: int) -> float:
        head = self.t_head if self.t_target_head is None else self.t_target_head
        return head + num_layers * (self.t_attn(n) + self.t_mlp)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LatencyModel:
        th = d.get("t_target_head")
        return cls(
            **{k: float(d[k]) for k in ("t_mlp", "c2", "c3", "t_head")},
            t_target_head=None if th is None else float(th),
        )


# ---- (b) the parallel DP ----------------------------------------------------------------------
def mean_cosine(states: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """states [B, r, d], ref [r, d] -> [B]: cos(·, ref) averaged over the r rows."""
    return F.cosine_similarity(states.float(), ref.float().unsqueeze(0), dim=-1).mean(-1)


@dataclass
class DPResult:
    budgets: list[int]  # surviving skipped weights j at the last sub-layer (ascending)
    states: torch.Tensor  # [C, r, d] g[2L, j] for those budgets
    similarity: torch.Tensor  # [C] cos(g[2L, j], X(2L))
    skip_sets: list[tuple[int, ...]]  # per budget: the skipped sub-layers (ascending)
    reference: torch.Tensor  # [r, d] X(2L)
    rows_evaluated: int  # rows that went through a sub-layer (the search's compute)


def knapsack_dp(
    refs: dict[int, torch.Tensor],
    sublayer: SubLayerFn,
    num_sublayers: int,
    w_attn: int,
    w_mlp: int,
    tau: float = 0.5,
) -> DPResult:
    """Algorithm 1. ``refs[k]`` = X(k), the full model's states after k sub-layers (``refs[0]``
    required); a missing X(k) is computed as ``f_k(X(k-1))`` inside the same batched call as the
    budgets' states (it rides along as one extra member)."""
    if 0 not in refs:
        raise ValueError("knapsack_dp needs refs[0], the states entering the first sub-layer")
    x = refs[0]
    r, d = x.shape
    K = (w_attn + w_mlp) * (num_sublayers // 2)
    cap = K // 2  # prune skipped weight > K/2
    states = x.new_zeros(cap + 1, r, d)
    states[0] = x
    live = torch.zeros(cap + 1, dtype=torch.bool)
    live[0] = True
    skipped = torch.zeros(num_sublayers, cap + 1, dtype=torch.bool)  # reached by a skip
    ref, rows = x, 0
    neg = torch.full((cap + 1,), -math.inf)
    for s in range(num_sublayers):
        w = w_attn if is_attention(s) else w_mlp
        J = live.nonzero().squeeze(1)
        Jx = J[J > 0]  # budget 0 executes everything: its state is the reference
        need_ref = (s + 1) not in refs
        batch = torch.cat([states[Jx], ref.unsqueeze(0)]) if need_ref else states[Jx]
        out = sublayer(s, batch) if len(batch) else batch
        rows += len(batch) * r
        ref = out[-1] if need_ref else refs[s + 1]
        executed = out[: len(Jx)]
        sim_exec = neg.clone()
        sim_exec[0] = 1.0
        if len(Jx):
            sim_exec[Jx] = mean_cosine(executed, ref).cpu()
        sim_skip = neg.clone()
        dst = J + w
        ok = dst <= cap
        if bool(ok.any()):
            sim_skip[dst[ok]] = mean_cosine(states[J[ok]], ref).cpu()
        exec_ok, skip_ok = sim_exec > tau, sim_skip > tau
        take_skip = skip_ok & (~exec_ok | (sim_skip > sim_exec))  # ties execute (Eq. 8)
        new = torch.zeros_like(states)
        new[0] = ref
        if len(Jx):
            new[Jx] = executed
        K_skip = take_skip.nonzero().squeeze(1)
        if len(K_skip):
            new[K_skip] = states[K_skip - w]
        states, live = new, exec_ok | take_skip
        skipped[s] = take_skip
    budgets = live.nonzero().squeeze(1)
    table = skipped.tolist()
    skip_sets = []
    for j in budgets.tolist():
        path = []
        for s in reversed(range(num_sublayers)):
            if table[s][j]:
                path.append(s)
                j -= w_attn if is_attention(s) else w_mlp
        assert j == 0, "backtracking must end at budget 0"
        skip_sets.append(tuple(reversed(path)))
    final = states[budgets]
    return DPResult(
        budgets=budgets.tolist(),
        states=final,
        similarity=mean_cosine(final, ref),
        skip_sets=skip_sets,
        reference=ref,
        rows_evaluated=rows,
    )


# ---- (c) TPT selection ------------------------------------------------------------------------
def expected_tokens(alpha: np.ndarray, max_draft: int) -> np.ndarray:
    """[C, D+1]: tokens a round emits with per-token acceptance α and γ = 0..D drafts."""
    a = np.clip(np.asarray(alpha, dtype=np.float64), 0.0, 1.0 - 1e-9)[:, None]
    g = np.arange(max_draft + 1)[None, :]
    return (1.0 - a ** (g + 1)) / (1.0 - a)


def tpt_table(
    alpha: np.ndarray, draft_seconds: np.ndarray, target_seconds: np.ndarray, max_draft: int
) -> np.ndarray:
    """TPT(S, γ) for candidates S (rows) and γ = 0..D (columns); target_seconds[γ] is the
    verification of γ drafts."""
    g = np.arange(max_draft + 1)[None, :]
    cost = g * np.asarray(draft_seconds, dtype=np.float64)[:, None] + target_seconds[None, :]
    return expected_tokens(alpha, max_draft) / cost


def skip_counts(skip_sets: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(skipped attention, skipped MLP) sub-layers per skip set."""
    attn = np.array([sum(1 for s in ss if is_attention(s)) for ss in skip_sets])
    return attn, np.array([len(ss) for ss in skip_sets]) - attn


@dataclass(frozen=True)
class Choice:
    skip_attn: tuple[int, ...]  # 0-based layers whose attention the draft skips
    skip_mlp: tuple[int, ...]
    gamma: int  # draft length (0: no draft)
    alpha: float  # α̂ of the chosen skip set
    tpt: float  # its tokens per second
    weights: tuple[int, int]  # (w_attn, w_mlp) the search used
    candidates: int  # surviving budgets
    rows_evaluated: int


def select(
    dp: DPResult,
    predict: PredictFn,
    latency: LatencyModel,
    num_layers: int,
    n: int,
    max_draft: int,
    verify_ratio: Sequence[float] | None = None,
    predict_target: PredictFn | None = None,
) -> Choice:
    """Backtracked candidates -> α̂ (Eq. 9) -> the (S, γ) with the highest TPT (Eq. 4).
    ``predict`` gives the draft's tokens, ``predict_target`` the target's (default: the same);
    ``verify_ratio[γ]``: verification of γ drafts relative to a plain step (default all 1)."""
    C, r, d = dp.states.shape
    if predict_target is None:
        tokens = predict(torch.cat([dp.states.reshape(C * r, d), dp.reference])).cpu()
        mine, full = tokens[: C * r].view(C, r), tokens[C * r :]
    else:
        mine = predict(dp.states.reshape(C * r, d)).cpu().view(C, r)
        full = predict_target(dp.reference).cpu()
    alpha = (mine == full.unsqueeze(0)).float().mean(1).numpy()
    n_attn, n_mlp = skip_counts(dp.skip_sets)
    draft = latency.draft_seconds(num_layers - n_attn, num_layers - n_mlp, n)
    ratio = np.ones(max_draft + 1) if verify_ratio is None else np.asarray(verify_ratio)
    target = latency.target_seconds(num_layers, n) * ratio[: max_draft + 1]
    table = tpt_table(alpha, draft, target, max_draft)
    c, g = np.unravel_index(int(np.argmax(table)), table.shape)  # first max: γ = 0 on ties
    ss = dp.skip_sets[c]
    return Choice(
        skip_attn=tuple(s // 2 for s in ss if is_attention(s)),
        skip_mlp=tuple(s // 2 for s in ss if not is_attention(s)),
        gamma=int(g),
        alpha=float(alpha[c]),
        tpt=float(table[c, g]),
        weights=latency.weights(n),
        candidates=C,
        rows_evaluated=dp.rows_evaluated,
    )


def search(
    refs: dict[int, torch.Tensor],
    sublayer: SubLayerFn,
    predict: PredictFn,
    latency: LatencyModel,
    num_layers: int,
    n: int,
    max_draft: int,
    tau: float = 0.5,
    verify_ratio: Sequence[float] | None = None,
    predict_target: PredictFn | None = None,
) -> Choice:
    """The whole KnapSpec optimisation at context length n: weights, DP, TPT selection."""
    w_attn, w_mlp = latency.weights(n)
    dp = knapsack_dp(refs, sublayer, 2 * num_layers, w_attn, w_mlp, tau)
    return select(dp, predict, latency, num_layers, n, max_draft, verify_ratio, predict_target)

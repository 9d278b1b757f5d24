"""KnapSpec's search on synthetic tensors (no vLLM): latency model, parallel DP, TPT selection."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from vllm_selfspec.policies.knapspec_knapsack import (
    MAX_WEIGHT,
    LatencyModel,
    expected_tokens,
    knapsack_dp,
    mean_cosine,
    search,
    select,
    tpt_table,
)

D = 16


def offsets_model(num_sublayers: int, norms, seed: int = 0):
    """Sub-layer s adds a fixed vector v_s: the v_s are orthogonal to each other and to x0, so a
    skip set's final cosine to the full model depends only on the skipped norms (the knapsack DP
    is then exact, which the brute force below relies on)."""
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(seed)))
    x0 = 3.0 * q[:, 0]
    v = torch.stack([float(norms[s]) * q[:, 1 + s] for s in range(num_sublayers)])
    calls = []

    def sublayer(s, states):
        calls.append((s, tuple(states.shape)))
        return states + v[s]

    return x0, v, sublayer, calls


def run_plan(x, sublayer, num_sublayers, skip):
    for s in range(num_sublayers):
        if s not in skip:
            x = sublayer(s, x.unsqueeze(0))[0]
    return x


# ---- latency model ------------------------------------------------------------------------------
def test_latency_fit_recovers_the_line_and_weights():
    lm = LatencyModel.fit([(n, 2e-6 * n + 1e-4) for n in (64, 512, 2048)], t_mlp=3e-4, t_head=1e-3)
    assert lm.c2 == pytest.approx(2e-6) and lm.c3 == pytest.approx(1e-4)
    assert lm.weights(0) == (1, 3)  # Δ = t_attn: MLP weighs 3
    assert lm.weights(100) == (1, 1)  # t_attn = 3e-4 = t_mlp
    assert lm.weights(1000) == (7, 1)  # t_attn = 2.1e-3: Δ = t_mlp
    assert lm.weights(10**9) == (MAX_WEIGHT, 1)
    assert LatencyModel.from_dict(lm.to_dict()) == lm
    # noise with a negative slope: constant attention time
    flat = LatencyModel.fit([(64, 2e-4), (512, 1.9e-4)], t_mlp=1e-4)
    assert flat.c2 == 0 and flat.t_attn(10**6) == pytest.approx(1.95e-4)
    with pytest.raises(ValueError):
        LatencyModel.fit([], t_mlp=1e-4)


# ---- the DP ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("w_attn, w_mlp", [(1, 1), (2, 1), (1, 3)])
def test_dp_matches_brute_force(w_attn, w_mlp):
    n_sub = 6  # 3 layers
    norms = [0.9, 0.3, 1.4, 0.5, 0.2, 1.1]
    x0, v, sublayer, _ = offsets_model(n_sub, norms)
    r = 3
    refs = {0: x0.expand(r, D).clone()}
    dp = knapsack_dp(refs, sublayer, n_sub, w_attn, w_mlp, tau=-1.0)  # no similarity pruning
    cap = (w_attn + w_mlp) * (n_sub // 2) // 2
    full = run_plan(x0, sublayer, n_sub, ())
    best: dict[int, float] = {}
    for k in range(n_sub + 1):
        for skip in itertools.combinations(range(n_sub), k):
            j = sum(w_attn if s % 2 == 0 else w_mlp for s in skip)
            if j <= cap:
                c = float(torch.cosine_similarity(run_plan(x0, sublayer, n_sub, skip), full, 0))
                best[j] = max(best.get(j, -2.0), c)
    assert dp.budgets == sorted(best)
    for j, sim, ss, st in zip(dp.budgets, dp.similarity.tolist(), dp.skip_sets, dp.states):
        assert sim == pytest.approx(best[j], abs=1e-5)
        # backtracking: the skip set has weight j and reproduces the DP's states
        assert sum(w_attn if s % 2 == 0 else w_mlp for s in ss) == j
        torch.testing.assert_close(st[0], run_plan(x0, sublayer, n_sub, ss))
    torch.testing.assert_close(dp.reference[0], full)


def test_dp_is_one_batched_call_per_sublayer_and_computes_missing_references():
    n_sub = 8
    x0, v, sublayer, calls = offsets_model(n_sub, [0.5] * n_sub)
    r = 4
    xs = [x0.expand(r, D).clone()]
    for s in range(n_sub):
        xs.append(xs[-1] + v[s])
    refs = {k: xs[k] for k in range(0, n_sub + 1, 2)}  # only layer boundaries, as captured
    dp = knapsack_dp(refs, sublayer, n_sub, 1, 1, tau=0.5)
    assert len(calls) == n_sub  # every sub-layer: one call for all live budgets (+ reference)
    assert [s for s, _ in calls] == list(range(n_sub))
    assert all(len(shape) == 3 and shape[1:] == (r, D) for _, shape in calls)
    assert max(shape[0] for _, shape in calls) > 2  # several budgets in one call
    # X(odd) is not given: attention sub-layers carry the reference as one extra member; at
    # sub-layer 0 only budget 0 (the reference itself) is live
    assert calls[0][1][0] == 1
    torch.testing.assert_close(dp.reference, xs[-1])
    assert dp.rows_evaluated == sum(shape[0] * r for _, shape in calls)


def test_pruning_by_similarity_and_budget():
    n_sub = 8
    norms = [0.3] * n_sub
    norms[4] = 30.0  # the attention of layer 2 dominates: skipping it wrecks the states
    x0, v, sublayer, _ = offsets_model(n_sub, norms)
    refs = {0: x0.expand(2, D).clone()}
    dp = knapsack_dp(refs, sublayer, n_sub, 1, 1, tau=0.5)
    assert all(4 not in ss for ss in dp.skip_sets)
    K = 2 * (n_sub // 2)
    assert max(dp.budgets) <= K // 2 and max(len(ss) for ss in dp.skip_sets) <= K // 2
    strict = knapsack_dp(refs, sublayer, n_sub, 1, 1, tau=0.999)
    assert len(strict.budgets) < len(dp.budgets)
    assert strict.budgets[0] == 0  # the full model always survives
    # large sub-layers: early skips fall below τ on the way (at X(i) with few sub-layers in)
    x0, v, sublayer, _ = offsets_model(n_sub, [5.0] * n_sub)
    refs = {0: x0.expand(2, D).clone()}
    pruned = knapsack_dp(refs, sublayer, n_sub, 1, 1, tau=0.5)
    loose = knapsack_dp(refs, sublayer, n_sub, 1, 1, tau=-1.0)
    # the pruned search evaluates fewer rows and loses no final candidate here
    assert pruned.rows_evaluated < loose.rows_evaluated and pruned.budgets == loose.budgets
    assert (pruned.similarity > 0.5).all()


# ---- TPT selection ---------------------------------------------------------------------------
def test_tpt_formula():
    alpha = np.array([0.0, 0.5, 1.0])
    e = expected_tokens(alpha, 3)
    assert e[0].tolist() == pytest.approx([1, 1, 1, 1])
    assert e[1].tolist() == pytest.approx([1, 1.5, 1.75, 1.875])
    assert e[2].tolist() == pytest.approx([1, 2, 3, 4], rel=1e-6)
    t = tpt_table(alpha, np.array([1.0, 1.0, 0.5]), np.array([2.0, 2.0, 2.0, 2.0]), 3)
    assert t[1, 2] == pytest.approx(1.75 / (2 * 1.0 + 2.0))
    assert t[2, 3] == pytest.approx(4 / (3 * 0.5 + 2.0), rel=1e-6)


def _head(x0):
    """A linear LM head whose top-1 follows x0's direction unless the state strays far."""
    W = torch.randn(5, D, generator=torch.Generator().manual_seed(1)) * 0.1
    W[3] += x0 / x0.norm()
    return lambda states: (states @ W.T).argmax(-1)


def test_long_context_skips_attention_short_context_skips_mlp():
    L = 6
    x0, v, sublayer, _ = offsets_model(2 * L, [0.3] * (2 * L))
    refs = {0: x0.expand(4, D).clone()}
    lm = LatencyModel(t_mlp=1e-3, c2=1e-6, c3=2e-4, t_head=1e-3)
    predict = _head(x0)
    short = search(refs, sublayer, predict, lm, L, n=100, max_draft=4)  # t_attn 3e-4 < t_mlp
    long = search(refs, sublayer, predict, lm, L, n=8000, max_draft=4)  # t_attn 8.2e-3 > t_mlp
    assert short.weights == (1, 3) and long.weights == (8, 1)
    assert short.alpha == 1.0 and long.alpha == 1.0 and short.gamma == long.gamma == 4
    # short: the budget K/2 = 12 buys 4 MLP skips (weight 3 each) and no attention skip
    assert short.skip_attn == () and len(short.skip_mlp) == 4
    # long: attention is 8x the MLP; K/2 = 27 buys 3 attention skips (24) before any MLP
    assert len(long.skip_attn) == 3 and len(long.skip_mlp) <= 3


def test_no_draft_when_nothing_pays_off():
    L = 3
    x0, v, sublayer, _ = offsets_model(2 * L, [0.3] * (2 * L))
    refs = {0: x0.expand(4, D).clone()}
    lm = LatencyModel(t_mlp=1e-3, c2=0.0, c3=1e-3, t_head=1e-3)
    # drafting is as dear as verifying and every candidate disagrees with the full model
    contrary = lambda states: torch.where(  # noqa: E731
        (states - (x0 + v.sum(0))).norm(dim=-1) < 1e-4, 0, 1
    )
    choice = search(
        refs, sublayer, contrary, lm, L, n=10, max_draft=4, verify_ratio=[1.0, 1.5, 2.0, 2.5, 3.0]
    )
    assert choice.gamma == 0


def test_select_uses_verify_ratio():
    L = 4
    x0, v, sublayer, _ = offsets_model(2 * L, [0.3] * (2 * L))
    refs = {0: x0.expand(4, D).clone()}
    dp = knapsack_dp(refs, sublayer, 2 * L, 1, 1)
    lm = LatencyModel(t_mlp=1e-3, c2=0.0, c3=1e-3, t_head=0.0)
    flat = select(dp, _head(x0), lm, L, 10, max_draft=8)
    steep = select(
        dp, _head(x0), lm, L, 10, max_draft=8, verify_ratio=[1.0 + 2.0 * g for g in range(9)]
    )
    assert flat.gamma == 8 and steep.gamma < flat.gamma
    assert math.isfinite(steep.tpt) and steep.tpt < flat.tpt
    assert mean_cosine(dp.states, dp.reference).shape == (len(dp.budgets),)


# ---- the policy ----------------------------------------------------------------------------------
def _policy(L=3, **opts):
    from vllm_selfspec.policies import ModelInfo
    from vllm_selfspec.policies.knapspec import KnapSpecPolicy

    info = ModelInfo(num_layers=L, hidden_size=D, vocab_size=5, architecture="LlamaForCausalLM")
    return KnapSpecPolicy({**KnapSpecPolicy.options, **opts}, info, 4)


def _feedback(n, m, L=3):
    from vllm_selfspec.policies import Feedback

    return Feedback(0, 0, n, hidden=torch.randn(1, m, D), targets=torch.zeros(m, dtype=torch.long))


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"interval": 0}, "interval"),
        ({"tau": 2}, "tau"),
        ({"history_rounds": 1.5}, "history"),
        ({"min_confidence": "high"}, "min_confidence"),
    ],
)
def test_policy_rejects_bad_options(opts, match):
    with pytest.raises(ValueError, match=f"knapspec: {match}"):
        _policy(**opts)


def test_policy_history_interval_and_weight_change():
    p = _policy(interval=3, history_rounds=2)
    assert p.capture_layers == (0,) and p.min_confidence == 0.7
    st = p.new_state()
    p.observe(st, _feedback(n=20, m=8))  # prefill: rows at positions 11..18
    assert st.rounds[0][0] == 11 and p.wants_optimise(st)
    assert p.propose(st).num_tokens == 0  # nothing chosen yet: plain decode
    p.latency = LatencyModel(t_mlp=1e-3, c2=1e-7, c3=5e-4, t_head=1e-3)  # (1, 2) up to n ~ 2500
    x0, v, sublayer, _ = offsets_model(6, [0.3] * 6)

    class Model:
        def sublayer(self, s, x, positions):
            assert positions.tolist() == list(range(11, 11 + x.shape[1]))
            return sublayer(s, x)

        predict = staticmethod(_head(x0))
        predict_target = None

    p.optimise(st, Model())
    d = p.propose(st)
    assert st.steps == 0 and st.choice.weights == p.latency.weights(20)
    assert d.num_tokens == st.choice.gamma and (d.num_tokens == 0 or d.min_confidence == 0.7)
    p.observe(st, _feedback(n=22, m=2))  # rows 19, 20: contiguous
    assert [f for f, _ in st.rounds] == [11, 19] and not p.wants_optimise(st)
    p.observe(st, _feedback(n=23, m=1))
    assert [f for f, _ in st.rounds] == [19, 21]  # history_rounds = 2
    p.observe(st, _feedback(n=30, m=1))  # a gap: the history restarts
    assert [f for f, _ in st.rounds] == [28]
    assert p.wants_optimise(st)  # 3 steps since the search
    st.steps = 0
    assert not p.wants_optimise(st)
    st.context_len = 9000  # t_attn grows past t_mlp: the weights change to (1, 1)
    assert p.wants_optimise(st)


def test_a_request_drafts_with_the_latest_search_until_its_own(monkeypatch):
    from vllm_selfspec.policies import knapspec

    p = _policy()
    p.latency = LatencyModel(t_mlp=1e-3, c2=1e-7, c3=5e-4, t_head=1e-3)
    found = []  # the search's results, in order: (skip_attn, skip_mlp, gamma)

    def search(*args, **kwargs):
        skip_attn, skip_mlp, gamma = found.pop(0)
        return knapspec.knapspec_knapsack.Choice(
            skip_attn, skip_mlp, gamma, 0.9, 50.0, (1, 2), 1, 8
        )

    monkeypatch.setattr(knapspec.knapspec_knapsack, "search", search)
    model = type("Model", (), {"predict": None, "predict_target": None})()
    a, b = p.new_state(), p.new_state()
    assert p.propose(b).num_tokens == 0  # no search anywhere yet: plain decode
    p.observe(a, _feedback(n=20, m=8))
    found.append(((1,), (0, 2), 3))
    p.optimise(a, model)  # request a's search
    assert p.propose(a).num_tokens == 3 and p.propose(a).plan.attn == (True, False, True)
    assert p.propose(b) is p.propose(a)  # b has no search of its own yet: a's choice
    p.observe(b, _feedback(n=20, m=8))
    assert p.wants_optimise(b)  # ... and b still asks for its own search
    found.append(((), (), 0))
    p.optimise(b, model)  # b's own search: drafting does not pay for it
    assert p.propose(b).num_tokens == 0 and p.propose(a).num_tokens == 3


def test_latency_target_head():
    lm = LatencyModel(t_mlp=1e-3, c2=0.0, c3=1e-3, t_head=1e-3, t_target_head=5e-3)
    assert lm.target_seconds(2, 10) == pytest.approx(5e-3 + 2 * 2e-3)
    assert lm.draft_seconds(np.array([2]), np.array([1]), 10)[0] == pytest.approx(1e-3 + 3e-3)
    assert LatencyModel.from_dict(lm.to_dict()) == lm

"""DEL's statistics, TPL argmax and dynamic threshold on synthetic shadow tokens (no vLLM)."""

import numpy as np
import pytest
import torch

from vllm_selfspec.config import SelfSpecConfig, SelfSpecConfigError
from vllm_selfspec.policies import Feedback, ModelInfo
from vllm_selfspec.policies.del_ import (
    DELPolicy,
    default_exit_layers,
    round_expectations,
    tpl_table,
)

L = 30
MODEL = ModelInfo(num_layers=L, hidden_size=64, vocab_size=100, architecture="LlamaForCausalLM")


def make(**opts) -> DELPolicy:
    return SelfSpecConfig.load({"method": "del", **opts}).make_policy(MODEL)


def feedback(match: np.ndarray, conf: np.ndarray) -> Feedback:
    """match [layers, m] bool -> shadow tokens equal to the targets where match is True."""
    m = match.shape[1]
    targets = torch.arange(m)
    tokens = torch.where(torch.from_numpy(match), targets[None, :], targets[None, :] + 50)
    return Feedback(
        0, 0, 100, targets=targets, shadow_tokens=tokens, shadow_conf=torch.from_numpy(conf).float()
    )


def test_defaults_follow_the_paper():
    p = make()
    assert p.max_draft_tokens == 18 and p.omega == 0.95
    assert p.capture_layers == default_exit_layers(L) == (8, 12, 16, 20, 24, 28)


def test_tpl_formula_and_vanilla_column():
    alpha = np.array([0.0, 0.5, 0.9])
    t = tpl_table(alpha, np.array([5.0, 10.0, 20.0]), L, 3)
    assert np.allclose(t[:, 0], 1 / L)  # d = 0: a plain step
    assert t[1, 2] == pytest.approx((1 + 0.5 + 0.25) / (2 * 10 + L))
    assert t[2, 3] == pytest.approx((1 - 0.9**4) / (0.1 * (3 * 20 + L)))


def test_decayed_statistics_and_alpha():
    p = make(exit_layers=[5, 10], omega=0.5)
    s = p.new_state()
    p.observe(s, feedback(np.array([[1, 0], [1, 1]], bool), np.full((2, 2), 0.5)))
    p.observe(s, feedback(np.array([[0, 0], [1, 1]], bool), np.full((2, 2), 0.5)))
    # S(u) = 0.5 * 2 + 2 = 3; S(c) layer 5 = 0.5 * 1 + 0, layer 10 = 0.5 * 2 + 2
    assert s.s_u == 3 and np.allclose(s.s_c, [0.5, 3.0])
    assert np.allclose(p.alpha(s), [0.5 / 3, 1.0])


def test_threshold_is_the_midpoint_of_matched_and_missed_confidence():
    p = make(exit_layers=[10], omega=1.0)
    s = p.new_state()
    match = np.array([[1, 1, 0, 0]], bool)
    conf = np.array([[0.9, 0.7, 0.3, 0.1]])
    p.observe(s, feedback(match, conf))
    assert p.threshold(s, 0) == pytest.approx(0.5 * (0.8 + 0.2))
    s2 = p.new_state()
    p.observe(s2, feedback(np.ones((1, 4), bool), conf))
    assert p.threshold(s2, 0) is None  # never missed: no evidence to stop on


def test_selection_picks_the_best_layer_and_length():
    p = make(exit_layers=[6, 24])
    s = p.new_state()
    # layer 6 agrees 95% of the time, layer 24 always: the cheap layer wins on TPL
    match = np.stack([np.arange(100) % 20 != 0, np.ones(100, bool)])
    conf = np.where(match, 0.9, 0.2)
    p.observe(s, feedback(match, conf))
    d = p.propose(s)
    alpha = p.alpha(s)
    t = tpl_table(alpha, np.array([6.0, 24.0]), L, 18)
    j, g = np.unravel_index(np.argmax(t), t.shape)
    assert (d.plan.exit_layer, d.num_tokens) == ((6, 24)[j], g) and d.plan.exit_layer == 6
    assert d.num_tokens > 1
    assert d.min_confidence == pytest.approx(0.5 * (0.9 + 0.2))


def test_no_exit_pays_off_means_no_draft():
    p = make(exit_layers=[28])
    s = p.new_state()
    assert p.propose(s).num_tokens == 0  # nothing observed yet
    p.observe(s, feedback(np.array([[1, 1, 0, 1, 0]], bool), np.full((1, 5), 0.5)))
    assert p.propose(s).num_tokens == 0  # alpha 0.6 at 28 of 30 layers never beats 1/L


def _shadow_rounds(p, match, rounds=48):
    """Rounds in which the engine would project (it feeds shadow only when asked)."""
    s = p.new_state()
    asked = []
    for r in range(rounds):
        if p.wants_shadow(s):
            asked.append(r)
            p.observe(s, feedback(match, np.full(match.shape, 0.5)))
        else:
            p.observe(s, Feedback(0, 0, 10))
    return asked


def test_shadow_every_n_rounds_while_drafting_pays():
    p = make(exit_layers=[6], shadow_every=2)
    good = (np.arange(40) % 20 != 0)[None, :]  # alpha 0.95 at 6 of 30 layers: drafting pays
    assert _shadow_rounds(p, good)[:5] == [0, 2, 4, 6, 8]


def test_shadow_backs_off_while_no_exit_pays():
    p = make(exit_layers=[28], shadow_every=2)
    bad = (np.arange(40) % 2 == 0)[None, :]  # alpha 0.5 at 28 of 30 layers: never drafts
    assert _shadow_rounds(p, bad) == [0, 4, 12, 28, 44]  # intervals 4, 8, 16, 16 (cap 8x2)


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"exit_layers": [30]}, "exit_layers"),
        ({"exit_layers": []}, "exit_layers"),
        ({"omega": 0}, "omega"),
        ({"shadow_every": 0}, "shadow_every"),
    ],
)
def test_bad_options(opts, match):
    with pytest.raises(SelfSpecConfigError, match=match):
        SelfSpecConfig.load({"method": "del", **opts}).validate_for_model(MODEL)


def test_trained_heads_are_optional_and_checked(tmp_path):
    from vllm_selfspec.heads import HeadSet, ModelIdentity, make_head, save_heads

    def heads_dir(kind, hidden=64):
        ident = ModelIdentity("LlamaForCausalLM", L, hidden, 100, "0123456789abcdef")
        heads = {layer: make_head(kind, hidden, bottleneck=8) for layer in (10, 20)}
        return str(save_heads(tmp_path / f"{kind}-{hidden}", HeadSet(kind, heads, ident)))

    # no cached heads for this model: "auto" is the model's own LM head
    assert SelfSpecConfig.load({"method": "del"}).resolved(str(tmp_path)).options["heads"] == "none"
    assert make(heads="none").heads_path is None
    path = heads_dir("adadecode")
    p = make(heads=path)
    assert p.heads_path == path and p.capture_layers == (10, 20)  # exits default to the heads'
    assert p.head_for_layer(20) == "heads@20" and p.head_for_layer(12) == "lm_head"
    for heads, match in [
        (heads_dir("cascade"), "kind 'cascade'.*train-heads --kind adadecode"),
        (heads_dir("adadecode", hidden=32), "hidden_size=32, this model has 64"),
        (str(tmp_path / "nowhere"), "not a head directory.*train-heads --kind adadecode"),
        (None, 'heads must be "auto", "none" or a head directory'),
    ]:
        with pytest.raises(SelfSpecConfigError, match=match):
            SelfSpecConfig.load({"method": "del", "heads": heads}).validate_for_model(MODEL)


def test_lm_head_counts_as_layers_in_tpl():
    p = make(exit_layers=[6])
    p.model = ModelInfo(L, 64, 100, "LlamaForCausalLM", lm_head_layers=8.0)
    s = p.new_state()
    match = np.arange(100) % 10 != 0  # alpha 0.9 at layer 6
    p.observe(s, feedback(match[None, :], np.full((1, 100), 0.5)))
    t = p.table(s)
    assert t[0, 1] == pytest.approx((1 + 0.9) / ((6 + 8) + L + 8))


def test_a_reduced_draft_vocabulary_makes_draft_steps_cheaper_in_tpl():
    p = make(exit_layers=[6])
    p.model = ModelInfo(L, 64, 100, "LlamaForCausalLM", lm_head_layers=8.0, draft_head_layers=1.0)
    s = p.new_state()
    match = np.arange(100) % 10 != 0  # alpha 0.9 at layer 6
    p.observe(s, feedback(match[None, :], np.full((1, 100), 0.5)))
    assert p.table(s)[0, 1] == pytest.approx((1 + 0.9) / ((6 + 1) + L + 8))


class FakeCosts:
    def __init__(self, draft, verify):
        self.draft, self.verify = draft, verify

    def draft_seconds(self, layers):
        return self.draft(layers)

    def verify_seconds(self, tokens):
        return self.verify(tokens)


def test_time_cost_uses_measured_seconds_and_falls_back_to_layers():
    p = make(exit_layers=[6], cost="time")
    assert p.timed
    s = p.new_state()
    match = np.arange(100) % 10 != 0
    p.observe(s, feedback(match[None, :], np.full((1, 100), 0.5)))
    p.costs = FakeCosts(lambda l: None, lambda t: None)  # nothing measured yet: layers
    assert np.allclose(p.table(s), tpl_table(p.alpha(s), np.array([6.0]), L, 18))
    # drafting is nearly free but every verified token costs a full step: draft 1 at most
    p.costs = FakeCosts(lambda l: 0.001, lambda t: 0.01 * t)
    assert p.propose(s).num_tokens == 0
    # verification costs the same for any length: draft long
    p.costs = FakeCosts(lambda l: 0.001, lambda t: 0.01)
    assert p.propose(s).num_tokens > 5


def test_round_expectations_match_a_simulated_draft_loop():
    rng = np.random.default_rng(0)
    beta, accept, cap, n = 0.6, 0.8, 5, 200_000
    passed = rng.random((n, cap)) < beta
    matched = rng.random((n, cap)) < accept
    # steps run while every earlier token passed; a kept token is accepted while all kept match
    alive = np.cumprod(passed, axis=1)
    steps = 1 + alive[:, :-1].sum(1)
    drafts = alive.sum(1)
    tokens = 1 + np.cumprod(passed & matched, axis=1).sum(1)
    t, st, dr = round_expectations(np.array([accept]), cap, np.array([beta]))
    assert t[0, cap] == pytest.approx(tokens.mean(), rel=0.01)
    assert st[0, cap] == pytest.approx(steps.mean(), rel=0.01)
    assert dr[0, cap] == pytest.approx(drafts.mean(), rel=0.01)
    assert (t[:, 0], st[:, 0], dr[:, 0]) == (1.0, 0.0, 0.0)


def test_rounds_whose_drafts_fail_the_threshold_are_not_worth_drafting():
    """Layer 6 matches 60% of the time but only the confident 20% clear τ: the paper's TPL
    drafts there, the gated objective sees a step paid for nothing 80% of the time."""
    p, ungated = make(exit_layers=[6]), make(exit_layers=[6], dynamic_threshold=False)
    p.model = ungated.model = ModelInfo(L, 64, 100, "LlamaForCausalLM", lm_head_layers=8.0)
    row = np.arange(100)
    match = (row % 5 < 3)[None, :]  # 60% match
    conf = np.where(row % 5 == 0, 0.95, 0.3)[None, :]  # only a third of the matches confident
    s, su = p.new_state(), ungated.new_state()
    for _ in range(20):  # the threshold exists from the second round on
        p.observe(s, feedback(match, conf))
        ungated.observe(su, feedback(match, conf))
    beta, accept = p.gate(s)
    assert beta[0] < 0.3 and accept[0] > 0.9  # (the first round had no threshold yet)
    assert ungated.propose(su).num_tokens > 0
    assert p.propose(s).num_tokens == 0


def test_real_confidence_stops_replace_the_shadow_pass_rate():
    """Shadow tokens say layer 6 passes τ and matches (draft); real drafts there keep getting
    stopped at the first token: DEL learns it from the rounds' feedback and stops drafting."""
    p = make(exit_layers=[6])
    p.model = ModelInfo(L, 64, 100, "LlamaForCausalLM", lm_head_layers=8.0)
    s = p.new_state()
    match = (np.arange(100) % 10 != 0)[None, :]
    conf = np.where(match, 0.9, 0.2)
    p.observe(s, feedback(match, conf))
    d = p.propose(s)
    assert d.num_tokens > 0 and s.last == (0, d.num_tokens)
    for _ in range(6):  # every real draft stopped at once: 0 drafts verified
        p.observe(s, Feedback(0, 0, 100))
        if p.propose(s).num_tokens == 0:
            break
    beta, _ = p.gate(s)
    assert beta[0] < 0.5 and p.propose(s).num_tokens == 0
    assert s.s_steps[0] >= 4 and s.s_stops[0] == pytest.approx(s.s_steps[0])

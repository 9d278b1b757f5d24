"""Cascade: exits and thresholds from the trained heads, clear errors, and the routing of a draft
step (first confident exit, shallowest first; no exit ends the round) on a fake model (no vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm_selfspec.config import SelfSpecConfig, SelfSpecConfigError
from vllm_selfspec.engine.executor import PlanExecutor
from vllm_selfspec.heads import HeadSet, ModelIdentity, make_head, save_heads
from vllm_selfspec.plans import LayerPlan
from vllm_selfspec.policies import ModelInfo
from vllm_selfspec.policies.cascade import CascadeExit, CascadePolicy

L, D, V = 8, 16, 32
MODEL = ModelInfo(num_layers=L, hidden_size=D, vocab_size=V, architecture="LlamaForCausalLM")
IDENT = ModelIdentity("LlamaForCausalLM", L, D, V, "0123456789abcdef")


def heads_dir(tmp_path, kind="cascade", layers=(2, 4, 6), ident=IDENT):
    heads = {}
    for i, layer in enumerate(layers):
        heads[layer] = make_head(kind, ident.hidden_size, 8 if kind == "cascade" else None)
        if kind == "cascade":
            heads[layer].threshold = 0.5 + 0.1 * i
    return save_heads(tmp_path / f"heads-{kind}", HeadSet(kind, heads, ident))


def policy(path, **opts) -> CascadePolicy:
    cfg = SelfSpecConfig.load({"method": "cascade", "heads": str(path), **opts})
    cfg.validate_for_model(MODEL)
    return cfg.make_policy(MODEL)


def test_exits_and_trained_thresholds(tmp_path):
    p = policy(heads_dir(tmp_path))
    assert p.cascade == (
        CascadeExit(2, "heads@2", 0.5),
        CascadeExit(4, "heads@4", 0.6),
        CascadeExit(6, "heads@6", 0.7),
    )
    d = p.propose(None)
    assert d.cascade == p.cascade and d.plan == LayerPlan.prefix(L, 6, "heads@6")
    assert d.num_tokens == 6  # the method's default draft length
    assert p.heads_path == str(tmp_path / "heads-cascade")


def test_threshold_overrides_and_exit_subset(tmp_path):
    path = heads_dir(tmp_path)
    assert [e.threshold for e in policy(path, thresholds=0.9).cascade] == [0.9] * 3
    p = policy(path, exit_layers=[6, 2], thresholds={"6": 0.25})
    assert [(e.layer, e.threshold) for e in p.cascade] == [(2, 0.5), (6, 0.25)]


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"exit_layers": [3]}, "subset of the trained exits"),
        ({"exit_layers": []}, "subset of the trained exits"),
        ({"thresholds": {"5": 0.5}}, "trained exits are"),
        ({"thresholds": {"2": 1.5}}, r"must be in \[0, 1\]"),
        ({"thresholds": "high"}, "thresholds must be"),
        ({"lossy": "yes"}, "lossy must be true or false"),
        ({"exit_layer": 4}, "unknown option"),
    ],
)
def test_bad_options_are_config_errors(tmp_path, opts, match):
    with pytest.raises(SelfSpecConfigError, match=match):
        policy(heads_dir(tmp_path), **opts)


def test_wrong_heads_are_refused_with_the_training_command(tmp_path):
    with pytest.raises(SelfSpecConfigError, match="kind 'adadecode'.*train-heads --kind cascade"):
        policy(heads_dir(tmp_path, kind="adadecode"))
    other = ModelIdentity("LlamaForCausalLM", L, D * 2, V, "0123456789abcdef")
    with pytest.raises(SelfSpecConfigError, match="hidden_size=32, this model has 16"):
        policy(heads_dir(tmp_path, ident=other))
    with pytest.raises(SelfSpecConfigError, match="train-heads --kind cascade"):
        policy(tmp_path / "nowhere")


def test_auto_heads_missing_says_how_to_train(tmp_path):
    cfg = SelfSpecConfig.load({"method": "cascade"})
    with pytest.raises(
        SelfSpecConfigError, match="no trained cascade heads.*train-heads --kind cascade --model"
    ):
        cfg.resolved(str(tmp_path / "some-model"))


# ---- routing of one draft step on a fake model ---------------------------------------------------
class _Layer(nn.Module):
    """Adds 1 to the stream (as vLLM's (pending, residual) pair) and counts its calls."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.calls = 0
        self.self_attn = SimpleNamespace(attn=SimpleNamespace(layer_name=f"l{i}"))
        self.input_layernorm = self.post_attention_layernorm = self.mlp = None

    def forward(self, positions, h, res):
        self.calls += 1
        stream = h if res is None else h + res
        return torch.ones_like(stream), stream


class _Head(nn.Module):
    """Confidence = row's value in a table per exit; transform = identity."""

    def __init__(self, conf: list[float], threshold: float) -> None:
        super().__init__()
        self.conf, self.threshold = torch.tensor(conf), threshold

    def transform(self, x):
        return x

    def confidence(self, x):
        return self.conf


def fake_executor(confs: dict[int, list[float]]) -> PlanExecutor:
    inner = nn.Module()
    inner.layers = nn.ModuleList(_Layer(i) for i in range(L))
    inner.embed_tokens = nn.Embedding(V, D)
    inner.embed_input_ids = lambda ids: torch.zeros(len(ids), D)
    inner.norm = lambda x: x
    model = SimpleNamespace(
        model=inner,
        logits_processor=SimpleNamespace(scale=1.0, soft_cap=None),
        compute_logits=lambda x: x[:, :1].repeat(1, V),
    )  # logits = stream
    ex = PlanExecutor(model)
    for layer, conf in confs.items():
        ex.heads[f"heads@{layer}"] = _Head(conf, 0.5)
    return ex


def test_rows_take_the_first_confident_exit_and_stop_when_none():
    exits = tuple(CascadeExit(layer, f"heads@{layer}", 0.5) for layer in (2, 4, 6))
    ex = fake_executor({2: [0.9, 0.1, 0.1], 4: [0.9, 0.8, 0.1], 6: [0.9, 0.9, 0.2]})
    plan = LayerPlan.prefix(L, 6)
    logits, chosen, depth = ex.run_cascade(
        plan,
        exits,
        torch.zeros(3, dtype=torch.long),
        torch.zeros(3, dtype=torch.long),
        torch.tensor([2] * 3),
    )
    assert chosen.tolist() == [0, 1, -1] and depth == 6
    # the stream after l layers is l: each row's logits come from its own exit
    assert logits[:, 0].tolist() == [2.0, 4.0, 0.0]
    assert [layer.calls for layer in ex.layout.layers] == [1] * 6 + [0] * 2


def test_the_step_goes_no_deeper_than_needed():
    exits = tuple(CascadeExit(layer, f"heads@{layer}", 0.5) for layer in (2, 4, 6))
    ex = fake_executor({2: [0.9, 0.1], 4: [0.9, 0.7], 6: [0.9, 0.9]})
    _, chosen, depth = ex.run_cascade(
        LayerPlan.prefix(L, 6),
        exits,
        torch.zeros(2, dtype=torch.long),
        torch.zeros(2, dtype=torch.long),
        torch.tensor([2, 2]),
    )
    assert chosen.tolist() == [0, 1] and depth == 4
    assert [layer.calls for layer in ex.layout.layers] == [1] * 4 + [0] * 4
    ex = fake_executor({2: [0.1], 4: [0.1], 6: [0.1]})
    logits, chosen, depth = ex.run_cascade(
        LayerPlan.prefix(L, 6),
        exits,
        torch.zeros(1, dtype=torch.long),
        torch.zeros(1, dtype=torch.long),
        torch.tensor([2]),
    )
    assert logits is None and chosen.tolist() == [-1] and depth == 6


def test_later_tokens_exit_no_deeper_than_the_previous_one():
    """max_exit caps each row's walk: a row confident only past its cap gets no exit, and the
    step stops at the deepest cap still undecided."""
    exits = tuple(CascadeExit(layer, f"heads@{layer}", 0.5) for layer in (2, 4, 6))
    ex = fake_executor({2: [0.1, 0.1, 0.9], 4: [0.9, 0.1, 0.9], 6: [0.9, 0.9, 0.9]})
    logits, chosen, depth = ex.run_cascade(
        LayerPlan.prefix(L, 6),
        exits,
        torch.zeros(3, dtype=torch.long),
        torch.zeros(3, dtype=torch.long),
        torch.tensor([0, 1, 0]),
    )
    assert chosen.tolist() == [-1, -1, 0] and depth == 4
    assert logits[:, 0].tolist() == [0.0, 0.0, 2.0]


# ---- the adaptive walk (optimal stopping over the exits) -------------------------------------
def _state(p: CascadePolicy, reached, confident, drafted, accepted):
    st = p.new_state()
    for arr, v in zip(
        (st.reached, st.confident, st.drafted, st.accepted), (reached, confident, drafted, accepted)
    ):
        arr[:] = v
    return st


def test_walk_goes_as_deep_as_it_pays(tmp_path):
    p = policy(heads_dir(tmp_path))  # layer units: G = 8 layers (no LM-head weight given)
    good = _state(p, [100] * 3, [50] * 3, [50] * 3, [49] * 3)
    assert p.walk_cap(good, 1.0) == 2  # accepted nearly always: worth walking to the last exit
    bad = _state(p, [100] * 3, [50] * 3, [50] * 3, [1] * 3)
    assert p.walk_cap(bad, 1.0) == -1  # rarely accepted: a plain decode step is better
    # only the shallowest exit is accepted: do not walk past it
    shallow = _state(p, [100] * 3, [50] * 3, [50] * 3, [49, 1, 1])
    assert p.walk_cap(shallow, 1.0) == 0
    # a later token of the round (its prefix accepted with probability 0.2) is not worth it
    assert p.walk_cap(good, 0.2) == -1
    assert policy(heads_dir(tmp_path), adaptive=False).walk_cap(bad, 1.0) == 2
    # no (or long faded) evidence: walk to the deepest exit to learn
    assert p.walk_cap(p.new_state(), 1.0) == 2
    faded = _state(p, [0.29, 0, 0], 0, 0, 0)
    assert p.walk_cap(faded, 1.0) == 2


def test_walk_uses_measured_costs(tmp_path):
    p = policy(heads_dir(tmp_path))
    st = _state(p, [100] * 3, [50] * 3, [50] * 3, [30] * 3)  # a = 0.6
    cheap = SimpleNamespace(
        draft_seconds=lambda x: 0.001 + 0.001 * x, verify_seconds=lambda n: 0.05 + 0.002 * n
    )
    dear = SimpleNamespace(
        draft_seconds=lambda x: 0.02 + 0.01 * x, verify_seconds=lambda n: 0.05 + 0.02 * n
    )
    p.costs = cheap
    assert p.walk_cap(st, 1.0) == 2
    p.costs = dear
    assert p.walk_cap(st, 1.0) == -1


def test_observe_counts_reached_confident_and_judged_drafts(tmp_path):
    from vllm_selfspec.policies import Feedback

    p = policy(heads_dir(tmp_path), omega=1.0)
    st = p.new_state()
    # round: token 1 at exit 1 (accepted), token 2 at exit 0 (rejected), token 3 at exit 0
    # (after a rejection: no verdict of its own), then no confident exit up to cap 0
    p.observe(st, Feedback(3, 1, 50, cascade_steps=[(2, 1), (1, 0), (0, 0), (0, -1)]))
    assert st.reached.tolist() == [4, 1, 0]
    assert st.confident.tolist() == [2, 1, 0]
    assert st.drafted.tolist() == [1, 1, 0] and st.accepted.tolist() == [0, 1, 0]
    pr, a = p.rates(st)
    assert pr[0] == pytest.approx((2 + 1) / (4 + 2)) and a[1] == pytest.approx((1 + 1) / 3)

import json

import pytest

from vllm_selfspec.config import SelfSpecConfig, SelfSpecConfigError, is_selfspec, peek_method
from vllm_selfspec.policies import DraftDecision, LayerSkipPolicy, ModelInfo

MODEL = ModelInfo(num_layers=30, hidden_size=576, vocab_size=49152, architecture="LlamaForCausalLM")


def test_defaults_and_forms(tmp_path):
    d = {"method": "layerskip", "exit_layer": 12}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(d))
    for form in (d, json.dumps(d), str(path), path):
        cfg = SelfSpecConfig.load(form)
        assert cfg.method == "layerskip" and cfg.num_speculative_tokens == 4
        assert cfg.options == {"exit_layer": 12, "skip_attn": [], "skip_mlp": []}
    assert SelfSpecConfig.load(cfg.to_dict()) == cfg


def test_detection():
    assert is_selfspec({"method": "layerskip"})
    assert not is_selfspec({"method": "ngram"})
    assert peek_method('{"method": "eagle"}') == "eagle"
    assert peek_method("/no/such/file") is None


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"method": "nope"}, "unknown selfspec method"),
        ({"method": "layerskip", "gamma": 3}, "unknown option"),
        ({"method": "layerskip", "num_speculative_tokens": 200}, "num_speculative_tokens"),
        ({"method": "layerskip", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "layerskip", "capture_tokens": 0}, "capture_tokens"),
        ({"method": "layerskip", "capture_tokens": 257}, r"capture_tokens must be .* \[1, 256\]"),
        ({"method": "auto", "lookup": {"shared": "yes"}}, "shared must be one of"),
        ({"method": "layerskip", "goodput": "yes"}, "goodput must be true or false"),
        ({"method": "layerskip", "lookup": {"max_depth": 0}}, "max_depth must be"),
        ({"method": "layerskip", "lookup": {"max_ngram": 4}}, "unknown lookup option"),
        ({"method": "layerskip", "self_draft_tokens": 5}, r"self_draft_tokens .* \[1, .*=4\]"),
        ({"method": "auto", "self_draft_tokens": 0}, "self_draft_tokens must be"),
        ({"method": "layerskip", "lookup": {"window": 3}}, "unknown lookup option"),
        ({"method": "adadecode", "lookup": True}, "cannot be combined with adadecode"),
        ({"method": "cascade", "lossy": True, "lookup": True}, "unverified"),
        ({"method": "auto", "exit_layer": 3}, "it chooses the method itself"),
        ("{not json", "not valid JSON"),
    ],
)
def test_errors(raw, match):
    with pytest.raises(SelfSpecConfigError, match=match):
        SelfSpecConfig.load(raw)


def test_model_checks():
    SelfSpecConfig.load({"method": "layerskip", "exit_layer": 30}).validate_for_model(MODEL)
    with pytest.raises(SelfSpecConfigError, match=r"\[1, 30\]"):
        SelfSpecConfig.load({"method": "layerskip", "exit_layer": 31}).validate_for_model(MODEL)
    other = ModelInfo(4, 64, 100, "GPT2LMHeadModel")
    with pytest.raises(SelfSpecConfigError, match="architecture.*Qwen3ForCausalLM"):
        SelfSpecConfig.load({"method": "layerskip", "exit_layer": 2}).validate_for_model(other)
    qwen = ModelInfo(4, 64, 100, "Qwen2ForCausalLM")
    SelfSpecConfig.load({"method": "layerskip", "exit_layer": 2}).validate_for_model(qwen)


def test_layerskip_policy_is_static():
    cfg = SelfSpecConfig.load({"method": "layerskip", "exit_layer": 9, "num_speculative_tokens": 3})
    policy = cfg.make_policy(MODEL)
    assert isinstance(policy, LayerSkipPolicy)
    d = policy.propose(policy.new_state())
    assert isinstance(d, DraftDecision) and d.num_tokens == 3 and d.min_confidence is None
    assert d.plan.exit_layer == 9 and d.plan.layer_cost == 9


def test_layerskip_skip_set_defaults_to_full_depth():
    cfg = SelfSpecConfig.load({"method": "layerskip", "skip_attn": [1], "skip_mlp": [2, 3]})
    plan = cfg.make_policy(MODEL).propose(None).plan
    assert plan.exit_layer == 30 and plan.num_sublayers == 60 - 3


def test_auto_resolves_to_a_concrete_method_with_lookup_and_the_controller(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    cfg = SelfSpecConfig.load({"method": "auto"})
    assert is_selfspec({"method": "auto"}) and cfg.lookup and cfg.goodput
    cfg.validate_for_model(MODEL)  # the concrete method is validated once resolved
    concrete = cfg.resolved(str(tmp_path))  # no heads cached for this model
    assert concrete.method == "layerskip" and concrete.options["exit_layer"] == 28
    assert concrete.lookup == {**cfg.lookup, "datastore": None} and concrete.goodput
    # lookup drafts up to 16 tokens, a self-draft round up to 6
    assert concrete.num_speculative_tokens == cfg.num_speculative_tokens == 16
    assert concrete.self_draft_tokens == 6
    assert concrete.make_policy(MODEL).max_draft_tokens == 6
    off = SelfSpecConfig.load({"method": "auto", "lookup": False, "goodput": False})
    assert not off.resolved(str(tmp_path)).lookup
    with pytest.raises(SelfSpecConfigError, match="cannot read the model's config"):
        cfg.resolved(str(tmp_path / "missing"))


def test_goodput_and_lookup_round_trip():
    cfg = SelfSpecConfig.load({"method": "layerskip", "goodput": False, "lookup": {"max_depth": 8}})
    assert not cfg.goodput and cfg.lookup == {
        "max_depth": 8,
        "max_spec_factor": 2.0,
        "min_token_prob": 0.1,
        "shared": "tenant",
        "datastore": "auto",
    }
    assert SelfSpecConfig.load(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "layerskip", "exit_layer": 12, "num_speculative_tokens": 5},
        {"method": "layerskip", "goodput": False, "lookup": {"max_depth": 8, "datastore": None}},
        {"method": "auto", "self_draft_tokens": 3},
        {"method": "del", "heads": "none", "shadow_every": 2, "draft_vocab_size": None},
        {"method": "knapspec", "interval": 8, "lookup": True, "capture_tokens": 16},
        {"method": "cascade", "heads": "/some/heads", "lossy": True},
        {"method": "adadecode", "heads": "/some/heads", "threshold": 0.5},
        {"method": "feature", "heads": "/h", "draft_vocab_size": 4096, "draft_vocab": "/v"},
    ],
)
def test_workers_rebuild_the_front_ends_config(spec, tmp_path):
    """The workers rebuild the config the front end parsed, checked and resolved from what it
    stored, without parsing it again; the draft length comes from vLLM's speculative_config."""
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    cfg = SelfSpecConfig.load(spec).resolved(str(tmp_path))
    stored = cfg.stored()
    assert "num_speculative_tokens" not in stored
    rebuilt = SelfSpecConfig.from_stored(stored, cfg.num_speculative_tokens)
    assert rebuilt == cfg == SelfSpecConfig.load(cfg.to_dict())
    assert stored == cfg.stored()  # the stored dict is not consumed


@pytest.mark.parametrize("layers", [[12.0], 12, [True]])
def test_trained_exits_are_integers(layers):
    """``12.0`` equals 12 to ``in``: a float exit once passed these checks and crashed a worker."""
    from vllm_selfspec.policies.adadecode import AdaDecodePolicy
    from vllm_selfspec.policies.cascade import CascadePolicy

    with pytest.raises(ValueError, match="exit_layers must be a non-empty subset"):
        CascadePolicy.exits(
            {"exit_layers": layers, "thresholds": None}, {"thresholds": {"12": 0.5}}
        )
    with pytest.raises(ValueError, match="exit_layers must be a non-empty subset"):
        AdaDecodePolicy.exits({"exit_layers": layers}, {"layers": [1, 12]})


def test_lookup_without_the_suffix_tree_module_fails_with_the_command_to_get_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_arctic(name, *args, **kwargs):
        if name.startswith("arctic_inference"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_arctic)
    with pytest.raises(SelfSpecConfigError, match="install_suffix_decoding.sh"):
        SelfSpecConfig.load({"method": "auto"})
    SelfSpecConfig.load({"method": "layerskip"})  # no lookup: no suffix trees needed

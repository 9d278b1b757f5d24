"""The reduced draft vocabulary's token-frequency map (vllm_selfspec.vocab) and its config."""

import json

import pytest
import torch

from vllm_selfspec.config import SelfSpecConfig, SelfSpecConfigError
from vllm_selfspec.heads.identity import HeadsMismatchError, ModelIdentity
from vllm_selfspec.policies import ModelInfo
from vllm_selfspec.vocab import (
    DraftVocabError,
    count_tokens,
    coverage,
    identity_from_checkpoint,
    load_vocab,
    ranking,
    save_vocab,
)

IDENT = ModelIdentity("LlamaForCausalLM", 4, 64, 10, "0123456789abcdef")
MODEL = ModelInfo(num_layers=4, hidden_size=64, vocab_size=10, architecture="LlamaForCausalLM")


def test_ranking_is_by_count_then_lower_id():
    counts = count_tokens([[3, 3, 7], [7, 1], []], 10)
    assert counts.tolist() == [0, 1, 0, 2, 0, 0, 0, 2, 0, 0]
    assert ranking(counts).tolist() == [3, 7, 1, 0, 2, 4, 5, 6, 8, 9]


def test_save_load_round_trip_and_coverage(tmp_path):
    counts = count_tokens([[5, 5, 5, 2, 2, 9]], 10)
    out = save_vocab(tmp_path / "v", counts, IDENT, {"sources": "test"})
    assert load_vocab(out, 2, expect=IDENT).tolist() == [5, 2]
    assert load_vocab(out, 10, expect=None).tolist() == [5, 2, 9, 0, 1, 3, 4, 6, 7, 8]
    assert coverage(out, [1, 2, 3]) == pytest.approx({1: 0.5, 2: 5 / 6, 3: 1.0})
    with pytest.raises(DraftVocabError, match=r"\[1, 10\]"):
        load_vocab(out, 11, expect=IDENT)


def test_a_map_for_another_model_is_refused(tmp_path):
    out = save_vocab(tmp_path / "v", torch.ones(10, dtype=torch.int64), IDENT, {})
    other = ModelIdentity("LlamaForCausalLM", 4, 64, 10, "ffffffffffffffff")
    with pytest.raises(HeadsMismatchError, match="fingerprint"):
        load_vocab(out, 4, expect=other)


def test_malformed_maps_are_refused(tmp_path):
    with pytest.raises(DraftVocabError, match="no config.json"):
        load_vocab(tmp_path, 4, expect=None)
    out = save_vocab(tmp_path / "v", torch.ones(10, dtype=torch.int64), IDENT, {})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "format": "something-else"}))
    with pytest.raises(DraftVocabError, match="expected format"):
        load_vocab(out, 4, expect=None)


def test_identity_from_checkpoint_matches_the_tensors(tmp_path):
    from safetensors.torch import save_file

    from vllm_selfspec.heads.identity import identity_from_tensors

    g = torch.Generator().manual_seed(0)
    emb, norm = torch.randn(100, 16, generator=g), torch.randn(16, generator=g)
    save_file(
        {"model.embed_tokens.weight": emb, "model.norm.weight": norm},
        str(tmp_path / "model.safetensors"),
    )
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": 2,
                "hidden_size": 16,
                "vocab_size": 100,
            }
        )
    )
    want = identity_from_tensors(
        architecture="LlamaForCausalLM",
        num_layers=2,
        hidden_size=16,
        vocab_size=100,
        embed_weight=emb,
        norm_weight=norm,
    )
    assert identity_from_checkpoint(tmp_path) == want


def test_config_options(tmp_path):
    cfg = SelfSpecConfig.load({"method": "layerskip", "exit_layer": 2, "draft_vocab_size": 4})
    assert cfg.draft_vocab_size == 4 and cfg.draft_vocab == "auto"
    assert SelfSpecConfig.load(cfg.to_dict()) == cfg
    for bad in (0, 2.5, True, "4k"):
        with pytest.raises(SelfSpecConfigError, match="draft_vocab_size"):
            SelfSpecConfig.load({"method": "layerskip", "draft_vocab_size": bad})
    with pytest.raises(SelfSpecConfigError, match="exceeds"):
        SelfSpecConfig.load(
            {"method": "layerskip", "exit_layer": 2, "draft_vocab_size": 11}
        ).validate_for_model(MODEL)


def test_auto_without_a_cached_map_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SELFSPEC_HOME", str(tmp_path / "home"))
    cfg = SelfSpecConfig.load({"method": "layerskip", "exit_layer": 2, "draft_vocab_size": 4})
    with pytest.raises(SelfSpecConfigError, match="vllm-selfspec build-vocab --model"):
        cfg.resolved(str(tmp_path / "some-model"))
    # without draft_vocab_size nothing is looked up
    SelfSpecConfig.load({"method": "layerskip", "exit_layer": 2}).resolved(str(tmp_path))


def test_an_explicit_map_is_checked_against_the_model(tmp_path):
    out = save_vocab(tmp_path / "v", torch.ones(10, dtype=torch.int64), IDENT, {})
    ok = SelfSpecConfig.load(
        {"method": "layerskip", "exit_layer": 2, "draft_vocab_size": 4, "draft_vocab": str(out)}
    )
    ok.resolved("unused").validate_for_model(MODEL)
    bigger = ModelInfo(num_layers=4, hidden_size=64, vocab_size=20, architecture="LlamaForCausalLM")
    with pytest.raises(SelfSpecConfigError, match="vocab_size=10"):
        ok.validate_for_model(bigger)
    missing = SelfSpecConfig.load(
        {
            "method": "layerskip",
            "exit_layer": 2,
            "draft_vocab_size": 4,
            "draft_vocab": str(tmp_path / "no"),
        }
    )
    with pytest.raises(SelfSpecConfigError, match="draft_vocab: .*not a draft-vocabulary"):
        missing.validate_for_model(MODEL)


def test_auto_size_uses_a_cached_map_or_the_full_vocabulary(tmp_path, monkeypatch):
    from vllm_selfspec.config import AUTO_DRAFT_VOCAB_SIZE
    from vllm_selfspec.vocab import default_vocab_dir

    monkeypatch.setenv("VLLM_SELFSPEC_HOME", str(tmp_path / "home"))
    model = str(tmp_path / "m")
    cfg = SelfSpecConfig.load({"method": "layerskip", "exit_layer": 2, "draft_vocab_size": "auto"})
    assert cfg.resolved(model).draft_vocab_size is None  # no map: full vocabulary, no error
    save_vocab(default_vocab_dir(model), torch.ones(10, dtype=torch.int64), IDENT, {})
    r = cfg.resolved(model)
    assert r.draft_vocab_size == AUTO_DRAFT_VOCAB_SIZE and r.draft_vocab == str(
        default_vocab_dir(model)
    )


def test_auto_size_is_the_methods_own_when_it_has_one(tmp_path, monkeypatch):
    from vllm_selfspec.vocab import default_vocab_dir

    monkeypatch.setenv("VLLM_SELFSPEC_HOME", str(tmp_path / "home"))
    model = str(tmp_path / "m")
    save_vocab(default_vocab_dir(model), torch.ones(10, dtype=torch.int64), IDENT, {})
    cfg = SelfSpecConfig.load({"method": "adadecode", "heads": "some-dir"})
    assert cfg.resolved(model).draft_vocab_size == 4096  # AdaDecodePolicy.auto_draft_vocab_size


def test_generations_round_trip_and_are_checked(tmp_path):
    from vllm_selfspec.vocab import load_generations

    gens = [[1, 2, 3], [], [9, 9]]
    out = save_vocab(tmp_path / "v", count_tokens(gens, 10), IDENT, {}, gens)
    assert load_generations(out, expect=IDENT) == gens
    other = ModelIdentity("LlamaForCausalLM", 4, 64, 10, "ffffffffffffffff")
    with pytest.raises(HeadsMismatchError, match="fingerprint"):
        load_generations(out, expect=other)
    bare = save_vocab(tmp_path / "w", count_tokens(gens, 10), IDENT, {})
    with pytest.raises(DraftVocabError, match="build-vocab --force"):
        load_generations(bare, expect=IDENT)


def test_lookup_datastore_resolves_to_the_cached_generations(tmp_path, monkeypatch):
    from vllm_selfspec.vocab import default_vocab_dir

    monkeypatch.setenv("VLLM_SELFSPEC_HOME", str(tmp_path / "home"))
    model = str(tmp_path / "m")
    cfg = SelfSpecConfig.load({"method": "layerskip", "exit_layer": 2, "lookup": True})
    assert cfg.lookup["datastore"] == "auto"
    assert cfg.resolved(model).lookup["datastore"] is None  # nothing cached: no datastore
    save_vocab(default_vocab_dir(model), torch.ones(10, dtype=torch.int64), IDENT, {})
    assert cfg.resolved(model).lookup["datastore"] is None  # a map without generations
    save_vocab(default_vocab_dir(model), torch.ones(10, dtype=torch.int64), IDENT, {}, [[1, 2]])
    assert cfg.resolved(model).lookup["datastore"] == str(default_vocab_dir(model))
    named = {"method": "layerskip", "exit_layer": 2, "lookup": {"datastore": str(tmp_path / "v")}}
    with pytest.raises(SelfSpecConfigError, match="lookup: datastore: .*not a draft-vocabulary"):
        SelfSpecConfig.load(named).resolved(model)
    save_vocab(tmp_path / "v", torch.ones(10, dtype=torch.int64), IDENT, {})
    with pytest.raises(SelfSpecConfigError, match="holds no corpus generations"):
        SelfSpecConfig.load(named).resolved(model)
    save_vocab(tmp_path / "v", torch.ones(10, dtype=torch.int64), IDENT, {}, [[3]])
    assert SelfSpecConfig.load(named).resolved(model).lookup["datastore"] == str(tmp_path / "v")

"""The benchmark's method configs (``bench.method_configs``): defaults that fit the model."""

from __future__ import annotations

import pytest

from vllm_selfspec.tools.bench import method_configs, parse_engine_args


@pytest.mark.parametrize("layers,exit_layer", [(30, 28), (18, 16), (2, 1)])
def test_layerskip_defaults_to_two_layers_short_of_the_model(layers, exit_layer):
    configs = method_configs("ngram,layerskip", None, layers)
    assert list(configs) == ["vanilla", "ngram", "layerskip"] and configs["vanilla"] is None
    assert configs["layerskip"] == {
        "method": "layerskip",
        "num_speculative_tokens": 1,
        "exit_layer": exit_layer,
    }


def test_overrides_and_variants_merge_into_the_defaults():
    configs = method_configs(
        "layerskip,ls8", '{"layerskip": {"exit_layer": 12}, "ls8": {"method": "layerskip"}}', 18
    )
    assert configs["layerskip"]["exit_layer"] == 12
    assert configs["ls8"] == {"method": "layerskip", "num_speculative_tokens": 1, "exit_layer": 16}
    with pytest.raises(ValueError, match="not in --methods"):
        method_configs("layerskip", '{"del": {}}', 18)


def test_vllm_methods_run_as_peers():
    """Any of vLLM's own methods is a peer under its name or a label; suffix decoding by default
    with vLLM's defaults."""
    configs = method_configs(
        "suffix,sfx8,ngram", '{"sfx8": {"method": "suffix", "num_speculative_tokens": 8}}', 30
    )
    assert configs["suffix"] == {"method": "suffix"}
    assert configs["sfx8"] == {"method": "suffix", "num_speculative_tokens": 8}
    assert configs["ngram"]["method"] == "ngram"
    with pytest.raises(ValueError, match="unknown method 'nope'.*suffix"):
        method_configs("nope", None, 30)


def test_a_label_runs_in_its_own_mode():
    """An eager vanilla beside compiled engines (or the reverse), in the same run."""
    from vllm_selfspec.tools.bench import split_engine

    configs = method_configs(
        "vanilla-eager",
        '{"vanilla-eager": {"method": "vanilla", "engine": {"enforce_eager": true}}}',
    )
    assert split_engine(configs["vanilla-eager"]) == (None, {"enforce_eager": True})
    assert split_engine(configs["vanilla"]) == (None, {})
    with pytest.raises(ValueError, match="vanilla takes only"):
        method_configs("v2", '{"v2": {"method": "vanilla", "exit_layer": 3}}')


def test_each_repeat_empties_suffix_decodings_global_tree():
    """vLLM's suffix method keeps one global tree of past responses: a repeat of the same prompts
    would draft the previous repeat's outputs (95% acceptance), which no real workload offers."""
    from types import SimpleNamespace

    from vllm_selfspec.tools.bench import forget_cross_request_memory

    class Cache:  # arctic_inference's SuffixDecodingCache, as vLLM's proposer holds it
        def __init__(self, max_tree_depth, max_cached_requests):
            self.max_tree_depth, self.max_cached_requests = max_tree_depth, max_cached_requests
            self.cached = []

    old = Cache(24, 10000)
    old.cached.append("a response")
    worker = SimpleNamespace(
        model_runner=SimpleNamespace(drafter=SimpleNamespace(suffix_cache=old))
    )
    llm = SimpleNamespace(collective_rpc=lambda fn: [fn(worker)])
    forget_cross_request_memory(llm, {"method": "suffix"})
    new = worker.model_runner.drafter.suffix_cache
    assert new is not old and new.cached == []
    assert (new.max_tree_depth, new.max_cached_requests) == (24, 10000)
    forget_cross_request_memory(llm, {"method": "ngram"})  # nothing to forget
    assert worker.model_runner.drafter.suffix_cache is new


def test_engine_args_for_every_engine():
    assert parse_engine_args(None) == {}
    assert parse_engine_args('{"dtype": "bfloat16"}') == {"dtype": "bfloat16"}
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_engine_args("{dtype}")
    with pytest.raises(ValueError, match="JSON object"):
        parse_engine_args('["dtype"]')

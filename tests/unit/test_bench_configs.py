"""The benchmark's method configs (``bench.method_configs``): defaults that fit the model."""

from __future__ import annotations

import pytest

from vllm_selfspec.bench import method_configs


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

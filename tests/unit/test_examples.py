"""examples/selfspec-<method>.json: one ready config per selfspec method, each valid for the
embedded model (SmolLM2-135M: 30 layers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_selfspec.config import SelfSpecConfig, methods
from vllm_selfspec.policies import ModelInfo

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EMBEDDED = ModelInfo(
    num_layers=30,
    hidden_size=576,
    vocab_size=49152,
    architecture="LlamaForCausalLM",
    lm_head_layers=8.0,
)


def test_one_example_per_method():
    have = {p.stem.removeprefix("selfspec-") for p in EXAMPLES.glob("selfspec-*.json")}
    assert have == set(methods())


@pytest.mark.parametrize("method", sorted(methods()))
def test_example_is_valid(method):
    cfg = SelfSpecConfig.load(str(EXAMPLES / f"selfspec-{method}.json"))
    assert cfg.method == method
    cfg.validate_for_model(EMBEDDED)

import pytest
import torch

from vllm_selfspec import compat
from vllm_selfspec.engine.stats import EngineStats
from vllm_selfspec.plugin import expand_batch_to_tokens


def test_version_check():
    compat.check_vllm_version("0.32.0")
    compat.check_vllm_version("0.32.3")
    with pytest.raises(RuntimeError, match="supports vLLM 0.32.x only"):
        compat.check_vllm_version("0.33.0")


@pytest.mark.parametrize(
    "x",
    [
        torch.tensor([0.0, 0.7, 1.3]),
        torch.tensor([0, 5, 9]),
        torch.tensor([0.0, 0.7, 1.3], dtype=torch.float64),
    ],
)
def test_expand_batch_to_tokens(x):
    cu = torch.tensor([2, 2, 5])
    out = expand_batch_to_tokens(x, cu, 5, replace_from=0, replace_to=1)
    want = torch.tensor([1, 1, x[2], x[2], x[2]], dtype=x.dtype)
    assert out.dtype == x.dtype and torch.equal(out, want)


def test_vllm_spec_methods_known():
    methods = compat.vllm_spec_methods()
    assert "ngram" in methods and "custom_class" in methods


def test_stats_tokens_per_layer():
    s = EngineStats()
    s.generated_tokens, s.draft_layers, s.target_layers = 10, 20.0, 60.0
    s.seconds.update(draft=1.0, policy=0.5, shadow=0.0, step=4.0)
    d = s.as_dict()
    assert d["tokens_per_layer"] == 10 / 80
    assert d["time_s"]["verify"] == 2.5
    s.reset()
    assert s.as_dict()["generated_tokens"] == 0

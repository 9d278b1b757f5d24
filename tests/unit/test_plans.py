import pytest

from vllm_selfspec.plans import LM_HEAD, LayerPlan


def test_prefix_plan():
    p = LayerPlan.prefix(30, 12)
    assert p.exit_layer == 12 and all(p.attn) and all(p.mlp)
    assert p.layer_cost == 12 and not p.is_full
    assert p.describe() == "exit@12/30"


def test_full_plan_is_the_canary():
    p = LayerPlan.full(30)
    assert p.is_full and p.layer_cost == 30 and p.head == LM_HEAD


def test_skip_plan_counts_half_layers():
    p = LayerPlan.skip(8, skip_attn=[1, 3], skip_mlp=[2])
    assert p.exit_layer == 8
    assert p.attn_layers() == [0, 2, 4, 5, 6, 7]
    assert p.num_sublayers == 13 and p.layer_cost == 6.5
    assert "skip_attn=[1, 3]" in p.describe()


def test_plans_are_hashable_keys():
    assert LayerPlan.prefix(30, 12) == LayerPlan.skip(30, exit_layer=12)
    assert len({LayerPlan.prefix(30, 12), LayerPlan.prefix(30, 12), LayerPlan.full(30)}) == 2


@pytest.mark.parametrize("kw", [dict(skip_attn=[30]), dict(skip_mlp=[-1])])
def test_skip_indices_checked(kw):
    with pytest.raises(ValueError, match="outside"):
        LayerPlan.skip(30, **kw)


def test_exit_layer_checked():
    with pytest.raises(ValueError):
        LayerPlan.prefix(30, 31)

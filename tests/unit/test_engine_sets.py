"""benchmarks/engine_sets.py: pooling the sets of a bench run repeated with new engines."""

import doctest
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_sets.py"


def _module():
    spec = importlib.util.spec_from_file_location("engine_sets", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _set(speedups: dict[str, list[float]], parity: float = 1.0, step: float | None = None):
    methods = {}
    for name, runs in speedups.items():
        m = {
            "speedup": sorted(runs)[len(runs) // 2],
            "speedup_runs": runs,
            "full_batch_speedup_runs": [r + 0.1 for r in runs],
            "parity": parity,
        }
        if step is not None:
            m["selfspec_stats"] = {"steps": 100, "time_s": {"verify": step * 100 / 1000}}
        methods[name] = m
    return {"methods": methods, "settings": {"command_line": "python -m vllm_selfspec.tools.bench"}}


def test_the_docstring_example_holds():
    mod = _module()
    result = doctest.testmod(mod)
    assert result.attempted > 0 and result.failed == 0


def test_the_pooled_speedup_is_the_median_of_every_sets_repeats_not_of_the_sets_medians():
    mod = _module()
    # one set's engines drew a fast vanilla: its three repeats all read low
    sets = [
        _set({"m": [0.94, 0.95, 0.96]}),
        _set({"m": [0.97, 1.01, 1.02]}),
        _set({"m": [0.98, 1.00, 1.03]}),
    ]
    p = mod.pool(sets)["m"]
    assert p["per_set"] == [0.95, 1.01, 1.00]
    assert p["speedup"] == 0.98  # the median of the nine repeats (of the sets' medians: 1.00)
    assert p["range"] == (0.94, 1.03)
    assert p["full_batch_speedup"] == pytest.approx(1.08)


def test_parity_is_the_lowest_sets_and_step_times_come_per_set():
    mod = _module()
    sets = [_set({"m": [1.0]}, parity=1.0, step=50.0), _set({"m": [1.0]}, parity=0.9, step=52.0)]
    p = mod.pool(sets)["m"]
    assert p["parity"] == 0.9
    assert p["step_ms"] == pytest.approx([50.0, 52.0])
    table = mod.markdown(mod.pool(sets), ["cmd 1", "cmd 2"])
    assert "| m | 1.000 / 1.000 | 1.000x [1.000, 1.000] | 1.100x | 0.90 | 50.0 / 52.0 |" in table
    assert "- set 2: `cmd 2`" in table


def test_sets_that_ran_different_methods_are_refused():
    mod = _module()
    with pytest.raises(ValueError, match="set 2 ran"):
        mod.pool([_set({"a": [1.0]}), _set({"b": [1.0]})])


def test_against_every_vanilla_engine_divides_by_their_geometric_mean_per_repeat():
    mod = _module()

    def with_configs(speedups):
        result = _set(speedups)
        for name, m in result["methods"].items():
            m["config"] = None if name.startswith("vanilla") else {"method": name}
        return result

    # repeat 1 drew a slow A/A engine (0.81 of the reference): the baseline is sqrt(0.81) = 0.9
    sets = [with_configs({"vanilla": [1.0, 1.0], "vanilla2": [0.81, 1.0], "m": [0.9, 1.1]})]
    p = mod.pool(sets)
    assert p["m"]["speedup"] == pytest.approx(1.0)  # against the reference alone
    assert p["m"]["vs_vanillas"] == pytest.approx(1.05)  # 0.9 / 0.9 and 1.1 / 1.0
    assert p["m"]["vs_vanillas_range"] == pytest.approx((1.0, 1.1))
    assert p["vanilla2"]["vs_vanillas"] == pytest.approx(0.95)  # 0.81 / 0.9 and 1.0
    table = mod.markdown(p, ["cmd"])
    assert "against every vanilla engine" in table
    assert "| 1.050x [1.000, 1.100]; 1.049x +- 0.048 |" in table
    # the geometric mean of 1.0 and 1.1, and the standard error of log 1.0, log 1.1
    assert p["m"]["vs_vanillas_mean"] == pytest.approx(1.1**0.5)
    assert p["m"]["vs_vanillas_error"] == pytest.approx(0.0953102 / 2**0.5 / 2**0.5, rel=1e-5)
    # one repeat: a mean, no error
    one = mod.pool([with_configs({"vanilla": [1.0], "vanilla2": [1.0], "m": [1.2]})])
    assert one["m"]["vs_vanillas_error"] is None
    assert "| 1.200x [1.200, 1.200]; 1.200x |" in mod.markdown(one, ["cmd"])
    # without an A/A engine there is nothing to average: no column
    alone = mod.pool([with_configs({"vanilla": [1.0, 1.0], "m": [0.9, 1.1]})])
    assert alone["m"]["vs_vanillas"] is None
    assert "against every vanilla engine" not in mod.markdown(alone, ["cmd"])

"""benchmarks/gpu_check.py's choices: which methods run with which heads, and when a parity run
passes. The whole check runs on the CPU in tests/engine/test_gpu_check.py."""

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks itself up there
    spec.loader.exec_module(mod)
    return mod


def test_methods_that_need_heads_run_with_the_heads_given_else_are_skipped(tmp_path):
    gc = _module()
    model = str(tmp_path / "model")  # not the embedded model: no cached heads
    options, skipped = gc.selfspec_methods(model, {}, cuda=True)
    assert set(options) == {"layerskip", "del", "knapspec", "auto"}
    assert set(skipped) == {"cascade", "adadecode", "feature"}
    assert "--heads cascade=DIR" in skipped["cascade"]

    options, skipped = gc.selfspec_methods(model, {"adadecode": "/h/ada"}, cuda=True)
    assert options["adadecode"] == {"heads": "/h/ada", "engine": {"enforce_eager": True}}
    assert options["del"] == {"heads": "/h/ada"}  # DEL drafts through AdaDecode heads
    assert set(skipped) == {"cascade", "feature"}
    options, _ = gc.selfspec_methods(model, {"adadecode": "/h/ada"}, cuda=False)
    assert options["adadecode"] == {"heads": "/h/ada"}  # CUDA graphs only on CUDA


def _result(parity: float, drafted: int) -> dict:
    counters = {"drafts": 1, "draft_tokens": drafted, "accepted_tokens": drafted // 2}
    return {"parity": parity, "spec_decode_counters": counters}


def test_a_method_passes_parity_only_when_it_drafted_and_every_output_is_vanillas():
    gc = _module()
    res = {
        "command": "vllm-selfspec bench ...",
        "methods": {"a": _result(1.0, 10), "b": _result(1.0, 0), "c": _result(0.75, 10)},
    }
    rows = gc.parity_rows(res, ["a", "b", "c"], batch=8)
    assert [r["ok"] for r in rows] == [True, False, False]
    failed = gc.parity_rows({"command": "x", "error": "boom"}, ["a"], batch=1)
    assert failed[0]["ok"] is False and failed[0]["error"] == "boom"
    table = "\n".join(gc.parity_section(rows + failed, {}, gc.CUDA, cuda=True))
    assert "| b | 8 | 1.00 | 0 | 0 | FAIL: drafted nothing |" in table
    assert "| c | 8 | 0.75 | 10 | 5 | FAIL |" in table
    assert "| a | 1 | – | – | – | FAIL: did not run |" in table and "boom" in table
    assert "VLLM_BATCH_INVARIANT=1" in table


def test_unknown_methods_or_peers_are_refused_before_anything_runs(capsys):
    gc = _module()
    assert gc.main(["model", "--cpu", "--methods", "layerskip,lookahead"]) == 2
    assert "unknown method(s) ['lookahead']" in capsys.readouterr().err
    assert gc.main(["model", "--cpu", "--peers", "eagle"]) == 2
    assert "unknown method(s) ['eagle']" in capsys.readouterr().err

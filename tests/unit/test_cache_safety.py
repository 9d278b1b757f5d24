"""Cache files that survive crashes, concurrent writers and damage (vllm_selfspec.cachedir, and the
heads, vocabulary and latency caches that use it): each test plants one fault."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vllm_selfspec import cachedir
from vllm_selfspec.heads import HeadSet, HeadsFormatError, load_heads, make_head, save_heads
from vllm_selfspec.heads.identity import ModelIdentity
from vllm_selfspec.vocab import DraftVocabError, load_generations, load_vocab, save_vocab

IDENT = ModelIdentity("LlamaForCausalLM", 4, 64, 10, "0123456789abcdef")


def write_version(d: Path, tag: str, files: int = 3) -> None:
    for i in range(files):
        (d / f"part{i}").write_text(tag)


def version_of(out: Path) -> set[str]:
    """The tags of a cache dir's files: one tag when the version is whole."""
    return {p.read_text() for p in out.iterdir()}


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


# ---- cachedir --------------------------------------------------------------------------------
def test_staged_replaces_a_version_whole_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "cache"
    with cachedir.staged(out) as tmp:
        write_version(tmp, "a")
    with cachedir.staged(out) as tmp:
        write_version(tmp, "b", files=2)
    assert version_of(out) == {"b"} and len(list(out.iterdir())) == 2
    assert leftovers(out) == [".cache.lock"]


def test_a_failed_build_keeps_the_old_version(tmp_path):
    out = tmp_path / "cache"
    with cachedir.staged(out) as tmp:
        write_version(tmp, "a")
    with pytest.raises(RuntimeError), cachedir.staged(out) as tmp:
        write_version(tmp, "b", files=1)
        raise RuntimeError("killed mid-write")
    assert version_of(out) == {"a"} and leftovers(out) == [".cache.lock"]


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_crash_while_publishing_leaves_a_whole_version(tmp_path, monkeypatch, exchange):
    """A crash at the publish step (the process dies between its renames; on the fallback path
    the old version is aside): a reader still finds one whole version, and the next writer
    cleans up. The remove-then-rename this replaced left no cache at all here."""
    out = tmp_path / "cache"
    with cachedir.staged(out) as tmp:
        write_version(tmp, "a")
    real_exchange, real_rename = cachedir._exchange, os.rename

    def crash_after(fn):
        def run(*args):
            fn(*args)
            raise KeyboardInterrupt("the process dies here")

        return run

    if exchange:
        monkeypatch.setattr(cachedir, "_exchange", crash_after(real_exchange))
    else:
        monkeypatch.setattr(cachedir, "_exchange", lambda a, b: False)
        monkeypatch.setattr(cachedir.os, "rename", crash_after(real_rename))
    monkeypatch.setattr(cachedir.shutil, "rmtree", lambda *a, **k: None)  # a dead process
    with pytest.raises(KeyboardInterrupt), cachedir.staged(out) as tmp:
        write_version(tmp, "b")
    monkeypatch.undo()
    if exchange:  # one atomic swap: the new version is in, the old one is left to clean
        assert version_of(out) == {"b"}
    else:  # the old version is aside and nothing is at ``out`` until the next writer
        assert not out.exists()
    # the dead writer's leftovers carry its pid; pretend that process is gone
    for p in out.parent.glob(".cache.*-*"):
        p.rename(p.with_name(p.name.replace(f"-{os.getpid()}-", "-999999999-")))
    with cachedir.staged(out) as tmp:  # the next writer puts back or removes them
        if not exchange:
            assert version_of(out) == {"a"}
        write_version(tmp, "c")
    assert version_of(out) == {"c"} and leftovers(out) == [".cache.lock"]


#: a writer process: five versions of 20 files, each file written a millisecond apart
WRITER = """
import sys, time
from vllm_selfspec import cachedir
out, tag, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
time.sleep(max(0.0, start - time.time()))
for _ in range(5):
    with cachedir.staged(out) as tmp:
        for i in range(20):
            (tmp / f"part{i}").write_text(tag)
            time.sleep(0.001)
"""


def test_concurrent_writers_never_mix_their_versions(tmp_path):
    out = tmp_path / "cache"
    start = time.time() + 3.0
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(out), t, str(start)]) for t in "xyz"
    ]
    seen = set()
    while any(p.poll() is None for p in procs):
        if not out.exists():  # before the first publish
            continue
        with cachedir.reading(out):
            tags = version_of(out)
        if tags:
            seen.add(frozenset(tags))
    assert [p.wait() for p in procs] == [0, 0, 0]
    assert all(len(t) == 1 for t in seen), seen  # a reader never saw two versions mixed
    assert len(version_of(out)) == 1 and len(list(out.iterdir())) == 20
    assert leftovers(out) == [".cache.lock"]


def test_staged_file_is_whole_or_absent(tmp_path):
    f = tmp_path / "x.json"
    cachedir.write_json(f, {"a": 1})
    with pytest.raises(RuntimeError), cachedir.staged_file(f) as tmp:
        tmp.write_text("{trunc")
        raise RuntimeError
    assert json.loads(f.read_text()) == {"a": 1} and sorted(os.listdir(tmp_path)) == ["x.json"]


# ---- heads -----------------------------------------------------------------------------------
def saved_heads(tmp_path: Path, kind: str = "adadecode") -> Path:
    torch.manual_seed(0)
    heads = {l: make_head(kind, 64) for l in (1, 2)}
    return save_heads(tmp_path / "h", HeadSet(kind, heads, IDENT))


def test_heads_record_their_hash_and_a_damaged_file_is_refused(tmp_path):
    out = saved_heads(tmp_path)
    assert len(json.loads((out / "config.json").read_text())["weights_sha256"]) == 64
    load_heads(out, expect=IDENT)
    data = (out / "heads.safetensors").read_bytes()
    (out / "heads.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(HeadsFormatError, match=r"heads\.safetensors: its SHA-256"):
        load_heads(out, expect=IDENT)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["weights_sha256"]  # heads saved without a hash: the file itself is checked
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadsFormatError, match=r"heads\.safetensors: unreadable"):
        load_heads(out, expect=IDENT)


def test_heads_with_nan_weights_are_refused_at_load(tmp_path):
    from safetensors.torch import load_file, save_file

    out = saved_heads(tmp_path)
    tensors = load_file(str(out / "heads.safetensors"))
    tensors["2.T"][3, 5] = float("nan")
    save_file(tensors, str(out / "heads.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["weights_sha256"] = cachedir.file_sha256(out / "heads.safetensors")  # a consistent file
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadsFormatError, match=r"non-finite values \(NaN or inf\) in 2\.T"):
        load_heads(out, expect=IDENT)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: [1, 2], "expected a JSON object, got list"),
        (lambda c: {k: v for k, v in c.items() if k != "layers"}, "'layers' must be a JSON list"),
        (lambda c: {**c, "head": "x"}, "'head' must be a JSON dict"),
        (lambda c: {**c, "layers": [1.0, 2]}, "layers must be integers"),
        (lambda c: "{not json", "unreadable"),
    ],
    ids=["not-an-object", "missing-key", "wrong-type", "float-layer", "not-json"],
)
def test_a_bad_heads_config_is_a_clear_error_naming_the_file(tmp_path, edit, message):
    out = saved_heads(tmp_path)
    cfg = edit(json.loads((out / "config.json").read_text()))
    (out / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    with pytest.raises(HeadsFormatError, match=message) as e:
        load_heads(out, expect=None)
    assert "config.json" in str(e.value)


def test_cascade_heads_need_a_threshold_per_layer(tmp_path):
    out = saved_heads(tmp_path, "cascade")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["thresholds"]["2"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadsFormatError, match="thresholds must name every layer"):
        load_heads(out, expect=None)


# ---- vocabulary map and datastore ------------------------------------------------------------
def test_a_truncated_datastore_is_a_clear_error(tmp_path):
    gens = [[1, 2, 3], [4, 5]]
    out = save_vocab(tmp_path / "v", torch.ones(10, dtype=torch.int64), IDENT, {}, gens)
    assert set(json.loads((out / "config.json").read_text())["sha256"]) == {
        "generations.safetensors",
        "vocab.safetensors",
    }
    assert load_generations(out, expect=IDENT) == gens
    f = out / "generations.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(
        DraftVocabError, match=r"generations\.safetensors: its SHA-256.*build-vocab"
    ):
        load_generations(out, expect=IDENT)
    f.unlink()
    with pytest.raises(DraftVocabError, match="holds no corpus generations"):
        load_generations(out, expect=IDENT)
    g = out / "vocab.safetensors"
    g.write_bytes(b"")
    with pytest.raises(DraftVocabError, match=r"vocab\.safetensors: its SHA-256"):
        load_vocab(out, 4, expect=IDENT)


# ---- KnapSpec's latency cache ----------------------------------------------------------------
@pytest.mark.parametrize("content", ["{trunc", '{"t_mlp": 1}', "[1, 2]", '{"t_mlp": "x"}'])
def test_a_stale_or_foreign_latency_cache_is_measured_again(tmp_path, monkeypatch, content):
    from vllm_selfspec.engine import knapspec_forward as kf
    from vllm_selfspec.policies.knapspec_knapsack import LatencyModel

    path = tmp_path / "latency" / "x.json"
    path.parent.mkdir()
    path.write_text(content)
    measured = LatencyModel(t_mlp=1.0, c2=2.0, c3=3.0, t_head=4.0, t_target_head=5.0)
    monkeypatch.setattr(kf, "_cache_path", lambda ctx, device: path)
    monkeypatch.setattr(kf, "measure_latency", lambda ctx, device: measured)
    monkeypatch.setattr(kf, "_device_name", lambda device: "test")
    monkeypatch.setattr(kf.compat, "tp_rank", lambda: 0)
    monkeypatch.setattr(kf.compat, "broadcast_from_tp_rank0", lambda x: x)

    class Ctx:
        runner = type("R", (), {"device": torch.device("cpu")})()

    assert kf.latency_model(Ctx()).to_dict() == measured.to_dict()
    assert json.loads(path.read_text())["t_mlp"] == 1.0  # rewritten whole
    assert kf.latency_model(Ctx()).to_dict() == measured.to_dict()  # now read from the cache

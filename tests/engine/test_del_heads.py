"""DEL through trained exit heads: the heads are fingerprint-checked against the served model,
loaded into the engine's head slots and used for shadow tokens; output parity is kept.

The head set here is built, not trained (AdaDecode heads at their identity initialisation, saved
in the real format for the embedded model), so the test is fast and exercises every piece of the
wiring; `tests/unit/test_heads*.py` covers training. The parity test serves the embedded model with
its top layers passed through (``save_passthrough_top``): the head at the deepest exit then names
the model's next token by construction, so DEL drafts and its drafts are kept on any machine
(identity heads on the real model agree too rarely for DEL's cost model to draft, and a parity
test whose method drafted nothing proves nothing).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm import SamplingParams

import vllm_selfspec
from selfspec_testing import engine, save_passthrough_top, token_ids
from vllm_selfspec.heads import HeadSet, identity_from_hf, make_head, save_heads

pytestmark = pytest.mark.engine
PROMPTS = [
    "def is_prime(n):",
    "The three primary colours are",
    "Write a limerick about a cat.",
    "Copy the line.\n" + "red green blue yellow, red green blue yellow,\n" * 12,
]
LAYERS = (12, 18, 24)
#: layers from here on pass the residual stream through in the parity test's model
PASSTHROUGH = 24


def _heads(model_path: str, out, fingerprint: str | None = None):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    identity = identity_from_hf(hf)
    if fingerprint is not None:
        identity = dataclasses.replace(identity, fingerprint=fingerprint)
    heads = {layer: make_head("adadecode", identity.hidden_size) for layer in LAYERS}
    return save_heads(out, HeadSet("adadecode", heads, identity), training={"built": "test"})


def test_del_with_heads_keeps_parity(model_path, tmp_path):
    model_path = save_passthrough_top(model_path, tmp_path / "model", PASSTHROUGH)
    path = _heads(model_path, tmp_path / "heads")
    sp = SamplingParams(temperature=0, max_tokens=32)
    with engine(model_path, max_num_seqs=4) as llm:
        want = token_ids(llm.generate(PROMPTS, sp, use_tqdm=False))
    # omega 0.5: the statistics forget the prompt rows (scored against the prompt's own text, not
    # the model's predictions) within a few rounds, so the exact exit's acceptance shows at once
    spec = {"method": "del", "heads": str(path), "shadow_every": 1, "omega": 0.5}
    with engine(model_path, max_num_seqs=4, speculative_config=spec) as llm:
        got = token_ids(llm.generate(PROMPTS, sp, use_tqdm=False))
        stats = vllm_selfspec.get_stats(llm)
    assert got == want
    assert stats["policy"]["heads"] == str(path)
    assert stats["policy"]["exit_layers"] == list(LAYERS)  # exits default to the head layers
    # every request's prefill rows were projected at every head layer (later rounds back off)
    assert stats["shadow_rows"] >= len(LAYERS) * len(PROMPTS) * 4
    # it drafted through the loaded heads, and some drafts were accepted: parity proves something
    assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] > 0
    assert any("head=heads@" in plan for plan in stats["plan_hist"])


def test_heads_of_another_model_are_refused_at_startup(model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker's error, unwrapped
    path = _heads(model_path, tmp_path / "heads", fingerprint="0123456789abcdef")
    with pytest.raises(Exception, match="belong to a different base model"):
        with engine(model_path, speculative_config={"method": "del", "heads": str(path)}):
            pass


def test_missing_heads_dir_is_a_config_error(model_path, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_selfspec.config import SelfSpecConfigError

    args = EngineArgs(
        model=model_path,
        dtype="float32",
        speculative_config={"method": "del", "heads": str(tmp_path / "nope")},
    )
    with pytest.raises(SelfSpecConfigError, match="is not a head directory"):
        args.create_engine_config()

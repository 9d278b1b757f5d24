"""Faults at run time that the engine must survive with its output unchanged (the faults at load
and in the caches: tests/unit/test_cache_safety.py; in the config: test_errors.py)."""

from __future__ import annotations

import itertools

import pytest

import vllm_selfspec
from selfspec_testing import engine, rotate_layerskip_plans, token_ids

pytestmark = pytest.mark.engine

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "List three uses of copper:",
    "import os\n\nfor name in os.listdir('.'):\n",
]
MAX_TOKENS = 24


def test_non_finite_draft_logits_draft_nothing_and_the_engine_keeps_serving(
    model_path, monkeypatch
):
    """Every other draft step's first row gets NaN logits, as a damaged head or an fp16
    overflow in a shortened model would give. ``torch.multinomial`` raises on them, which took
    the engine down on the first sampled request; now that row drafts nothing for the step
    (counted), greedy outputs equal vanilla vLLM's, and sampled requests run to the end."""
    from vllm import SamplingParams

    from vllm_selfspec.engine.executor import PlanExecutor

    real, calls = PlanExecutor.logits, itertools.count()

    def poisoned(self, plan, h, res):
        out = real(self, plan, h, res)
        if next(calls) % 2 == 0:
            out = out.clone()
            out[0] = float("nan")
        return out

    monkeypatch.setattr(PlanExecutor, "logits", poisoned)  # the engine core runs in-process
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    sampled = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True)
    with engine(model_path) as llm:
        want = token_ids(llm.generate(PROMPTS, greedy, use_tqdm=False))
    spec = {"method": "layerskip", "exit_layer": 28, "num_speculative_tokens": 3}
    with engine(model_path, speculative_config=spec) as llm:
        got = token_ids(llm.generate(PROMPTS, greedy, use_tqdm=False))
        mixed = llm.generate(PROMPTS * 2, [greedy] * 4 + [sampled] * 4, use_tqdm=False)
        stats = vllm_selfspec.get_stats(llm)
    assert got == want
    assert token_ids(mixed[:4]) == want
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in mixed[4:])
    assert stats["invalid_draft_rows"] > 0, "no NaN row reached the draft pick"
    assert stats["accepted_tokens"] > 0, "nothing was drafted and accepted around the NaN rows"


class _Build(dict):
    """One ``KVGroups.metadata`` build's per-layer metadata, numbered."""

    number = 0


def mixed_plans(monkeypatch) -> dict:
    """LayerSkip giving requests three different plans in turn: each draft step runs one forward
    over row subsets per layer (``PlanExecutor.run_mixed``), going back to earlier subsets."""
    rotate_layerskip_plans(monkeypatch)
    return {"method": "layerskip", "exit_layer": 30, "num_speculative_tokens": 3}


def knapspec(monkeypatch) -> dict:
    """KnapSpec's search runs candidate skip sets over subsets of its reference rows."""
    return {"method": "knapspec", "num_speculative_tokens": 3}


@pytest.mark.parametrize("setup", [mixed_plans, knapspec], ids=["mixed-plans", "knapspec"])
def test_no_draft_forward_uses_metadata_a_later_build_overwrote(model_path, monkeypatch, setup):
    """A metadata builder may keep the plan of its last build in buffers every build overwrites
    (FlashInfer's wrappers, vLLM's default on Blackwell GPUs): metadata built earlier is stale
    once anything is built again. A stand-in for such a builder numbers every build, and each
    draft forward checks it runs on the latest. Caching each row subset's metadata and going
    back to it (KVGroups.latest replaced by a plain dict lookup) fails this."""
    from vllm import SamplingParams

    from vllm_selfspec.engine import drafting, kv_groups

    count = {"builds": 0, "forwards": 0}
    real_metadata, real_context = kv_groups.KVGroups.metadata, drafting.DraftContext.forward_context

    def metadata(self, *args, **kwargs):
        md, slot_map = real_metadata(self, *args, **kwargs)
        count["builds"] += 1
        build = _Build(md)
        build.number = count["builds"]
        return build, slot_map

    def forward_context(self, md, num_tokens, slot_mapping):
        if isinstance(md, _Build):
            assert md.number == count["builds"], "a draft forward used overwritten metadata"
            count["forwards"] += 1
        return real_context(self, md, num_tokens, slot_mapping)

    monkeypatch.setattr(kv_groups.KVGroups, "metadata", metadata)
    monkeypatch.setattr(drafting.DraftContext, "forward_context", forward_context)
    spec = setup(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with engine(model_path, speculative_config=spec) as llm:
        llm.generate(PROMPTS, params, use_tqdm=False)
        stats = vllm_selfspec.get_stats(llm)
    assert stats["drafted_tokens"] > 0 and count["forwards"] > 0

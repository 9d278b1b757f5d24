"""Hidden-state capture during verification, checked against a plain HF-transformers forward.

A probe policy (registered for this test only) drafts with the full model, asks the engine for the
residual stream entering the first layer (layer 0: the engine embeds the rows' tokens) and after
layers 1, 7, 15 and 29 (vLLM's EAGLE-3 hook), and records every Feedback it is given. The engine
runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the test can read those records.

For each record: the targets must be exactly the tokens of the final sequence the captured rows
predict, and the hidden states must equal HF's ``hidden_states[layer]`` at those positions
(float32 on both sides; tolerance: 2e-3 absolute + 2e-3 relative, stated here because vLLM's CPU
attention and matmul kernels accumulate in a different order than HF's eager PyTorch).
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from selfspec_testing import engine
from vllm_selfspec import policies
from vllm_selfspec.plans import LayerPlan
from vllm_selfspec.policies import DraftDecision, Policy

pytestmark = pytest.mark.engine
CAPTURE = (0, 1, 7, 15, 29)


class ProbePolicy(Policy):
    name = "_probe"
    options: dict = {}
    capture_layers = CAPTURE
    records: list = []

    def propose(self, state):
        return DraftDecision(LayerPlan.full(self.model.num_layers), 2)

    def observe(self, state, feedback):
        ProbePolicy.records.append(feedback)


def test_captured_hidden_states_match_hf(model_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setitem(policies.POLICIES, "_probe", ProbePolicy)
    ProbePolicy.records.clear()
    prompt = "The three laws of thermodynamics are, in simple words for a student:"
    cfg = {"method": "_probe", "num_speculative_tokens": 2, "capture_tokens": 8}
    with engine(model_path, speculative_config=cfg) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[
            0
        ]
    seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    records = ProbePolicy.records
    assert len(records) >= 4
    assert records[0].num_drafted == 0 and records[0].hidden.shape == (len(CAPTURE), 8, 576)
    assert any(r.num_drafted == 2 and r.num_accepted == 2 for r in records)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        hs = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
    for r in records:
        m = r.targets.shape[0]
        n = r.context_len
        assert r.hidden.shape == (len(CAPTURE), m, 576)
        # the last step may sample past max_tokens; vLLM truncates the output afterwards
        v = min(n, len(seq)) - (n - m)
        assert r.targets.tolist()[:v] == seq[n - m : n - m + v]
        # row t predicts token n-m+t, so it sits at position n-m-1+t
        for j, layer in enumerate(CAPTURE):
            torch.testing.assert_close(
                r.hidden[j, :v].float(),
                hs[layer][0, n - m - 1 : n - m - 1 + v],
                atol=2e-3,
                rtol=2e-3,
            )

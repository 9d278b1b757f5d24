"""KnapSpec in the engine: greedy parity with real vanilla vLLM (bs 1 and 8), the search's
attention sub-layer against plain PyTorch (and the KV cache left untouched), a config error.

The engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the tests can pin the latency
model (parity: one under which drafting pays off, so the drafter surely runs) and record what the
search's sub-layers return.
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs

import vllm_selfspec
from selfspec_testing import engine, token_ids
from vllm_selfspec import policies
from vllm_selfspec.config import SelfSpecConfigError
from vllm_selfspec.engine import proposer as proposer_module
from vllm_selfspec.policies.knapspec import KnapSpecPolicy
from vllm_selfspec.policies.knapspec_knapsack import LatencyModel

pytestmark = pytest.mark.engine

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "You are a careful assistant. Answer in one short paragraph. Why is the sky blue?",
    'import numpy as np\n\ndef softmax(x):\n    """Numerically stable softmax."""\n',
    # longer than one 64-token prefill chunk
    "Summarise the following text.\n"
    + " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(8)),
]
SETTINGS = dict(
    max_num_seqs=8,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
    max_num_batched_tokens=64,
)
MAX_TOKENS = 32
#: the LM head free, sub-layers cheap: skipping pays off, so the search picks drafting plans
CHEAP_DRAFTS = LatencyModel(t_mlp=1e-3, c2=1e-7, c3=5e-4, t_head=0.0)


def _run(llm):
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return {
        "bs1": [token_ids(llm.generate([p], sp, use_tqdm=False))[0] for p in PROMPTS],
        "bs8": token_ids(llm.generate(PROMPTS, sp, use_tqdm=False)),
    }


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def test_greedy_parity_with_vanilla(model_path, in_process, monkeypatch):
    with engine(model_path, **SETTINGS) as llm:
        want = _run(llm)
    monkeypatch.setattr(proposer_module, "latency_model", lambda proposer: CHEAP_DRAFTS)
    cfg = {"method": "knapspec", "interval": 8, "num_speculative_tokens": 4}
    with engine(model_path, speculative_config=cfg, **SETTINGS) as llm:
        got = _run(llm)
        stats = vllm_selfspec.get_stats(llm)
    for bs in ("bs1", "bs8"):
        for i, (w, g) in enumerate(zip(want[bs], got[bs])):
            assert g == w, f"knapspec {bs} prompt {i}: tokens differ from vanilla vLLM"
    assert stats["optimisations"] >= 2 * len(PROMPTS)  # every request, re-optimised every 8 steps
    assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] > 0
    assert stats["skipped_attn_per_round"] + stats["skipped_mlp_per_round"] > 0
    assert stats["time_s"]["optimise"] > 0


class RecordingPolicy(KnapSpecPolicy):
    """KnapSpec that, at its first search, runs the full model's sub-layers from the captured
    embeddings (as the DP computes its references) and a few sub-layers on chosen candidates."""

    name = "_knapspec_probe"
    records: list = []
    layer_inputs: list = []  # the states entering each layer 0..L, by chained sub-layers

    def optimise(self, state, model):
        if not RecordingPolicy.records:
            first = state.rounds[0][0]
            hidden = torch.cat([h for _, h in state.rounds], dim=1)  # [1, r, d]: embeddings
            positions = torch.arange(first, first + hidden.shape[1])
            x = hidden[0]
            RecordingPolicy.layer_inputs = [x]
            for s in range(2 * self.model.num_layers):
                x = model.sublayer(s, x.unsqueeze(0), positions)[0]
                if s % 2:
                    RecordingPolicy.layer_inputs.append(x)
            g = torch.Generator().manual_seed(0)
            for s in (0, 10, 11, 58):  # attention of layers 0 and 5, MLP of 5, attention of 29
                x = RecordingPolicy.layer_inputs[s // 2]
                cand = torch.stack(
                    [x, 0.9 * x + 0.05 * torch.randn(x.shape, generator=g), x.flip(0)]
                )  # 3 candidates: the block table repeated 3 times
                kv = model.layout.layers[s // 2].self_attn.attn.kv_cache
                before = kv.clone()
                out = model.sublayer(s, cand, positions)
                RecordingPolicy.records.append((s, positions, cand, out, torch.equal(kv, before)))
        super().optimise(state, model)


def _reference(hf, s, cand, positions, context):
    """Plain PyTorch: the sub-layer on the candidate states; attention queries from them, keys and
    values from the true sequence's states entering the layer (``context`` [T, d])."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layer = hf.model.layers[s // 2]
    if s % 2:
        return cand + layer.mlp(layer.post_attention_layernorm(cand))
    at = layer.self_attn
    hd, nh, nkv = at.head_dim, hf.config.num_attention_heads, hf.config.num_key_value_heads
    B, r, d = cand.shape
    T = int(positions[-1]) + 1
    ctx = layer.input_layernorm(context[:T])
    k = at.k_proj(ctx).view(1, T, nkv, hd).transpose(1, 2)
    v = at.v_proj(ctx).view(1, T, nkv, hd).transpose(1, 2)
    q = at.q_proj(layer.input_layernorm(cand)).view(B, r, nh, hd).transpose(1, 2)
    cos_k, sin_k = hf.model.rotary_emb(ctx, torch.arange(T)[None])
    cos_q, sin_q = hf.model.rotary_emb(cand, positions[None])
    _, k = apply_rotary_pos_emb(k, k, cos_k, sin_k)
    q, _ = apply_rotary_pos_emb(q, q, cos_q, sin_q)
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / hd**0.5  # [B, h, r, T]
    mask = torch.arange(T)[None, :] <= positions[:, None]  # row t sees keys up to its position
    scores = scores.masked_fill(~mask, float("-inf"))
    o = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, r, nh * hd)
    return cand + at.o_proj(o)


def test_search_sublayers_match_plain_pytorch_and_write_nothing(
    model_path, in_process, monkeypatch
):
    monkeypatch.setitem(policies.POLICIES, RecordingPolicy.name, RecordingPolicy)
    RecordingPolicy.records.clear()
    prompt = "The three laws of thermodynamics are, in simple words for a student:"
    cfg = {"method": RecordingPolicy.name, "capture_tokens": 6}
    with engine(model_path, speculative_config=cfg) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    records = RecordingPolicy.records
    assert [s for s, *_ in records] == [0, 10, 11, 58]

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        hs = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
        P = len(out.prompt_token_ids)  # the prefill's last 6 rows: positions P-6 .. P-1
        # the DP's references: the full model's states, computed from the embeddings alone
        assert len(RecordingPolicy.layer_inputs) == hf.config.num_hidden_layers + 1
        for layer, x in enumerate(RecordingPolicy.layer_inputs[:-1]):  # hs[L] is after the norm
            torch.testing.assert_close(x.float(), hs[layer][0, P - 6 : P], atol=2e-3, rtol=2e-3)
        for s, positions, cand, got, untouched in records:
            assert untouched, f"sub-layer {s} wrote into the KV cache"
            assert positions.tolist() == list(range(P - 6, P))
            want = _reference(hf, s, cand.float(), positions, hs[s // 2][0])
            torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


def test_bad_knapspec_option_is_refused(model_path):
    spec = {"method": "knapspec", "tau": 2}
    with pytest.raises(SelfSpecConfigError, match=r"knapspec: tau must be a number in \[-1"):
        EngineArgs(
            model=model_path, dtype="float32", speculative_config=spec
        ).create_engine_config()

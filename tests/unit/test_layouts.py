"""The layout adapters (``engine.layouts.model_layout``) against vLLM's own decoder-layer forwards.

The partial forward runs a decoder layer as its two sub-layers, each ``x, res = norm(pending,
res)`` then ``pending = block(x)`` with the norms and blocks the family's layout names. For each
family this runs vLLM's own ``<Family>DecoderLayer.forward`` (the function itself, unbound) and
the layout's sub-layers on the same layer, with real vLLM norms (``RMSNorm``, ``GemmaRMSNorm``)
and stand-in attention and MLP (attention needs an engine's forward context; what matters here is
where each norm sits), and requires bit-identical outputs, first layer (no residual) included.
"""

from __future__ import annotations

from types import MethodType, SimpleNamespace

import pytest
import torch
from torch import nn

from vllm_selfspec.engine.executor import _norm
from vllm_selfspec.engine.layouts import GemmaLayout, LlamaLayout, model_layout

D = 16


class _Attention(nn.Module):
    """Stands in for ``self_attn``: the same call signature, position-dependent output."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.attn = SimpleNamespace(layer_name="model.layers.0.self_attn.attn")

    def forward(self, positions, hidden_states, **kwargs):
        return self.proj(hidden_states) * (1 + positions[:, None].float())


def _layer(family: str) -> nn.Module:
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    norm = GemmaRMSNorm if family.startswith("gemma") else RMSNorm
    names = ["input_layernorm", "post_attention_layernorm"]
    if family.startswith("gemma"):
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    layer = nn.Module()
    for n in names:
        setattr(layer, n, norm(D, eps=1e-6))
        getattr(layer, n).weight.data.normal_()
    layer.self_attn = _Attention()
    layer.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
    if family == "mistral":
        layer.ada_rms_norm_t_cond = None
    layer.forward = MethodType(_vllm_forward(family), layer)  # vLLM's own layer forward
    return layer


def _vllm_forward(family: str):
    import importlib

    module, cls = {
        "llama": ("llama", "LlamaDecoderLayer"),
        "mistral": ("mistral", "MistralDecoderLayer"),
        "qwen2": ("qwen2", "Qwen2DecoderLayer"),
        "qwen3": ("qwen3", "Qwen3DecoderLayer"),
        "gemma2": ("gemma2", "Gemma2DecoderLayer"),
        "gemma3": ("gemma3", "Gemma3DecoderLayer"),
    }[family]
    mod = importlib.import_module(f"vllm.model_executor.models.{module}")
    return getattr(mod, cls).forward


def _model(layers) -> SimpleNamespace:
    from vllm.model_executor.layers.layernorm import RMSNorm

    inner = SimpleNamespace(
        embed_input_ids=lambda ids: ids,
        layers=nn.ModuleList(layers),
        norm=RMSNorm(D),
        embed_tokens=SimpleNamespace(weight=torch.zeros(4, D)),
    )
    return SimpleNamespace(
        model=inner,
        compute_logits=lambda x: x,
        logits_processor=SimpleNamespace(scale=1.0, soft_cap=None),
    )


@pytest.fixture
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # vLLM's norms are CustomOps: they need one
        yield


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"])
@torch.inference_mode()
def test_sub_layers_are_bit_identical_to_vllms_layer_forward(family, vllm_config):
    torch.manual_seed(0)
    layer = _layer(family)
    lay = model_layout(_model([layer]))
    assert type(lay) is (GemmaLayout if family.startswith("gemma") else LlamaLayout)
    pos = torch.arange(5)
    h = torch.randn(5, D)
    for res in (None, torch.randn(5, D)):  # the first layer, then any later one
        want_h, want_res = layer(pos, h, res)
        x, r = _norm(lay.attn_norm(layer), h, res)  # as engine/executor.py runs them
        x, r = _norm(lay.mlp_norm(layer), lay.attn(layer, pos, x), r)
        got_h = lay.mlp(layer, x)
        assert torch.equal(got_h, want_h) and torch.equal(r, want_res)


@torch.inference_mode()
def test_gemma_capture_returns_the_stream_after_the_asked_layers(vllm_config):
    """Gemma's models have no EAGLE-3 hook: the layout's eager forward collects the residual
    stream itself, and its output equals the layers run one after another."""
    torch.manual_seed(0)
    layers = [_layer("gemma3") for _ in range(3)]
    model = _model(layers)
    lay = model_layout(model)
    lay.set_capture_layers((0, 2))
    pos = torch.arange(4)
    x = torch.randn(4, D)
    out, aux = model.forward(x, pos)
    h, res, seen = x, None, [x]
    for layer in layers:
        h, res = layer(pos, h, res)
        seen.append(h + res)
    assert torch.equal(out, model.model.norm(h, res)[0])
    assert len(aux) == 2 and torch.equal(aux[0], seen[0]) and torch.equal(aux[1], seen[2])


@torch.inference_mode()
def test_gemma_final_norm_scale_is_one_plus_weight(vllm_config):
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    model = _model([_layer("gemma2")])
    model.model.norm = GemmaRMSNorm(D, eps=1e-6)
    model.model.norm.weight.data.normal_()
    lay = model_layout(model)
    x = torch.randn(3, D)
    scale = lay.final_norm_scale()
    want = model.model.norm(x)
    got = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    torch.testing.assert_close(got, want)


@torch.inference_mode()
def test_compiled_layer_functions_serve_every_layer(vllm_config):
    """Regional compilation (engine/executor.py, "Compiled"): one graph per layer function serves
    every layer, for a single row and for any number of rows, and computes what the layer does.
    A graph per layer (weights or names baked in as constants) would compile L times over."""
    from torch._dynamo.utils import counters

    from vllm_selfspec.engine.executor import PlanExecutor

    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = [_layer("llama") for _ in range(4)]
    exe = PlanExecutor(_model(layers), compile_options={})
    assert exe.compiled
    lay = exe.layout
    before = counters["stats"]["unique_graphs"]
    for n in (1, 3, 5):
        pos = torch.arange(n)
        h, res = torch.randn(n, D), torch.zeros(n, D)
        want_h, want_res = h, None
        for layer in layers:
            h, res = exe.whole_layer(lay, layer, pos, h, res)
            want_h, want_res = layer(pos, want_h, want_res)
            torch.testing.assert_close(h, want_h)
            torch.testing.assert_close(res, want_res)
        x, r = exe.mlp_sublayer(lay, layers[2], h, res)
        want = layers[2].mlp(lay.mlp_norm(layers[2])(h, res)[0])
        torch.testing.assert_close(x, want)
    # whole_layer: one graph for one row, one for more; mlp_sublayer: the same
    assert counters["stats"]["unique_graphs"] - before <= 4


def test_draft_forwards_compile_as_the_target_does(monkeypatch):
    """Compiled where vLLM compiles unless the environment asks for eager; never under
    enforce_eager; a bad value is an error, not a silent default."""
    from vllm.config import CompilationMode

    from vllm_selfspec import compat

    def config(mode):
        return SimpleNamespace(compilation_config=SimpleNamespace(mode=mode))

    compiled, eager = config(CompilationMode.DYNAMO_TRACE_ONCE), config(CompilationMode.NONE)
    monkeypatch.delenv(compat.COMPILE_DRAFTS_ENV, raising=False)
    assert compat.compiles_drafts(compiled) and not compat.compiles_drafts(eager)
    monkeypatch.setenv(compat.COMPILE_DRAFTS_ENV, "0")
    assert not compat.compiles_drafts(compiled) and not compat.compiles_drafts(eager)
    monkeypatch.setenv(compat.COMPILE_DRAFTS_ENV, "yes")
    with pytest.raises(ValueError, match="must be"):
        compat.compiles_drafts(compiled)

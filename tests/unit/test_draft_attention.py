"""The cache views the paged draft attention reads (``compat.paged_kv_views``), against what
vLLM's own cache writes put there, and the mode switch (``compat.draft_attention_mode``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_selfspec import compat

NUM_BLOCKS, HEADS, BLOCK, HEAD = 5, 2, 32, 64


def _attn(backend: str, kv_cache: torch.Tensor, **extra):
    """The attributes of a vLLM ``Attention`` layer the views read."""
    fields = dict(
        attn_backend=SimpleNamespace(get_name=lambda: backend),
        impl=SimpleNamespace(alibi_slopes=None, logits_soft_cap=None),
        kv_cache=kv_cache,
        kv_cache_dtype="auto",
        sliding_window=None,
        has_sink=False,
        head_size=HEAD,
        layer_name="model.layers.0.self_attn.attn",
        isa="vec",
    )
    return SimpleNamespace(**{**fields, **extra})


def _batch(n: int = 7):
    g = torch.Generator().manual_seed(0)
    key = torch.randn(n, HEADS, HEAD, generator=g)
    value = torch.randn(n, HEADS, HEAD, generator=g)
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=g)[:n]
    return key, value, slots


def _read(key_cache, value_cache, slots):
    blocks, rows = slots // BLOCK, slots % BLOCK
    return key_cache[blocks, :, rows], value_cache[blocks, :, rows]


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_cpu_views_read_what_vllms_cpu_cache_write_stored(isa):
    from vllm import _custom_ops as ops

    kv = torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    key, value, slots = _batch()
    key_half, value_half = kv.view(NUM_BLOCKS, HEADS, 2 * BLOCK, HEAD).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        key, value, key_half, value_half, slots, isa, k_scale=1.0, v_scale=1.0,
        kv_cache_dtype="auto",
    )  # fmt: skip
    key_cache, value_cache = compat.paged_kv_views(_attn("CPU_ATTN", kv, isa=isa))
    got_k, got_v = _read(key_cache, value_cache, slots)
    assert torch.equal(got_k, key) and torch.equal(got_v, value)
    # and the views are of vLLM's storage: a write through them is where vLLM reads
    assert key_cache.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    plain_key = key_half  # the layout a plain view assumes: the keys are not there
    assert not torch.equal(plain_key[slots // BLOCK, :, slots % BLOCK], key)


def test_flash_layout_views_are_flash_attentions_split():
    """FlashAttention / FlashInfer (vLLM 0.32): ``kv_cache.transpose(1, 2).split(head_size,
    -1)`` is their own view of the same cache (flash_attn.py:1252)."""
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=g)
    key_cache, value_cache = compat.paged_kv_views(_attn("FLASH_ATTN", kv))
    flash_k, flash_v = kv.transpose(1, 2).split(HEAD, dim=-1)  # [blocks, block, heads, head]
    assert torch.equal(key_cache.transpose(1, 2), flash_k)
    assert torch.equal(value_cache.transpose(1, 2), flash_v)


@pytest.mark.parametrize(
    "extra, reason",
    [
        (dict(kv_cache_dtype="fp8"), "fp8 KV cache"),
        (dict(sliding_window=128), "sliding window"),
        (dict(isa="amx"), "CPU attention kernel 'amx'"),
        (dict(attn_backend=SimpleNamespace(get_name=lambda: "FLEX_ATTENTION")), "FLEX_ATTENTION"),
    ],
)
def test_what_the_kernel_cannot_read_is_named(extra, reason):
    kv = torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    with pytest.raises(NotImplementedError, match=reason):
        compat.paged_kv_views(_attn("CPU_ATTN", kv, **extra))


def test_draft_attention_mode_is_checked(monkeypatch):
    monkeypatch.delenv(compat.DRAFT_ATTENTION_ENV, raising=False)
    assert compat.draft_attention_mode() == "auto"
    monkeypatch.setenv(compat.DRAFT_ATTENTION_ENV, "paged")
    assert compat.draft_attention_mode() == "paged"
    monkeypatch.setenv(compat.DRAFT_ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match="VLLM_SELFSPEC_DRAFT_ATTENTION must be one of"):
        compat.draft_attention_mode()


@pytest.mark.parametrize(
    "name, value",
    [(compat.DRAFT_ATTENTION_ENV, "flash"), (compat.COMPILE_DRAFTS_ENV, "yes")],
)
def test_a_bad_environment_value_fails_before_serving(monkeypatch, name, value):
    """The workers read these variables; a bad value is a config error at start-up, not a
    crash in a worker."""
    from vllm_selfspec import plugin
    from vllm_selfspec.config import SelfSpecConfig, SelfSpecConfigError

    monkeypatch.setenv(name, value)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1), kv_transfer_config=None
    )
    with pytest.raises(SelfSpecConfigError, match=name):
        plugin.check_vllm_config(vllm_config, SelfSpecConfig.load({"method": "layerskip"}))

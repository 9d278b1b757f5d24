"""The paged-attention decode kernels (subset of a batch) against their PyTorch reference.

Each test taking ``kernel`` runs twice (``kernels_testing``): in Triton's interpreter, in a child
process started with ``TRITON_INTERPRET=1`` (``triton_interpreter_worker.py`` says why), and
compiled on a CUDA GPU where there is one; the parent computes the reference on the CPU and
compares. The reference itself is checked against a plain causal attention over
contiguous K/V and against vLLM's own CPU paged-attention ops, and the cache layout against the
views vLLM 0.32 builds for FlashAttention (``create_kv_cache_views`` + FlashAttention's split).

Tolerances: the cache write is checked bit-exactly (the whole cache, untouched blocks included).
Outputs: float32 within rtol 1e-5 / atol 1e-5 (both paths sum float32 products in a different
order; observed max abs error 5.4e-7); float16 within rtol 1e-3 / atol 1e-5 (one float16 rounding
of the same float32 value, at most 1 ulp apart: observed in 3 of 3456 elements). bfloat16 is
only tested on a GPU: the interpreter's ``tl.dot`` on bfloat16 is wrong (triton-lang/triton#11584),
so in the interpreter bfloat16 covers the cache write only.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch
from vllm_selfspec.kernels import paged_attention as pa

from kernels_testing import RUNNERS, kernel_runner, view_specs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

F32_TOL = dict(rtol=1e-5, atol=1e-5)
F16_TOL = dict(rtol=1e-3, atol=1e-5)


def split_specs(kv_cache: torch.Tensor) -> tuple:
    """``view_specs`` of the FlashAttention layout's two views (``pa.split_kv_cache``)."""
    return view_specs(*pa.split_kv_cache(kv_cache, kv_cache.shape[-1] // 2))


@pytest.fixture(scope="module", params=RUNNERS)
def kernel(request):
    """The kernels in Triton's interpreter, then compiled on a CUDA GPU (``kernels_testing``)."""
    run = kernel_runner(request.param, "paged_kernels_are_interpreted")
    yield run
    run.close()


@dataclass
class Case:
    query: torch.Tensor  # [A, Hq, D]
    key: torch.Tensor  # [A, Hkv, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [num_blocks, Hkv, block_size, 2D], random old contents
    kwargs: dict  # slot_mapping, block_table, req_indices, positions, scale

    def run_reference(self):
        """(output, cache) of the reference, on a copy of the cache (its two views)."""
        cache = self.kv_cache.clone()
        caches = pa.split_kv_cache(cache, self.query.shape[-1])
        return pa.paged_attention_reference(
            self.query, self.key, self.value, *caches, **self.kwargs
        ), cache

    def run_kernel(self, kernel, **extra):
        """(output, cache) of the Triton kernels through ``kernel`` (on its own copy of the cache)."""
        return kernel(
            "paged_attention_triton_on_views",
            self.query,
            self.key,
            self.value,
            self.kv_cache,
            split_specs(self.kv_cache),
            **self.kwargs,
            **extra,
        )


def _plant(positions, req_indices, token, position):
    """Give ``token`` this position unless another token of its request has it (slots stay unique)."""
    if not (positions[req_indices == req_indices[token]] == position).any():
        positions[token] = position


def make_case(
    num_tokens,
    num_kv_heads,
    group,
    head_size,
    block_size,
    max_context,
    *,
    num_pad=0,
    seed=0,
    dtype=torch.float32,
    scale=None,
) -> Case:
    """Requests with shuffled (non-contiguous) physical blocks; each active token sits at a distinct
    position of its request (the longest context is ``max_context``, none needs to be a multiple of
    the block size); ``num_pad`` tokens get slot -1 (padding)."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = max(1, num_tokens // 3)
    blocks_per_req = -(-max_context // block_size)
    num_blocks = num_reqs * blocks_per_req + 3  # a few blocks nobody owns
    block_table = torch.randperm(num_blocks, generator=g)[: num_reqs * blocks_per_req]
    block_table = block_table.view(num_reqs, blocks_per_req).int()
    req_indices = torch.arange(num_tokens) % num_reqs
    req_indices = req_indices[torch.randperm(num_tokens, generator=g)]
    positions = torch.empty(num_tokens, dtype=torch.long)
    for r in range(num_reqs):
        mine = (req_indices == r).nonzero()[:, 0]
        positions[mine] = torch.randperm(max_context, generator=g)[: mine.numel()]
    _plant(positions, req_indices, 0, max_context - 1)  # the longest context is present
    if num_tokens > 1:
        _plant(positions, req_indices, 1, 0)  # and a one-position context
    blocks = block_table.long()[req_indices, positions // block_size]
    slot_mapping = blocks * block_size + positions % block_size
    slot_mapping[torch.randperm(num_tokens, generator=g)[:num_pad]] = -1

    num_q_heads = num_kv_heads * group
    return Case(
        query=torch.randn(num_tokens, num_q_heads, head_size, generator=g).to(dtype),
        key=torch.randn(num_tokens, num_kv_heads, head_size, generator=g).to(dtype),
        value=torch.randn(num_tokens, num_kv_heads, head_size, generator=g).to(dtype),
        kv_cache=torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_size, generator=g).to(
            dtype
        ),
        kwargs=dict(
            slot_mapping=slot_mapping,
            block_table=block_table,
            req_indices=req_indices,
            positions=positions,
            scale=head_size**-0.5 if scale is None else scale,
        ),
    )


def assert_same(got, want, tol):
    (out, cache), (ref_out, ref_cache) = got, want
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    assert torch.equal(cache, ref_cache)  # every byte of the cache, written and untouched
    torch.testing.assert_close(out, ref_out, **tol)


# (A tokens, Hkv, GQA group, head_size, block_size, longest context, padding tokens)
SHAPES = [
    (1, 2, 3, 64, 16, 37, 0),  # one token; context 37 is not a multiple of the block size
    (40, 2, 1, 64, 16, 150, 3),  # many tokens (several per request), padding slots, MHA
    (7, 1, 3, 128, 32, 200, 1),  # head 128, GQA 3, block 32
    (5, 3, 1, 128, 16, 70, 0),  # head 128, MHA, three KV heads
    (6, 2, 4, 80, 24, 100, 2),  # head 80 (masked lanes), GQA 4, block 24 (not a power of two)
]


@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda s: "A{}-kv{}-g{}-d{}-bs{}-ctx{}-pad{}".format(*s)
)
def test_kernel_matches_reference(kernel, shape):
    *dims, num_pad = shape
    case = make_case(*dims, num_pad=num_pad)
    assert_same(case.run_kernel(kernel), case.run_reference(), F32_TOL)


@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["one-split", "3-splits", "auto"])
def test_context_split_paths_agree(kernel, num_splits):
    """One program per (token, KV head) over the whole context, a forced split (tokens with a short
    context get empty splits) and the heuristic's split."""
    case = make_case(3, 1, 3, 64, 16, 300, seed=1)
    assert_same(case.run_kernel(kernel, num_splits=num_splits), case.run_reference(), F32_TOL)
    if num_splits is None:  # 3 programs < 8 targeted by the heuristic in the interpreter
        assert pa.launch_config(3, 1, 300)[0] > 1
        given = case.run_kernel(
            kernel, max_context=300
        )  # the caller's bound instead of positions.max()
        assert_same(given, case.run_reference(), F32_TOL)


def test_float16_and_custom_scale(kernel):
    case = make_case(9, 2, 3, 64, 16, 90, num_pad=1, seed=2, dtype=torch.float16, scale=0.3)
    assert_same(case.run_kernel(kernel), case.run_reference(), F16_TOL)


def test_strided_query_and_key(kernel):
    """Q/K/V as vLLM hands them over: column slices of one fused qkv projection output."""
    case = make_case(6, 2, 3, 64, 16, 50, num_pad=1, seed=3)
    qkv = torch.cat([t.flatten(1) for t in (case.query, case.key, case.value)], dim=1)
    hq = case.query.shape[1] * 64
    case.query = qkv[:, :hq].view(6, -1, 64)
    case.key = qkv[:, hq : hq + 128].view(6, 2, 64)
    case.value = qkv[:, hq + 128 :].view(6, 2, 64)
    assert not case.query.is_contiguous() and not case.key.is_contiguous()
    assert_same(case.run_kernel(kernel), case.run_reference(), F32_TOL)


def test_bfloat16_cache_write_is_exact(kernel):
    """The write kernel moves bits, so bfloat16 works in the interpreter (no tl.dot involved)."""
    case = make_case(12, 2, 1, 64, 16, 60, num_pad=2, seed=4, dtype=torch.bfloat16)
    slots = case.kwargs["slot_mapping"]
    want = case.kv_cache.clone()
    pa.write_kv_reference(case.key, case.value, *pa.split_kv_cache(want, 64), slots)
    specs = split_specs(case.kv_cache)
    got = kernel("write_kv_triton_on_views", case.key, case.value, case.kv_cache, specs, slots)
    assert torch.equal(got, want) and not torch.equal(got, case.kv_cache)


def test_padding_slots_write_nothing():
    case = make_case(8, 2, 1, 64, 16, 40, seed=5)
    slots = torch.full((8,), -1)
    cache = case.kv_cache.clone()
    pa.write_kv_reference(case.key, case.value, *pa.split_kv_cache(cache, 64), slots)
    assert torch.equal(cache, case.kv_cache)


def _causal_attention(q, k, v, scale):
    """Plain causal attention over contiguous K/V: q [L, Hq, D], k/v [L, Hkv, D] -> [L, Hq, D]."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("group", [1, 3], ids=["mha", "gqa3"])
def test_deferred_tokens_see_each_other_and_match_causal_attention(kernel, group):
    """AdaDecode's deferred tokens: one request's prefix is cached; three tokens at consecutive
    positions run the layer together. Each must see the K/V the others write in the same call
    (writes before reads) and the result must equal a plain causal attention over the whole
    sequence's contiguous K/V (reference and kernel both)."""
    g = torch.Generator().manual_seed(6)
    length, prefix, num_kv_heads, head_size, block_size = 45, 42, 2, 64, 16
    q = torch.randn(length, num_kv_heads * group, head_size, generator=g)
    k = torch.randn(length, num_kv_heads, head_size, generator=g)
    v = torch.randn(length, num_kv_heads, head_size, generator=g)
    block_table = torch.tensor(
        [[5, 0, 3], [1, 4, 2]], dtype=torch.int32
    )  # request 1, shuffled blocks
    cache = torch.randn(6, num_kv_heads, block_size, 2 * head_size, generator=g)
    pos = torch.arange(length)
    slots = block_table[1].long()[pos // block_size] * block_size + pos % block_size
    caches = pa.split_kv_cache(cache, head_size)
    pa.write_kv_reference(k[:prefix], v[:prefix], *caches, slots[:prefix])  # the cached prefix

    new = torch.tensor([43, 42, 44])  # the deferred tokens, in any order
    case = Case(
        q[new],
        k[new],
        v[new],
        cache,
        dict(
            slot_mapping=slots[new],
            block_table=block_table,
            req_indices=torch.ones(3, dtype=torch.long),
            positions=new,
            scale=head_size**-0.5,
        ),
    )
    want = case.run_reference()
    assert_same(case.run_kernel(kernel), want, F32_TOL)
    causal = _causal_attention(q, k, v, head_size**-0.5)[new]
    torch.testing.assert_close(want[0], causal, **F32_TOL)


def test_reference_matches_causal_attention_for_every_position():
    """Every position of a 70-token sequence as one decode row (one batch, two requests with the
    same K/V in different blocks) equals causal attention over the contiguous K/V."""
    g = torch.Generator().manual_seed(7)
    length, num_kv_heads, group, head_size, block_size = 70, 3, 3, 64, 16
    q = torch.randn(length, num_kv_heads * group, head_size, generator=g)
    k = torch.randn(length, num_kv_heads, head_size, generator=g)
    v = torch.randn(length, num_kv_heads, head_size, generator=g)
    block_table = torch.randperm(10, generator=g).int().view(2, 5)
    pos = torch.arange(length).repeat(2)
    req = torch.arange(2).repeat_interleave(length)
    slots = block_table.long()[req, pos // block_size] * block_size + pos % block_size
    cache = torch.zeros(10, num_kv_heads, block_size, 2 * head_size)
    out = pa.paged_attention_reference(
        q.repeat(2, 1, 1),
        k.repeat(2, 1, 1),
        v.repeat(2, 1, 1),
        *pa.split_kv_cache(cache, head_size),
        slot_mapping=slots,
        block_table=block_table,
        req_indices=req,
        positions=pos,
        scale=0.2,
    )
    causal = _causal_attention(q, k, v, 0.2)
    torch.testing.assert_close(out, causal.repeat(2, 1, 1), **F32_TOL)


# ------------------------------------------------------------------------------------------------
# vLLM itself: the cache views it builds for FlashAttention, and its CPU paged-attention ops.
# ------------------------------------------------------------------------------------------------


def _vllm(module: str):
    pytest.importorskip("vllm")
    return importlib.import_module(module)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC"])
def test_vllm_cache_views_and_flash_attention_split(kernel, layout):
    """The per-layer cache tensor exactly as vLLM 0.32 builds it (``create_kv_cache_views``: a
    strided view into a two-layer int8 buffer) for three physical layouts, LBNHC being
    FlashAttention's default. The kernel and the reference must agree on it, must touch no byte
    of the other layer, and FlashAttention's own view of the cache (``flash_attn.py:1252``) must
    find each token's K and V at its slot."""
    kv_iface = _vllm("vllm.v1.kv_cache_interface")
    layouts = _vllm("vllm.v1.kv_cache_layout")
    block_size, num_kv_heads, head_size, dtype = 16, 2, 64, torch.float32
    case = make_case(9, num_kv_heads, 3, head_size, block_size, 60, num_pad=2, seed=8)
    num_blocks = case.kv_cache.shape[0]
    spec = kv_iface.FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )
    kv_layout = layouts.KVCacheLayout[layout]
    page = spec.page_size_bytes
    if kv_layout.is_layer_compact:
        tensor = kv_iface.KVCacheTensor(
            size=2 * page * num_blocks,
            layers=["l0", "l1"],
            layer_stride=page * num_blocks,
            block_stride=page,
        )
    else:
        tensor = kv_iface.KVCacheTensor(
            size=2 * page * num_blocks,
            layers=["l0", "l1"],
            layer_stride=page,
            block_stride=2 * page,
        )

    def layer1_view(raw):
        return kv_iface.create_kv_cache_views(raw, spec, num_blocks, kv_layout, tensor)[1]

    g = torch.Generator().manual_seed(8)
    raw = torch.randn(2 * page * num_blocks // 4, generator=g).view(torch.int8)  # valid floats
    case.kv_cache = layer1_view(raw.clone())
    assert case.kv_cache.shape == (num_blocks, num_kv_heads, block_size, 2 * head_size)
    if layout != "LBHNC":
        assert not case.kv_cache.is_contiguous()

    ref_raw = raw.clone()
    ref_caches = pa.split_kv_cache(layer1_view(ref_raw), head_size)
    ref_out = pa.paged_attention_reference(
        case.query, case.key, case.value, *ref_caches, **case.kwargs
    )
    out, cache = case.run_kernel(kernel)
    kernel_raw = torch.empty(0, dtype=torch.int8).set_(cache.untyped_storage())
    assert torch.equal(kernel_raw, ref_raw)  # the whole two-layer buffer
    torch.testing.assert_close(out, ref_out, **F32_TOL)
    layer0 = kv_iface.create_kv_cache_views(ref_raw, spec, num_blocks, kv_layout, tensor)[0]
    assert torch.equal(
        layer0, kv_iface.create_kv_cache_views(raw, spec, num_blocks, kv_layout, tensor)[0]
    )

    key_cache, value_cache = layer1_view(ref_raw).transpose(1, 2).split(head_size, dim=-1)
    for a, slot in enumerate(case.kwargs["slot_mapping"].tolist()):
        if slot >= 0:
            assert torch.equal(key_cache[slot // block_size, slot % block_size], case.key[a])
            assert torch.equal(value_cache[slot // block_size, slot % block_size], case.value[a])


def _history(case: Case, seed: int):
    """Random K/V ("history") for every position of every block-table row: (k, v, slots)."""
    block_size = case.kv_cache.shape[2]
    num_kv_heads, head_size = case.key.shape[1:]
    bt = case.kwargs["block_table"].long()
    slots = (bt[:, :, None] * block_size + torch.arange(block_size)).flatten()
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots.numel(), num_kv_heads, head_size, generator=g)
    v = torch.randn(slots.numel(), num_kv_heads, head_size, generator=g)
    return k, v, slots


def vllm_cpu_chunks(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value chunks vLLM's CPU backend makes of its cache ``[num_blocks, num_kv_heads,
    block_size, 2 * head_size]`` for its ops (``cpu_attn.py:411-416``): K rows, then V rows, per
    block and head."""
    num_blocks, num_kv_heads, block_size, content = cache.shape
    return cache.view(num_blocks, num_kv_heads, 2 * block_size, content // 2).chunk(2, dim=2)


def vllm_cpu_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our (key_cache, value_cache) views of a vLLM CPU-backend cache (ISAs ``vec``/``vec16``):
    the key chunk holds element d of token o at ``d * block_size + o`` (a transposed view of it),
    the value chunk is plain."""
    kc, vc = vllm_cpu_chunks(cache)
    nb, nh, bs, hd = vc.shape
    key_view = torch.as_strided(
        kc, (nb, nh, bs, hd), (kc.stride(0), kc.stride(1), 1, bs), kc.storage_offset()
    )
    return key_view, vc


def vllm_cpu_attention(ops, case: Case, key_cache, value_cache, isa):
    """vLLM's ``cpu_attention_with_kv_cache`` over its CPU-backend cache chunks, each active token
    a one-query request (seq_len = position + 1, its request's block-table row)."""
    kw = case.kwargs
    num_tokens, num_q_heads, head_size = case.query.shape
    query_start_loc = torch.arange(num_tokens + 1, dtype=torch.int32)
    seq_lens = (kw["positions"] + 1).int()
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_tokens,
        num_heads=num_q_heads,
        num_kv_heads=case.key.shape[1],
        head_dim=head_size,
        seq_lens=seq_lens,
        dtype=case.query.dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=True,
    )
    got = torch.empty_like(case.query)
    ops.cpu_attention_with_kv_cache(
        query=case.query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=got,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        scale=kw["scale"],
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=kw["block_table"][kw["req_indices"]].contiguous(),
        softcap=0.0,
        scheduler_metadata=metadata,
        s_aux=None,
    )
    return got


@pytest.mark.parametrize(
    "block_size,head_size,group",
    [(32, 64, 3), (16, 128, 1)],
    ids=["bs32-d64-gqa3", "bs16-d128-mha"],
)
def test_reference_matches_vllm_cpu_paged_attention(block_size, head_size, group):
    """vLLM's own CPU ops on the same batch: ``cpu_attn_reshape_and_cache`` into a CPU-backend
    cache, ``cpu_attention_with_kv_cache`` with each active token as a one-query request
    (seq_len = position + 1, its request's block-table row). Our reference runs on the
    FlashAttention layout, so the two caches are filled from the same K/V and the attention
    outputs compared."""
    ops = _vllm("vllm._custom_ops")
    cpu_attn = _vllm("vllm.v1.attention.backends.cpu_attn")
    num_kv_heads = 3
    isa = cpu_attn._get_attn_isa(torch.float32, block_size, head_size)
    case = make_case(10, num_kv_heads, group, head_size, block_size, 90, num_pad=1, seed=9)
    kw = case.kwargs
    # fill both caches with the same "history" for every block-table position, then run the batch
    hist_k, hist_v, hist_slots = _history(case, seed=10)
    caches = pa.split_kv_cache(case.kv_cache, head_size)
    pa.write_kv_reference(hist_k, hist_v, *caches, hist_slots)
    want = pa.paged_attention_reference(case.query, case.key, case.value, *caches, **kw)

    cpu_cache = torch.zeros(case.kv_cache.shape)
    key_cache, value_cache = vllm_cpu_chunks(cpu_cache)
    ops.cpu_attn_reshape_and_cache(hist_k, hist_v, key_cache, value_cache, hist_slots, isa)
    ops.cpu_attn_reshape_and_cache(
        case.key, case.value, key_cache, value_cache, kw["slot_mapping"], isa
    )
    got = vllm_cpu_attention(ops, case, key_cache, value_cache, isa)
    torch.testing.assert_close(want, got, **F32_TOL)


@pytest.mark.parametrize(
    "isa,block_size,head_size,group",
    [("vec", 32, 64, 3), ("vec16", 64, 80, 1)],
    ids=["vec-bs32-d64-gqa3", "vec16-bs64-d80-mha"],
)
def test_vllm_cpu_backend_cache_through_strided_views(kernel, isa, block_size, head_size, group):
    """vLLM's CPU-backend cache read and written in place through our two views: the value chunk
    as it is, the key chunk through the transposed strided view (``vllm_cpu_views``). Float32,
    sizes vLLM's CPU backend accepts (block sizes a multiple of 32; head size 80 makes vLLM choose
    ``vec16``). (a) History then the batch written by ``write_kv_reference`` (and by the Triton
    kernels) through the views, and by vLLM's ``cpu_attn_reshape_and_cache`` into vLLM's own
    chunks: the caches are bit-identical. (b) Our attention read through the views equals vLLM's
    ``cpu_attention_with_kv_cache`` on vLLM's cache."""
    ops = _vllm("vllm._custom_ops")
    cpu_attn = _vllm("vllm.v1.attention.backends.cpu_attn")
    if cpu_attn._get_attn_isa(torch.float32, block_size, head_size) != isa:
        pytest.skip(f"vLLM picks another ISA than {isa} for these sizes on this CPU")
    num_kv_heads = 2
    case = make_case(10, num_kv_heads, group, head_size, block_size, 150, num_pad=1, seed=12)
    kw = case.kwargs
    hist_k, hist_v, hist_slots = _history(case, seed=13)

    theirs = torch.zeros(case.kv_cache.shape)
    kc, vc = vllm_cpu_chunks(theirs)
    ops.cpu_attn_reshape_and_cache(
        hist_k, hist_v, kc, vc, hist_slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )
    ours = torch.zeros(case.kv_cache.shape)
    pa.write_kv_reference(hist_k, hist_v, *vllm_cpu_views(ours), hist_slots)
    assert torch.equal(ours, theirs) and theirs.count_nonzero() > 0  # (a), the history
    before_batch = ours.clone()

    want = pa.paged_attention_reference(
        case.query, case.key, case.value, *vllm_cpu_views(ours), **kw
    )
    ops.cpu_attn_reshape_and_cache(
        case.key,
        case.value,
        kc,
        vc,
        kw["slot_mapping"],
        isa,
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )
    assert torch.equal(ours, theirs) and not torch.equal(ours, before_batch)  # (a), the batch
    got = vllm_cpu_attention(ops, case, kc, vc, isa)
    torch.testing.assert_close(want, got, **F32_TOL)  # (b)

    specs = view_specs(*vllm_cpu_views(before_batch))
    out, cache = kernel(
        "paged_attention_triton_on_views",
        case.query,
        case.key,
        case.value,
        before_batch,
        specs,
        **kw,
    )
    assert torch.equal(cache, theirs)
    torch.testing.assert_close(out, want, **F32_TOL)


# ------------------------------------------------------------------------------------------------
# Gather/scatter, launch plan, dispatcher, errors, GPU.
# ------------------------------------------------------------------------------------------------


def test_gather_scatter_rows_round_trip():
    g = torch.Generator().manual_seed(11)
    residual = torch.randn(9, 16, generator=g)
    slots = torch.tensor([4, 5, -1, 7, 8, 20, 21, -1, 30])
    positions = torch.arange(9) + 100
    index = torch.tensor([6, 2, 0, 5], dtype=torch.int32)  # unsorted, int32 as a kernel may produce
    rows, act_slots, act_pos = pa.gather_rows(index, residual, slots, positions)
    assert torch.equal(rows, residual[index.long()])
    assert act_slots.tolist() == [21, -1, 4, 20] and act_pos.tolist() == [106, 102, 100, 105]

    before = residual.clone()
    out = pa.scatter_rows(residual, index, (rows * 2).double())
    assert out is residual
    changed = torch.zeros(9, dtype=torch.bool)
    changed[index.long()] = True
    assert torch.equal(residual[~changed], before[~changed])
    assert torch.equal(residual[changed], before[changed] * 2)
    assert pa.gather_rows(torch.empty(0, dtype=torch.long), residual)[0].shape == (0, 16)


def test_request_rows_from_query_start_loc():
    query_start_loc = torch.tensor([0, 3, 3, 7, 8], dtype=torch.int32)  # request 1 has no tokens
    assert pa.request_rows(query_start_loc, 8).tolist() == [0, 0, 0, 2, 2, 2, 2, 3]


def test_launch_config_splits_few_long_rows():
    assert pa.launch_config(64, 8, 4096, target_programs=264) == (1, pa._WHOLE_CONTEXT)
    assert pa.launch_config(1, 8, None, target_programs=264) == (1, pa._WHOLE_CONTEXT)
    # 8 programs want 33 splits; chunks are whole tiles, so 32 chunks of 128 positions cover 4096
    assert pa.launch_config(1, 8, 4096, target_programs=264) == (32, 128)
    assert pa.launch_config(2, 2, 1000, target_programs=8) == (2, 512)
    assert pa.launch_config(1, 8, 10, target_programs=264) == (1, pa._WHOLE_CONTEXT)  # one tile


def test_empty_batch_and_bad_inputs(kernel):
    case = make_case(4, 2, 3, 64, 16, 30)
    no_tokens = {k: case.kwargs[k][:0] for k in ("slot_mapping", "req_indices", "positions")}
    empty = Case(
        case.query[:0], case.key[:0], case.value[:0], case.kv_cache, {**case.kwargs, **no_tokens}
    )
    for out, cache in (empty.run_reference(), empty.run_kernel(kernel)):
        assert out.shape == (0, 6, 64) and torch.equal(cache, case.kv_cache)

    key_cache, value_cache = pa.split_kv_cache(case.kv_cache, 64)
    qkv = (case.query, case.key, case.value)
    for impl in (pa.paged_attention_reference, pa.paged_attention_triton):
        with pytest.raises(ValueError, match="multiple of num_kv_heads"):
            impl(case.query[:, :5], case.key, case.value, key_cache, value_cache, **case.kwargs)
        with pytest.raises(ValueError, match="head_size = 64"):  # head sizes disagree
            impl(*qkv, key_cache[..., :48], value_cache[..., :48], **case.kwargs)
        with pytest.raises(ValueError, match="key_cache and value_cache"):  # shapes disagree
            impl(*qkv, key_cache, value_cache[:, :1], **case.kwargs)
        with pytest.raises(ValueError, match="key_cache and value_cache"):  # the unified cache
            impl(*qkv, case.kv_cache, case.kv_cache, **case.kwargs)
        with pytest.raises(NotImplementedError, match="quantised"):
            impl(*qkv, key_cache, value_cache.half(), **case.kwargs)
        with pytest.raises(ValueError, match="positions"):
            impl(*qkv, key_cache, value_cache, **{**case.kwargs, "positions": torch.zeros(3)})


def test_dispatcher_uses_reference_on_cpu(monkeypatch):
    monkeypatch.delenv(pa.FORCE_TRITON_ENV, raising=False)

    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton kernels must not run for CPU tensors by default")

    monkeypatch.setattr(pa, "paged_attention_triton", no_triton)
    case = make_case(5, 2, 3, 64, 16, 40, num_pad=1)
    assert not pa.use_triton(case.query)
    cache = case.kv_cache.clone()
    caches = pa.split_kv_cache(cache, 64)
    out = pa.paged_attention(case.query, case.key, case.value, *caches, **case.kwargs)
    assert_same((out, cache), case.run_reference(), dict(rtol=0, atol=0))


def test_dispatcher_forced_triton_runs_the_kernels(kernel):
    case = make_case(5, 2, 3, 64, 16, 40, num_pad=1)
    args = (case.query, case.key, case.value, case.kv_cache, split_specs(case.kv_cache))
    out, cache, launches = kernel("forced_paged_attention_on_views", *args, **case.kwargs)
    assert launches == {"_write_kv_kernel": 1, "_paged_attention_partial_kernel": 1}
    assert_same((out, cache), case.run_reference(), F32_TOL)


def test_dispatcher_passes_max_context_on(kernel):
    """The dispatcher hands ``max_context`` to the kernels: the true bound gives the reference's
    output; one far too small (positions past it are dropped once the context is split) does
    not, which it could not if the dispatcher read ``positions.max()`` itself."""
    case = make_case(3, 1, 3, 64, 16, 300, seed=1)  # 3 programs: the context is split
    args = (case.query, case.key, case.value, case.kv_cache, split_specs(case.kv_cache))
    forced = "forced_paged_attention_on_views"
    out, cache, _ = kernel(forced, *args, **case.kwargs, max_context=300)
    assert_same((out, cache), case.run_reference(), F32_TOL)
    short, _, _ = kernel(forced, *args, **case.kwargs, max_context=130)
    assert not torch.allclose(short, out, **F32_TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton)")
@pytest.mark.parametrize(
    "shape",
    [(1, 8, 4, 128, 16, 4096), (64, 8, 4, 128, 16, 1000), (30, 3, 3, 64, 16, 777)],
    ids=lambda s: "A{}-kv{}-g{}-d{}-bs{}-ctx{}".format(*s),
)
def test_bf16_on_gpu(shape):
    """The compiled kernels on bfloat16 Llama-3-8B (32 q / 8 kv heads) and SmolLM2 (9 / 3) shapes."""
    case = make_case(*shape, num_pad=min(1, shape[0] - 1), dtype=torch.bfloat16)
    for name in ("query", "key", "value", "kv_cache"):
        setattr(case, name, getattr(case, name).cuda())
    case.kwargs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in case.kwargs.items()}
    ref_out, ref_cache = case.run_reference()
    cache = case.kv_cache.clone()
    assert pa.use_triton(case.query)
    caches = pa.split_kv_cache(cache, shape[3])
    out = pa.paged_attention(case.query, case.key, case.value, *caches, **case.kwargs)
    assert torch.equal(cache, ref_cache)
    # bf16 products are exact in float32; the float32 results differ only in summation order, so
    # the bfloat16 outputs are at most a rounding apart (2 ulps = 2 * 2^-8 relative allowed)
    torch.testing.assert_close(out, ref_out, rtol=8e-3, atol=1e-5)

"""Partial-layer execution over PagedAttention: one decoder layer's attention for a *subset* of a batch.

AdaDecode-style decoding runs a layer for only some of the batch's tokens (the tokens that still
need that layer: early-predicted tokens whose deeper layers were deferred, plus the tokens that
entered at that depth). For that subset the engine needs:

* the subset's rows of the batch tensors (residual stream, positions, slot mapping, request rows)
  and, after the layer, the updated residual rows written back: :func:`gather_rows` and
  :func:`scatter_rows`. These stay plain ``index_select`` / ``index_copy_`` (see below why);
* one decode attention row per active token over its request's paged KV cache:
  :func:`paged_attention`. Each token first writes its new K/V at its slot (vLLM's
  ``reshape_and_cache_flash`` semantics: a negative slot is padding and writes nothing), then its
  ``num_q_heads`` query heads (GQA: a multiple of ``num_kv_heads``; query head ``i`` reads KV head
  ``i // (num_q_heads // num_kv_heads)``) attend over positions ``0 .. position`` of its request,
  read through the block table. Every write happens before any read, so several tokens of one
  request at consecutive positions (AdaDecode's deferred tokens) see each other's new K/V.

KV-cache layout (vLLM 0.32, FlashAttention, the first-priority CUDA backend for Llama on
SM 8.x/9.x: ``vllm/platforms/cuda.py:166-179``; SM 10.x prefers FlashInfer, ``:158-165``): each
layer's cache is the logical view ``kv_cache[num_blocks, num_kv_heads, block_size, 2 * head_size]``
(``flash_attn.py:1196-1197``); per token and head the last axis holds the key then the value:
``key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)``
(``vllm/v1/attention/backends/flash_attn.py:1252`` for attention, ``:1443`` for the cache write).
The *physical* order is a separate choice (``vllm/v1/kv_cache_layout.py:15-28``,
``KVCacheLayout``): FlashAttention declares no preference (``vllm/v1/attention/backend.py:369-372``),
so the default preference applies, ``LBNHC`` first (``vllm/v1/attention/backends/utils.py:195-224``),
i.e. memory ``[layer][block][token][kv head][K | V]``; the per-layer tensor is a strided
``as_strided`` view (``vllm/v1/kv_cache_interface.py:377-441``). The older
``[2, num_blocks, block_size, num_kv_heads, head_size]`` layout is *not* what vLLM 0.32 uses.

Every function here takes the cache as two views, ``key_cache`` and ``value_cache``, each the
logical ``[num_blocks, num_kv_heads, block_size, head_size]`` with arbitrary strides (both paths
read every stride from the tensors, so any ``KVCacheLayout`` works). For the FlashAttention /
FlashInfer view above, :func:`split_kv_cache` gives them: ``kv_cache[..., :head_size]`` and
``kv_cache[..., head_size:]``. vLLM's CPU backend (``cpu_attn.py:411-416``) views its cache as
``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and chunks it into K rows then V rows per
block and head; for ISAs ``vec`` and ``vec16`` its V rows are plain (token-major) and its K rows
are transposed (element d of token o at ``d * block_size + o``), so that cache is readable here
through the strided key view ``torch.as_strided(kc, (nb, nh, bs, hd), (kc.stride(0), kc.stride(1),
1, bs), kc.storage_offset())`` and the value chunk as it is (other ISAs, such as ``amx``, are not
covered).

Numerics (the spec, shared by both paths): scores ``q . k`` with inputs in their dtype and products
summed in float32, times ``scale``; softmax in float32; ``P @ V`` with P in float32 and V upcast to
float32; the output rounded to the query dtype. The cache is written in its own dtype, which must be
the key/value dtype (no fp8 / quantised caches).

``paged_attention`` dispatches: Triton when the tensors are on CUDA (or when
``VLLM_SELFSPEC_FORCE_TRITON=1``, used by the interpreter tests), else the PyTorch reference.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the reference path needs no Triton
    HAS_TRITON = False

FORCE_TRITON_ENV = "VLLM_SELFSPEC_FORCE_TRITON"

# Context positions per tile of the attention kernel (a tile may span several KV blocks).
BLOCK_N = 64
# Programs the split-context heuristic aims for when the device's SM count is unknown (interpreter).
DEFAULT_TARGET_PROGRAMS = 8
# The chunk of context one split covers when there is a single split: larger than any position.
_WHOLE_CONTEXT = 1 << 30


# --------------------------------------------------------------------------------------------------
# The active subset's rows: plain PyTorch.
#
# ``index_select`` along dim 0 is one kernel that reads and writes exactly the A selected rows, and
# ``index_copy_`` one kernel that writes them back: the minimum memory traffic for a gather/scatter.
# A Triton version could only fuse the four small gathers (residual stream, positions, slots,
# request rows) into one launch, saving a few microseconds of launch latency, which CUDA graphs
# remove anyway. The gain worth having is fusing the gather into the consumer (the layer's RMSNorm
# reading rows by index), which belongs to that kernel, not to a standalone gather.
# --------------------------------------------------------------------------------------------------


def gather_rows(index: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The active subset's rows of each ``[T, ...]`` batch tensor: ``t[index]`` for every ``t``
    (residual stream, positions, slot mapping, request rows, ...)."""
    index = index.long()
    return tuple(t.index_select(0, index) for t in tensors)


def scatter_rows(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Write the subset's updated rows back in place: ``out[index] = rows``; returns ``out``.
    ``index`` entries must be unique (duplicates make the result order-dependent)."""
    return out.index_copy_(0, index.long(), rows.to(out.dtype))


def request_rows(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Request row (into the block table) of each of the batch's ``num_tokens`` tokens, from
    vLLM's ``query_start_loc`` ``[num_reqs + 1]`` (request r owns tokens ``qsl[r] .. qsl[r+1]-1``)."""
    tokens = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    return torch.searchsorted(query_start_loc[1:].contiguous(), tokens, right=True)


# --------------------------------------------------------------------------------------------------
# The cache views and the checks shared by both paths.
# --------------------------------------------------------------------------------------------------


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache) views of vLLM 0.32's FlashAttention / FlashInfer per-layer cache
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (key then value on the last axis):
    ``kv_cache[..., :head_size]`` and ``kv_cache[..., head_size:]``, sharing its storage."""
    return kv_cache[..., :head_size], kv_cache[..., head_size:]


def _check_inputs(
    query, key, value, key_cache, value_cache, slot_mapping, block_table, req_indices, positions
):
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(
            f"query/key/value must be [A, heads, head_size]; got {tuple(query.shape)}, "
            f"{tuple(key.shape)}"
        )
    num_tokens, num_q_heads, head_size = query.shape
    if (
        key_cache.dim() != 4
        or key_cache.shape[3] != head_size
        or value_cache.shape != key_cache.shape
    ):
        raise ValueError(
            f"key_cache and value_cache must both be [num_blocks, num_kv_heads, block_size, "
            f"head_size = {head_size}]; got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    num_kv_heads = key_cache.shape[1]
    if key.shape != (num_tokens, num_kv_heads, head_size) or value.shape != key.shape:
        raise ValueError(
            f"key and value must be [{num_tokens}, {num_kv_heads}, {head_size}], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    for name, t in (
        ("slot_mapping", slot_mapping),
        ("req_indices", req_indices),
        ("positions", positions),
    ):
        if t.shape != (num_tokens,):
            raise ValueError(f"{name} must be [{num_tokens}], got {tuple(t.shape)}")
    if block_table.dim() != 2:
        raise ValueError(
            f"block_table must be [num_reqs, max_blocks], got {tuple(block_table.shape)}"
        )
    dtypes = (query.dtype, key.dtype, value.dtype, key_cache.dtype, value_cache.dtype)
    if len(set(dtypes)) != 1:
        raise NotImplementedError(
            f"query, key, value, key_cache and value_cache must share one dtype (no fp8 / quantised "
            f"KV caches); got {', '.join(map(str, dtypes))}"
        )


# --------------------------------------------------------------------------------------------------
# The PyTorch reference (the spec).
# --------------------------------------------------------------------------------------------------


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``reshape_and_cache_flash``: token a's K/V go to block ``slot // block_size``, row
    ``slot % block_size`` of ``key_cache`` / ``value_cache`` (in place, through their strides);
    negative slots are padding and write nothing."""
    block_size = key_cache.shape[2]
    keep = (slot_mapping >= 0).nonzero()[:, 0]
    slots = slot_mapping[keep].long()
    blocks, rows = slots // block_size, slots % block_size
    key_cache[blocks, :, rows] = key[keep]  # [n, num_kv_heads, head_size]
    value_cache[blocks, :, rows] = value[keep]


def attend_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each token's decode attention over positions ``0 .. position`` of its request: gather the
    K/V of those positions through the block table (padded to the longest context, masked), softmax."""
    num_tokens, num_q_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    if num_tokens == 0:
        return query.new_empty(query.shape)
    context = positions.long() + 1
    n = torch.arange(int(context.max()), device=query.device)
    blocks, rows = block_table.long()[req_indices.long()][:, n // block_size], n % block_size
    k = key_cache[blocks, :, rows].float()  # [A, L, num_kv_heads, head_size]
    v = value_cache[blocks, :, rows].float()
    q = query.float().view(num_tokens, num_kv_heads, num_q_heads // num_kv_heads, head_size)
    scores = torch.einsum("ahgd,alhd->ahgl", q, k) * scale
    scores.masked_fill_(n[None, None, None, :] >= context[:, None, None, None], float("-inf"))
    out = torch.einsum("ahgl,alhd->ahgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(num_tokens, num_q_heads, head_size).to(query.dtype)


def paged_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The spec, in plain PyTorch: write every token's K/V at its slot, then attend.

    query ``[A, num_q_heads, head_size]``; key, value ``[A, num_kv_heads, head_size]``;
    key_cache, value_cache the layer's cache views ``[num_blocks, num_kv_heads, block_size,
    head_size]``, any strides (updated in place; see the module docstring and
    :func:`split_kv_cache`); slot_mapping ``[A]`` (negative: padding); block_table
    ``[num_reqs, max_blocks]``; req_indices ``[A]``: each token's block-table row; positions
    ``[A]``: causal length is ``position + 1``. Returns ``[A, num_q_heads, head_size]`` in the
    query dtype.
    """
    _check_inputs(
        query, key, value, key_cache, value_cache, slot_mapping, block_table, req_indices, positions
    )
    write_kv_reference(key, value, key_cache, value_cache, slot_mapping)
    return attend_reference(
        query, key_cache, value_cache, block_table, req_indices, positions, scale
    )


# --------------------------------------------------------------------------------------------------
# The Triton kernels.
# --------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_config(
    num_tokens: int,
    num_kv_heads: int,
    max_context: int | None,
    target_programs: int = DEFAULT_TARGET_PROGRAMS,
) -> tuple[int, int]:
    """Context split for ``num_tokens`` x ``num_kv_heads`` programs: returns (num_splits, chunk).

    When there are fewer programs than ``target_programs``, each token's context is split into
    chunks of ``chunk`` positions (a multiple of BLOCK_N) handled by separate programs
    (flash-decoding), so that a few long rows still fill the GPU. ``max_context`` (the longest
    ``position + 1``) is only needed then; ``None`` there means no split.
    """
    programs = num_tokens * num_kv_heads
    if programs >= target_programs or max_context is None:
        return 1, _WHOLE_CONTEXT
    splits = max(1, min(_cdiv(target_programs, programs), _cdiv(max_context, BLOCK_N)))
    return _split_context(max_context, splits)


def _split_context(max_context: int, splits: int) -> tuple[int, int]:
    """(num_splits, chunk): chunks of a multiple of BLOCK_N positions, none of them beyond max_context."""
    if splits <= 1:
        return 1, _WHOLE_CONTEXT
    chunk = _cdiv(_cdiv(max_context, splits), BLOCK_N) * BLOCK_N
    return _cdiv(max_context, chunk), chunk


if HAS_TRITON:

    @triton.jit
    def _write_kv_kernel(
        k_ptr,
        v_ptr,
        kc_ptr,
        vc_ptr,
        slot_ptr,
        head_size,
        block_size,
        stride_ka,
        stride_kh,
        stride_kd,
        stride_va,
        stride_vh,
        stride_vd,
        stride_kcb,
        stride_kch,
        stride_kcn,
        stride_kcd,
        stride_vcb,
        stride_vch,
        stride_vcn,
        stride_vcd,
        BLOCK_D: tl.constexpr,
    ):
        """One program: one token's K and V for one KV head, stored at its slot (skipped if < 0)."""
        a = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slot_ptr + a).to(tl.int64)
        if slot >= 0:
            d = tl.arange(0, BLOCK_D)
            d_mask = d < head_size
            k = tl.load(k_ptr + a * stride_ka + h * stride_kh + d * stride_kd, mask=d_mask)
            v = tl.load(v_ptr + a * stride_va + h * stride_vh + d * stride_vd, mask=d_mask)
            block, row = slot // block_size, slot % block_size
            k_dst = kc_ptr + block * stride_kcb + h * stride_kch + row * stride_kcn
            v_dst = vc_ptr + block * stride_vcb + h * stride_vch + row * stride_vcn
            tl.store(k_dst + d * stride_kcd, k, mask=d_mask)
            tl.store(v_dst + d * stride_vcd, v, mask=d_mask)

    @triton.jit
    def _paged_attention_partial_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        bt_ptr,
        req_ptr,
        pos_ptr,
        part_acc_ptr,
        part_max_ptr,
        part_sum_ptr,
        scale,
        chunk,
        num_tokens,
        num_q_heads,
        head_size,
        block_size,
        stride_qa,
        stride_qh,
        stride_qd,
        stride_kcb,
        stride_kch,
        stride_kcn,
        stride_kcd,
        stride_vcb,
        stride_vch,
        stride_vcn,
        stride_vcd,
        stride_bt,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One program: one token x one KV head (its GROUP query heads) x one context chunk.
        Writes the chunk's online-softmax state: unnormalised output, max score, sum of exp."""
        a = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        req = tl.load(req_ptr + a).to(tl.int64)
        context = tl.load(pos_ptr + a).to(tl.int64) + 1

        g = tl.arange(0, BLOCK_G)
        g_mask = g < GROUP
        heads = h * GROUP + g
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_size
        q = tl.load(
            q_ptr + a * stride_qa + heads[:, None] * stride_qh + d[None, :] * stride_qd,
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )

        run_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

        start = s.to(tl.int64) * chunk
        end = tl.minimum(start + chunk, context)
        for n0 in range(start, end, BLOCK_N):  # every tile holds >= 1 valid position
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < end
            blocks = tl.load(bt_ptr + req * stride_bt + n // block_size, mask=n_mask, other=0).to(
                tl.int64
            )
            rows = n % block_size
            k_rows = kc_ptr + blocks * stride_kcb + h * stride_kch + rows * stride_kcn
            v_rows = vc_ptr + blocks * stride_vcb + h * stride_vch + rows * stride_vcn
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_rows[:, None] + d[None, :] * stride_kcd, mask=kv_mask, other=0.0)
            v = tl.load(v_rows[:, None] + d[None, :] * stride_vcd, mask=kv_mask, other=0.0)

            # input_precision only concerns float32 x float32: IEEE there, not TF32
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N]
            scores = tl.where(n_mask[None, :], scores, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(scores, axis=1))
            alpha = tl.exp(run_max - new_max)
            p = tl.exp(scores - new_max[:, None])
            run_sum = run_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            run_max = new_max

        out = (s * num_tokens + a) * num_q_heads + heads
        tl.store(part_max_ptr + out, run_max, mask=g_mask)
        tl.store(part_sum_ptr + out, run_sum, mask=g_mask)
        tl.store(
            part_acc_ptr + out[:, None] * head_size + d[None, :],
            acc,
            mask=g_mask[:, None] & d_mask[None, :],
        )


def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_TARGET_PROGRAMS


def _block(n: int) -> int:
    """Power-of-two tile extent >= n and >= 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(n))


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as :func:`write_kv_reference`: one program per (token, KV head)."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping.contiguous(),
        head_size,
        key_cache.shape[2],
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        BLOCK_D=triton.next_power_of_2(head_size),
    )


def attend_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    max_context: int | None = None,
) -> torch.Tensor:
    """Same contract as :func:`attend_reference`, streaming K/V tiles with an online softmax.

    Grid: (tokens, KV heads, context splits). Each program keeps its GROUP query heads as one
    ``[BLOCK_G, head_size]`` tile, so K/V are read once per KV head, not once per query head.
    ``num_splits`` overrides the split heuristic (tests use it); ``max_context`` (at least every
    ``position + 1``: positions past it would be dropped when the context is split) spares the
    heuristic a device-to-host read of ``positions.max()`` when it wants to split. The
    ``[splits, A, num_q_heads]`` partials are combined in PyTorch.
    """
    num_tokens, num_q_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[1]
    if num_tokens == 0:
        return query.new_empty(query.shape)
    target = _target_programs(query.device)
    if max_context is None and (num_splits is not None or num_tokens * num_kv_heads < target):
        max_context = int(positions.max()) + 1  # only needed to split the context
    if num_splits is None:
        splits, chunk = launch_config(num_tokens, num_kv_heads, max_context, target)
    else:
        splits, chunk = _split_context(max_context, num_splits)

    part_acc = torch.empty(
        splits, num_tokens, num_q_heads, head_size, dtype=torch.float32, device=query.device
    )
    part_max = torch.empty(
        splits, num_tokens, num_q_heads, dtype=torch.float32, device=query.device
    )
    part_sum = torch.empty_like(part_max)
    group = num_q_heads // num_kv_heads
    _paged_attention_partial_kernel[(num_tokens, num_kv_heads, splits)](
        query,
        key_cache,
        value_cache,
        block_table,
        req_indices.contiguous(),
        positions.contiguous(),
        part_acc,
        part_max,
        part_sum,
        scale,
        chunk,
        num_tokens,
        num_q_heads,
        head_size,
        key_cache.shape[2],
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        block_table.stride(0),
        GROUP=group,
        BLOCK_G=_block(group),
        BLOCK_N=BLOCK_N,
        BLOCK_D=_block(head_size),
    )
    # Combine the splits (a split past a token's context has max -inf, sum 0: weight 0).
    row_max = part_max.max(dim=0).values
    weight = torch.exp(part_max - row_max)
    out = (part_acc * weight[..., None]).sum(dim=0) / (part_sum * weight).sum(dim=0)[..., None]
    return out.to(query.dtype)


def paged_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_context: int | None = None,
) -> torch.Tensor:
    """Same contract as :func:`paged_attention_reference`: two launches, the cache write first
    (so every token's read sees every token's write), then the attention."""
    if not HAS_TRITON:
        raise RuntimeError("paged_attention_triton needs Triton")
    _check_inputs(
        query, key, value, key_cache, value_cache, slot_mapping, block_table, req_indices, positions
    )
    write_kv_triton(key, value, key_cache, value_cache, slot_mapping)
    return attend_triton(
        query,
        key_cache,
        value_cache,
        block_table,
        req_indices,
        positions,
        scale,
        num_splits=num_splits,
        max_context=max_context,
    )


def use_triton(query: torch.Tensor) -> bool:
    """Triton for CUDA tensors (if Triton imports), or everywhere when VLLM_SELFSPEC_FORCE_TRITON=1."""
    if os.environ.get(FORCE_TRITON_ENV) == "1":
        return True
    return HAS_TRITON and query.is_cuda


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    max_context: int | None = None,
) -> torch.Tensor:
    """Dispatcher: the Triton kernels where they run (see :func:`use_triton`), else the reference.
    ``max_context`` (at least every ``position + 1``) spares the kernels' split decision a
    device-to-host read of ``positions.max()``, a synchronisation that costs more than the kernels
    at small shapes on a GPU and cannot be captured in a CUDA graph (docs/results/kernels-h100/bench.txt);
    the reference ignores it."""
    batch = dict(
        slot_mapping=slot_mapping,
        block_table=block_table,
        req_indices=req_indices,
        positions=positions,
        scale=scale,
    )
    caches = (key_cache, value_cache)
    if use_triton(query):
        return paged_attention_triton(query, key, value, *caches, **batch, max_context=max_context)
    return paged_attention_reference(query, key, value, *caches, **batch)

"""Batched shadow-token LM-head projection: argmax, its probability and one token's probability.

Self-speculative policies project *shadow* rows through the LM head: the residual stream of verified
tokens captured after several layers (N = layers x verified tokens rows), to ask "what would an exit
at layer l have predicted, and how confident was it?". They only need three numbers per row:

* ``argmax_ids``  [N] int64: the greedy token (lowest vocabulary index on an exact tie),
* ``max_prob``    [N] float32: its softmax probability,
* ``token_prob``  [N] float32: the probability of a given token (e.g. the token the target verified),

never the [N, V] logits. Materialising them costs N x V x 4 bytes (141 MiB for Llama-3-8B shapes, see
``memory.py``), so the Triton kernel streams the LM-head weight in vocabulary tiles and keeps an
*online softmax* per row instead: running max, running sum of exp, running argmax and the logit of
the requested token. For few rows it also splits the vocabulary across programs (split-V); a
second small kernel combines the per-split partials.

Numerics (the spec, shared by both paths):

* Optional final RMSNorm on a raw residual stream: ``x * rsqrt(mean(x^2) + eps) * w``, all in
  float32 (vLLM's RMSNorm rounds to the model dtype before multiplying by ``w``; we don't). Both
  paths take it from ``lm_head_input`` (PyTorch, N x d: once per call, not once per vocabulary
  tile), so on one device they feed the projection the same rounded rows.
* The (normalised) hidden is rounded to the LM-head weight dtype, as vLLM's LM head receives it, and
  the projection accumulates in float32. Logits stay float32 (vLLM rounds them to the model dtype).
* Softmax in float32. ``vocab_index`` restricts the vocabulary to a subset: ids are reported in the
  original vocabulary, probabilities are the softmax over the subset, and a ``token_ids`` entry not
  in the subset has probability 0. ``vocab_index`` entries must be unique and in ``[0, V)``.

``lm_head_argmax`` dispatches: Triton when the tensors are on CUDA (or when
``VLLM_SELFSPEC_FORCE_TRITON=1``, used by the interpreter tests), else the PyTorch reference.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the reference path needs no Triton
    HAS_TRITON = False

FORCE_TRITON_ENV = "VLLM_SELFSPEC_FORCE_TRITON"

# Default tile sizes and launch options of the Triton kernel (tl.dot needs every dimension >= 16).
BLOCK_V = 128
BLOCK_D = 64
NUM_WARPS = 4
NUM_STAGES = 3
# Rows per program of the kernel that combines the vocabulary splits.
COMBINE_ROWS = 128
# Number of programs the split-V heuristic aims for when the device's SM count is unknown (interpreter).
DEFAULT_TARGET_PROGRAMS = 8

Result = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def _check_inputs(hidden, weight, norm_weight, token_ids, vocab_index) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [N, d] and weight [V, d]; got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden has d={hidden.shape[1]}, weight d={weight.shape[1]}"
        )
    if norm_weight is not None and norm_weight.shape != (hidden.shape[1],):
        raise ValueError(f"norm_weight must be [{hidden.shape[1]}], got {tuple(norm_weight.shape)}")
    if token_ids is not None and token_ids.shape != (hidden.shape[0],):
        raise ValueError(f"token_ids must be [{hidden.shape[0]}], got {tuple(token_ids.shape)}")
    if vocab_index is not None and (vocab_index.dim() != 1 or vocab_index.numel() == 0):
        raise ValueError(
            f"vocab_index must be a non-empty 1-D tensor, got {tuple(vocab_index.shape)}"
        )
    if vocab_index is None and weight.shape[0] == 0:
        raise ValueError("weight has an empty vocabulary")


def lm_head_input(
    hidden: torch.Tensor, dtype: torch.dtype, norm_weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """What the LM head sees, in ``dtype`` (the weight's): the rows, RMS-normalised in float32
    first when ``norm_weight`` is given. Both paths take their input from here, so on one device
    they round every normalised element alike."""
    if norm_weight is None:
        return hidden.to(dtype)
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * norm_weight.float()
    return x.to(dtype)


def lm_head_argmax_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    token_ids: torch.Tensor | None = None,
    vocab_index: torch.Tensor | None = None,
    chunk_v: int = 8192,
) -> Result:
    """The spec, in plain PyTorch: materialise float32 logits, softmax, argmax, gather.

    ``chunk_v`` only bounds the float32 copy of the weight made per step (the logits of all V columns
    are still materialised); it does not change the result.
    """
    _check_inputs(hidden, weight, norm_weight, token_ids, vocab_index)
    x = lm_head_input(hidden, weight.dtype, norm_weight, eps).float()

    w = weight if vocab_index is None else weight[vocab_index]
    logits = torch.cat(
        [x @ w[i : i + chunk_v].float().T for i in range(0, w.shape[0], chunk_v)], dim=1
    )
    probs = torch.softmax(logits, dim=-1)
    pos = probs.argmax(dim=-1)  # first maximal index: the lowest position on a tie
    max_prob = probs.gather(1, pos[:, None])[:, 0]
    argmax_ids = pos if vocab_index is None else vocab_index[pos]

    token_prob = None
    if token_ids is not None:
        if vocab_index is None:
            token_pos = token_ids
        else:  # position of each token in the subset, -1 when absent
            where = torch.full((weight.shape[0],), -1, dtype=torch.long, device=weight.device)
            where[vocab_index] = torch.arange(vocab_index.numel(), device=weight.device)
            token_pos = where[token_ids]
        gathered = probs.gather(1, token_pos.clamp(min=0)[:, None])[:, 0]
        token_prob = torch.where(token_pos >= 0, gathered, torch.zeros_like(gathered))
    return argmax_ids.long(), max_prob, token_prob


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split_vocab(vocab: int, splits: int, block_v: int = BLOCK_V) -> tuple[int, int]:
    """(num_splits, chunk): chunks of a multiple of block_v columns, none of them empty."""
    chunk = _cdiv(_cdiv(vocab, splits), block_v) * block_v
    return _cdiv(vocab, chunk), chunk


class Tiles(NamedTuple):
    """One launch of the kernel: its tiles, Triton's launch options and the split-V plan."""

    block_n: int  # rows per program
    splits: int  # vocabulary chunks (programs along V)
    chunk: int  # columns per chunk, a multiple of block_v
    block_v: int = BLOCK_V
    block_d: int = BLOCK_D
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES


def launch_config(
    num_rows: int, vocab: int, target_programs: int = DEFAULT_TARGET_PROGRAMS
) -> Tiles:
    """Tile plan for ``num_rows`` x ``vocab``.

    Rows go in blocks of ``block_n`` (each block streams its vocabulary chunk of the weight). When
    there are fewer row blocks than ``target_programs``, the vocabulary is split into ``splits``
    chunks of ``chunk`` columns so that the GPU still has enough programs (split-V).
    ``benchmarks/lm_head_tiles.py`` times alternatives to this plan on a GPU.
    """
    # many rows: larger row blocks (each streams the weight once), more warps and stages, as the
    # tile sweeps on an H100 found (docs/results/kernels-h100/tiles.txt)
    if num_rows > 64:
        block_n, warps, stages = 128, 8, 4
    else:
        block_n, warps, stages = (16 if num_rows <= 16 else 32 if num_rows <= 32 else 64), 4, 3
    row_blocks = _cdiv(num_rows, block_n)
    splits = max(1, min(_cdiv(target_programs, row_blocks), _cdiv(vocab, BLOCK_V)))
    return Tiles(block_n, *_split_vocab(vocab, splits), num_warps=warps, num_stages=stages)


if HAS_TRITON:

    @triton.jit
    def _lm_head_argmax_partial_kernel(
        x_ptr,
        w_ptr,
        tok_ptr,
        vidx_ptr,
        part_max_ptr,
        part_sum_ptr,
        part_arg_ptr,
        part_tok_ptr,
        N,
        V,
        D,
        chunk,
        stride_xn,
        stride_xd,
        stride_wv,
        stride_wd,
        HAS_TOKENS: tl.constexpr,
        HAS_SUBSET: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One program: BLOCK_N rows x one vocabulary chunk. Writes the chunk's online-softmax state
        (max logit, sum of exp relative to it, position of the max, logit of the row's token)."""
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xn

        if HAS_TOKENS:
            tok = tl.load(tok_ptr + rows, mask=row_mask, other=-1)

        run_max = tl.full([BLOCK_N], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
        run_arg = tl.zeros([BLOCK_N], dtype=tl.int32)
        run_tok = tl.full([BLOCK_N], float("-inf"), tl.float32)

        v_start = pid_s * chunk
        v_end = tl.minimum(v_start + chunk, V)
        for v0 in range(v_start, v_end, BLOCK_V):  # every tile holds >= 1 valid column
            pos = v0 + tl.arange(0, BLOCK_V)
            v_mask = pos < v_end
            if HAS_SUBSET:
                ids = tl.load(vidx_ptr + pos, mask=v_mask, other=0)
            else:
                ids = pos.to(tl.int64)
            w_cols = w_ptr + ids.to(tl.int64)[None, :] * stride_wv

            acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                d_mask = offs_d < D
                x = tl.load(
                    x_rows + offs_d[None, :] * stride_xd,
                    mask=row_mask[:, None] & d_mask[None, :],
                    other=0.0,
                )
                w = tl.load(
                    w_cols + offs_d[:, None] * stride_wd,
                    mask=d_mask[:, None] & v_mask[None, :],
                    other=0.0,
                )
                # input_precision only concerns float32 x float32: IEEE there, not TF32
                acc = tl.dot(x, w, acc, input_precision="ieee")

            logits = tl.where(v_mask[None, :], acc, float("-inf"))
            tile_max = tl.max(logits, axis=1)
            # lowest position among the tile's maxima; a later tile wins only if strictly larger
            tile_arg = tl.min(tl.where(logits == tile_max[:, None], pos[None, :], V), axis=1)
            new_max = tl.maximum(run_max, tile_max)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(
                tl.exp(logits - new_max[:, None]), axis=1
            )
            run_arg = tl.where(tile_max > run_max, tile_arg, run_arg)
            run_max = new_max
            if HAS_TOKENS:
                hit = (ids[None, :] == tok[:, None]) & v_mask[None, :]
                run_tok = tl.maximum(run_tok, tl.max(tl.where(hit, logits, float("-inf")), axis=1))

        out = pid_s * N + rows
        tl.store(part_max_ptr + out, run_max, mask=row_mask)
        tl.store(part_sum_ptr + out, run_sum, mask=row_mask)
        tl.store(part_arg_ptr + out, run_arg, mask=row_mask)
        if HAS_TOKENS:
            tl.store(part_tok_ptr + out, run_tok, mask=row_mask)

    @triton.jit
    def _lm_head_argmax_combine_kernel(
        part_max_ptr,
        part_sum_ptr,
        part_arg_ptr,
        part_tok_ptr,
        vidx_ptr,
        ids_ptr,
        max_prob_ptr,
        tok_prob_ptr,
        N,
        splits,
        HAS_TOKENS: tl.constexpr,
        HAS_SUBSET: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        """BLOCK_R rows: merge the splits' online-softmax states in split order (a later split
        wins the argmax only if strictly larger: lowest index on a tie) into the three outputs."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = rows < N
        run_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
        run_arg = tl.zeros([BLOCK_R], dtype=tl.int32)
        run_tok = tl.full([BLOCK_R], float("-inf"), tl.float32)
        for sp in range(0, splits):
            at = sp * N + rows
            m = tl.load(part_max_ptr + at, mask=mask, other=float("-inf"))
            new_max = tl.maximum(run_max, m)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.load(
                part_sum_ptr + at, mask=mask, other=0.0
            ) * tl.exp(m - new_max)
            run_arg = tl.where(m > run_max, tl.load(part_arg_ptr + at, mask=mask, other=0), run_arg)
            run_max = new_max
            if HAS_TOKENS:
                t = tl.load(part_tok_ptr + at, mask=mask, other=float("-inf"))
                run_tok = tl.maximum(run_tok, t)
        ids = run_arg.to(tl.int64)
        if HAS_SUBSET:
            ids = tl.load(vidx_ptr + run_arg, mask=mask, other=0)
        tl.store(ids_ptr + rows, ids, mask=mask)
        tl.store(max_prob_ptr + rows, 1.0 / run_sum, mask=mask)  # exp(max - max) / sum
        if HAS_TOKENS:
            tl.store(tok_prob_ptr + rows, tl.exp(run_tok - run_max) / run_sum, mask=mask)


def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_TARGET_PROGRAMS


def lm_head_argmax_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    token_ids: torch.Tensor | None = None,
    vocab_index: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> Result:
    """Same contract as :func:`lm_head_argmax_reference`, without materialising the [N, V] logits.

    ``num_splits`` overrides the split-V heuristic (tests use it to cover both the one-split and
    the many-split paths). Memory: four [num_splits, N] float32/int32 partial buffers, and the
    [N, d] normalised rows in the weight's dtype when ``norm_weight`` is given.
    """
    if not HAS_TRITON:
        raise RuntimeError("lm_head_argmax_triton needs Triton")
    _check_inputs(hidden, weight, norm_weight, token_ids, vocab_index)
    n, d = hidden.shape
    vocab = weight.shape[0] if vocab_index is None else vocab_index.numel()
    device = hidden.device
    if n == 0:
        empty = torch.empty(0, device=device)
        return empty.long(), empty.float(), None if token_ids is None else empty.float()

    tiles = launch_config(n, vocab, _target_programs(device))
    if num_splits is not None:
        splits, chunk = _split_vocab(vocab, num_splits, tiles.block_v)
        tiles = tiles._replace(splits=splits, chunk=chunk)
    splits = tiles.splits

    part_max = torch.empty(splits, n, dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    part_arg = torch.empty(splits, n, dtype=torch.int32, device=device)
    part_tok = torch.empty_like(part_max) if token_ids is not None else part_max
    tok = (
        token_ids.long().contiguous() if token_ids is not None else part_arg
    )  # dummies when absent
    vidx = vocab_index.long().contiguous() if vocab_index is not None else part_arg
    # normalised once here (not per vocabulary tile in the kernel), with the reference's own ops
    hidden = lm_head_input(hidden, weight.dtype, norm_weight, eps)

    _lm_head_argmax_partial_kernel[(_cdiv(n, tiles.block_n), splits)](
        hidden,
        weight,
        tok,
        vidx,
        part_max,
        part_sum,
        part_arg,
        part_tok,
        n,
        vocab,
        d,
        tiles.chunk,
        hidden.stride(0),
        hidden.stride(1),
        weight.stride(0),
        weight.stride(1),
        HAS_TOKENS=token_ids is not None,
        HAS_SUBSET=vocab_index is not None,
        BLOCK_N=tiles.block_n,
        BLOCK_V=tiles.block_v,
        BLOCK_D=tiles.block_d,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )

    # Combine the splits (tiny: [splits, N]) in one launch: eagerly, the dozen PyTorch ops it
    # replaces cost more host time than the projection's GPU time on small models.
    argmax_ids = torch.empty(n, dtype=torch.int64, device=device)
    max_prob = torch.empty(n, dtype=torch.float32, device=device)
    token_prob = torch.empty_like(max_prob) if token_ids is not None else None
    _lm_head_argmax_combine_kernel[(_cdiv(n, COMBINE_ROWS),)](
        part_max,
        part_sum,
        part_arg,
        part_tok,
        vidx,
        argmax_ids,
        max_prob,
        max_prob if token_prob is None else token_prob,
        n,
        splits,
        HAS_TOKENS=token_ids is not None,
        HAS_SUBSET=vocab_index is not None,
        BLOCK_R=COMBINE_ROWS,
    )
    return argmax_ids, max_prob, token_prob


def use_triton(hidden: torch.Tensor) -> bool:
    """Triton for CUDA tensors (if Triton imports), or everywhere when VLLM_SELFSPEC_FORCE_TRITON=1."""
    if os.environ.get(FORCE_TRITON_ENV) == "1":
        return True
    return HAS_TRITON and hidden.is_cuda


def lm_head_argmax(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    token_ids: torch.Tensor | None = None,
    vocab_index: torch.Tensor | None = None,
) -> Result:
    """Dispatcher: the Triton kernel where it runs (see :func:`use_triton`), else the reference."""
    impl = lm_head_argmax_triton if use_triton(hidden) else lm_head_argmax_reference
    return impl(
        hidden,
        weight,
        norm_weight=norm_weight,
        eps=eps,
        token_ids=token_ids,
        vocab_index=vocab_index,
    )

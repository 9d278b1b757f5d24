"""Benchmark the Triton kernels of ``vllm_selfspec.kernels`` against their PyTorch references.

    python benchmarks/kernels.py [--repeats 7] [--dtype bfloat16|float16]

With CUDA: times the Triton shadow-token LM-head kernel and the reference on GPU-shaped inputs
(``--dtype``, bfloat16 by default; SmolLM2-135M and Llama-3-8B LM heads, N = layers x (gamma + 1)
shadow rows) and reports the peak extra GPU memory of each; then the paged-attention decode kernels
(cache write + attention for A active tokens of one layer) against their reference, on SmolLM2-135M
and Llama-3-8B attention shapes.
Each GPU time is ``triton.testing.do_bench``'s median (CUDA events, L2 flushed before each call),
set beside the shape's floor: its fewest bytes over the copy bandwidth and its FLOPs over the bf16
matrix rate, both measured first on the same GPU. Without CUDA the Triton side is skipped (the
interpreter that the tests use on CPU is a correctness tool, not a speed measure) and only the CPU
references are timed, on the embedded model's shapes, medians over ``--repeats`` runs after one
warm-up run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from vllm_selfspec.kernels.lm_head_argmax import (
    HAS_TRITON,
    lm_head_argmax_reference,
    lm_head_argmax_triton,
)
from vllm_selfspec.kernels.memory import MIB
from vllm_selfspec.kernels.paged_attention import (
    paged_attention_reference,
    paged_attention_triton,
    split_kv_cache,
)

# (name, shadow rows N, vocab V, hidden d)
SMOLLM2 = [
    ("SmolLM2-135M, 1 layer x (4+1)", 5, 49152, 576),
    ("SmolLM2-135M, 30 layers x (4+1)", 150, 49152, 576),
]
LLAMA3_8B = [
    ("Llama-3-8B, 1 layer x (8+1)", 9, 128256, 4096),
    ("Llama-3-8B, 32 layers x (8+1)", 288, 128256, 4096),
]


def median_seconds(fn, repeats: int, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_inputs(n: int, v: int, d: int, dtype: torch.dtype, device: str):
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, d, generator=g, device=device).to(dtype)
    weight = (torch.randn(v, d, generator=g, device=device) * d**-0.5).to(dtype)
    norm_weight = torch.ones(d, device=device, dtype=dtype)
    tokens = torch.randint(0, v, (n,), generator=g, device=device)
    return hidden, weight, dict(norm_weight=norm_weight, token_ids=tokens)


def gpu_ms(fn) -> float:
    """Median milliseconds of ``fn`` on the GPU: ``triton.testing.do_bench`` (CUDA events, the L2
    cache flushed before each call, 25 ms of warm-up and 100 ms of repeats)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def gpu_graph_ms(fn) -> float | None:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph
    (``triton.testing.do_bench_cudagraph``): the GPU's time without the Python and launch cost of
    each call; None where ``fn`` cannot be captured (it reads a tensor on the host)."""
    from triton.testing import do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception:  # a host read or synchronisation inside the capture
        torch.cuda.synchronize()
        return None


def gpu_ceilings() -> tuple[float, float]:
    """(bytes/s, bf16 FLOP/s) measured on this GPU: a 1 GiB device-to-device copy (bytes read plus
    written) and an 8192^3 bfloat16 matrix product, the floors' denominators (random data)."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = gpu_ms(lambda: dst.copy_(src))
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm_ms = gpu_ms(lambda: a @ b)
    return 2 * src.numel() * 4 / (copy_ms * 1e-3), 2 * 8192**3 / (mm_ms * 1e-3)


def _floor_ms(bytes_moved: float, flops: float, ceilings: tuple[float, float]) -> float:
    bandwidth, rate = ceilings
    return max(bytes_moved / bandwidth, flops / rate) * 1e3


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fmt_ms(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.3f}"


def _peak_extra_mib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MIB


def bench_gpu(ceilings: tuple[float, float], dtype: torch.dtype) -> None:
    print(f"device: {torch.cuda.get_device_name()}  ({_dtype_name(dtype)}, norm_weight, token_ids)")
    print(
        "floor: max(bytes of weight + rows + outputs / copy bandwidth, 2 N V d / bf16 matmul rate)"
    )
    print(
        "graph ms: one replay of the call captured in a CUDA graph, no Python or launch cost "
        "(L2 not flushed)"
    )
    print(
        f"{'shape':34} {'impl':10} {'median ms':>10} {'graph ms':>9} {'floor ms':>9} "
        f"{'x floor':>8} {'peak MiB':>9}"
    )
    for name, n, v, d in SMOLLM2 + LLAMA3_8B:
        hidden, weight, kwargs = make_inputs(n, v, d, dtype, "cuda")
        ref = lm_head_argmax_reference(hidden, weight, **kwargs)
        got = lm_head_argmax_triton(hidden, weight, **kwargs)
        agree = (got[0] == ref[0]).float().mean().item()
        floor = _floor_ms((v * d + n * d) * 2 + n * 16, 2 * n * v * d, ceilings)
        for impl_name, impl in (
            ("triton", lm_head_argmax_triton),
            ("reference", lm_head_argmax_reference),
        ):

            def run():
                return impl(hidden, weight, **kwargs)

            ms, graph = gpu_ms(run), gpu_graph_ms(run)
            peak = _peak_extra_mib(run)
            print(
                f"{name:34} {impl_name:10} {ms:10.3f} {_fmt_ms(graph):>9} {floor:9.3f} "
                f"{ms / floor:8.1f} {peak:9.1f}"
            )
        print(f"{'':34} argmax agreement triton vs reference: {agree:.4f}")


def bench_cpu(repeats: int) -> None:
    print(
        "lm_head_argmax triton: skip: no GPU (no CUDA device; the Triton kernel is only checked "
        "for correctness on CPU, in the interpreter)"
    )
    print(
        f"CPU reference only, {torch.get_num_threads()} threads (1-min load average "
        f"{os.getloadavg()[0]:.1f}), fused norm + token_ids, median of {repeats} runs"
    )
    print(f"{'shape':34} {'dtype':9} {'median ms':>10} {'float32 logits MiB':>19}")
    for name, n, v, d in SMOLLM2:
        for dtype in (torch.float32, torch.bfloat16):
            hidden, weight, kwargs = make_inputs(n, v, d, dtype, "cpu")
            seconds = median_seconds(
                lambda: lm_head_argmax_reference(hidden, weight, **kwargs), repeats
            )
            print(
                f"{name:34} {str(dtype).removeprefix('torch.'):9} {seconds * 1e3:10.1f} "
                f"{n * v * 4 / MIB:19.1f}"
            )


# (name, num_q_heads, num_kv_heads, head_size) of one attention layer; KV blocks of 16 tokens
ATTN_SMOLLM2 = ("SmolLM2-135M", 9, 3, 64)
ATTN_LLAMA3_8B = ("Llama-3-8B", 32, 8, 128)
BLOCK_SIZE = 16


def make_paged_inputs(num_tokens: int, context: int, heads: tuple, dtype: torch.dtype, device: str):
    """``num_tokens`` decode rows, each its own request at position ``context - 1``, over shuffled
    KV blocks (as a long-running server's block table looks), in FlashAttention's cache layout
    (the key and value views of one ``[..., 2 * head_size]`` cache)."""
    _, num_q_heads, num_kv_heads, head_size = heads
    g = torch.Generator(device="cpu").manual_seed(0)
    blocks_per_req = -(-context // BLOCK_SIZE)
    num_blocks = num_tokens * blocks_per_req
    block_table = torch.randperm(num_blocks, generator=g).view(num_tokens, blocks_per_req).int()
    positions = torch.full((num_tokens,), context - 1)
    req_indices = torch.arange(num_tokens)
    slots = (
        block_table.long()[req_indices, positions // BLOCK_SIZE] * BLOCK_SIZE
        + positions % BLOCK_SIZE
    )

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    query = randn(num_tokens, num_q_heads, head_size)
    key, value = (
        randn(num_tokens, num_kv_heads, head_size),
        randn(num_tokens, num_kv_heads, head_size),
    )
    kv_cache = randn(num_blocks, num_kv_heads, BLOCK_SIZE, 2 * head_size)
    kwargs = dict(
        slot_mapping=slots, block_table=block_table, req_indices=req_indices, positions=positions
    )
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    key_cache, value_cache = split_kv_cache(kv_cache, head_size)
    return (query, key, value, key_cache, value_cache), dict(kwargs, scale=head_size**-0.5)


def bench_paged_gpu(ceilings: tuple[float, float], dtype: torch.dtype) -> None:
    print(
        f"device: {torch.cuda.get_device_name()}  ({_dtype_name(dtype)}, cache write + attention, "
        f"block size {BLOCK_SIZE}; A tokens, each its own request)"
    )
    print("floor: bytes of the A contexts' K and V (read once) + q, k, v, out / copy bandwidth")
    print(
        "median ms: as the dispatcher calls it (its split decision reads positions.max() on the "
        "host); graph ms: one replay in a CUDA graph, max_context given (L2 not flushed)"
    )
    print(
        f"{'shape':40} {'impl':10} {'median ms':>10} {'graph ms':>9} {'floor ms':>9} "
        f"{'x floor':>8} {'peak MiB':>9}"
    )
    for heads in (ATTN_SMOLLM2, ATTN_LLAMA3_8B):
        _, num_q_heads, num_kv_heads, head_size = heads
        for num_tokens, context in ((1, 2048), (8, 2048), (64, 2048), (8, 16384)):
            args, kwargs = make_paged_inputs(num_tokens, context, heads, dtype, "cuda")
            ref = paged_attention_reference(*args, **kwargs)
            got = paged_attention_triton(*args, **kwargs)
            err = (got.float() - ref.float()).abs().max().item()
            name = f"{heads[0]}, A={num_tokens}, context {context}"
            kv_bytes = num_tokens * context * num_kv_heads * 2 * head_size * 2
            row_bytes = num_tokens * (2 * num_q_heads + 2 * num_kv_heads) * head_size * 2
            floor = _floor_ms(kv_bytes + row_bytes, 0.0, ceilings)
            for impl_name, impl in (
                ("triton", paged_attention_triton),
                ("reference", paged_attention_reference),
            ):

                def run():
                    return impl(*args, **kwargs)

                graph = None
                if impl is paged_attention_triton:
                    graph = gpu_graph_ms(lambda: impl(*args, **kwargs, max_context=context))
                ms = gpu_ms(run)
                peak = _peak_extra_mib(run)
                print(
                    f"{name:40} {impl_name:10} {ms:10.3f} {_fmt_ms(graph):>9} {floor:9.4f} "
                    f"{ms / floor:8.1f} {peak:9.1f}"
                )
            print(f"{'':40} max |triton - reference|: {err:.2e}")


def bench_paged_cpu(repeats: int) -> None:
    print(
        "paged_attention triton: skip: no GPU (no CUDA device; the Triton kernels are only checked "
        "for correctness on CPU, in the interpreter)"
    )
    print(
        f"CPU reference only, {torch.get_num_threads()} threads (1-min load average "
        f"{os.getloadavg()[0]:.1f}), cache write + attention, block size {BLOCK_SIZE}, "
        f"A tokens, each its own request, median of {repeats} runs"
    )
    print(f"{'shape':40} {'dtype':9} {'median ms':>10} {'gathered K/V MiB':>17}")
    _, _, num_kv_heads, head_size = ATTN_SMOLLM2
    for num_tokens, context in ((1, 512), (8, 512), (64, 512), (8, 2048)):
        for dtype in (torch.float32, torch.bfloat16):
            args, kwargs = make_paged_inputs(num_tokens, context, ATTN_SMOLLM2, dtype, "cpu")
            seconds = median_seconds(lambda: paged_attention_reference(*args, **kwargs), repeats)
            gathered = num_tokens * context * num_kv_heads * 2 * head_size * 4 / MIB  # float32 copy
            print(
                f"{ATTN_SMOLLM2[0] + f', A={num_tokens}, context {context}':40} "
                f"{str(dtype).removeprefix('torch.'):9} {seconds * 1e3:10.2f} {gathered:17.1f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="CPU references: runs to time")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16"),
        default="bfloat16",
        help="GPU: the inputs' dtype (the floors' matrix rate stays bf16's: the same on Hopper)",
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    gpu = torch.cuda.is_available() and HAS_TRITON
    if gpu:
        ceilings = gpu_ceilings()
        print(
            f"measured ceilings: copy {ceilings[0] / 1e12:.2f} TB/s (read + write), "
            f"bf16 matmul {ceilings[1] / 1e12:.0f} TFLOP/s"
        )
    print("== lm_head_argmax (batched shadow-token LM-head projection)")
    if gpu:
        bench_gpu(ceilings, dtype)
    else:
        bench_cpu(args.repeats)
    print(
        "\n== paged_attention (decode attention for a subset of the batch over the paged KV cache)"
    )
    if gpu:
        bench_paged_gpu(ceilings, dtype)
    else:
        bench_paged_cpu(args.repeats)


if __name__ == "__main__":
    main()

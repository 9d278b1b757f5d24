"""Benchmark the Triton kernels of ``vllm_selfspec.kernels`` against their PyTorch references.

    python benchmarks/kernels.py [--repeats 7]

With CUDA: times the Triton shadow-token LM-head kernel and the reference on GPU-shaped inputs
(bfloat16; SmolLM2-135M and Llama-3-8B LM heads, N = layers x (gamma + 1) shadow rows) and reports the
peak extra GPU memory of each. Without CUDA the Triton side is skipped (the interpreter that the tests
use on CPU is a correctness tool, not a speed measure) and only the CPU reference is timed, on the
embedded model's shapes. Times are medians over ``--repeats`` runs after one warm-up run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from vllm_selfspec.kernels.lm_head_argmax import (HAS_TRITON, lm_head_argmax_reference,
                                                  lm_head_argmax_triton)
from vllm_selfspec.kernels.memory import MIB

# (name, shadow rows N, vocab V, hidden d)
SMOLLM2 = [("SmolLM2-135M, 1 layer x (4+1)", 5, 49152, 576),
           ("SmolLM2-135M, 30 layers x (4+1)", 150, 49152, 576)]
LLAMA3_8B = [("Llama-3-8B, 1 layer x (8+1)", 9, 128256, 4096),
             ("Llama-3-8B, 32 layers x (8+1)", 288, 128256, 4096)]


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
    weight = (torch.randn(v, d, generator=g, device=device) * d ** -0.5).to(dtype)
    norm_weight = torch.ones(d, device=device, dtype=dtype)
    tokens = torch.randint(0, v, (n,), generator=g, device=device)
    return hidden, weight, dict(norm_weight=norm_weight, token_ids=tokens)


def bench_gpu(repeats: int) -> None:
    print(f"device: {torch.cuda.get_device_name()}  (bfloat16, fused norm, token_ids)")
    print(f"{'shape':34} {'impl':10} {'median ms':>10} {'peak extra MiB':>15}")
    for name, n, v, d in SMOLLM2 + LLAMA3_8B:
        hidden, weight, kwargs = make_inputs(n, v, d, torch.bfloat16, "cuda")
        ref = lm_head_argmax_reference(hidden, weight, **kwargs)
        got = lm_head_argmax_triton(hidden, weight, **kwargs)
        agree = (got[0] == ref[0]).float().mean().item()
        for impl_name, impl in (("triton", lm_head_argmax_triton), ("reference", lm_head_argmax_reference)):
            def run():
                return impl(hidden, weight, **kwargs)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            seconds = median_seconds(run, repeats, torch.cuda.synchronize)
            peak = (torch.cuda.max_memory_allocated() - base) / MIB
            print(f"{name:34} {impl_name:10} {seconds * 1e3:10.3f} {peak:15.1f}")
        print(f"{'':34} argmax agreement triton vs reference: {agree:.4f}")


def bench_cpu(repeats: int) -> None:
    print("lm_head_argmax triton: skip: no GPU (no CUDA device; the Triton kernel is only checked "
          "for correctness on CPU, in the interpreter)")
    print(f"CPU reference only, {torch.get_num_threads()} threads (1-min load average "
          f"{os.getloadavg()[0]:.1f}), fused norm + token_ids, median of {repeats} runs")
    print(f"{'shape':34} {'dtype':9} {'median ms':>10} {'float32 logits MiB':>19}")
    for name, n, v, d in SMOLLM2:
        for dtype in (torch.float32, torch.bfloat16):
            hidden, weight, kwargs = make_inputs(n, v, d, dtype, "cpu")
            seconds = median_seconds(lambda: lm_head_argmax_reference(hidden, weight, **kwargs), repeats)
            print(f"{name:34} {str(dtype).removeprefix('torch.'):9} {seconds * 1e3:10.1f} "
                  f"{n * v * 4 / MIB:19.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print("== lm_head_argmax (batched shadow-token LM-head projection)")
    if torch.cuda.is_available() and HAS_TRITON:
        bench_gpu(args.repeats)
    else:
        bench_cpu(args.repeats)


if __name__ == "__main__":
    main()

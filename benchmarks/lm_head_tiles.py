"""Tile sweep of the LM-head kernel (``triton_kernels/lm_head_argmax.py``) on a CUDA GPU.

For each model shape (rows x vocabulary x hidden, bfloat16, fused norm and token probabilities as
the shadow-token projection calls it) it times ``launch_config``'s plan, then alternatives to it
(rows per program, vocabulary and hidden tiles, warps, pipeline stages; the split-V rule kept),
each checked against the PyTorch reference's argmax, for at most ``--seconds`` per shape (the
configurations in a fixed shuffled order, so a short budget samples the whole space). It ends with
where an eager call's time goes (torch.profiler, CPU and CUDA), to separate host from GPU cost.

    python3 benchmarks/lm_head_tiles.py --seconds 40

Needs PyTorch and Triton on a CUDA machine (no vLLM); run from the repository root with
``benchmarks/kernels_gpu.sh``'s link in place, or after ``pip install -e .``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

import torch

#: (name, rows, vocabulary, hidden): shadow rows = layers x (drafts + 1)
SHAPES = [
    ("SmolLM2-135M, 1 x 5 rows", 5, 49152, 576),
    ("SmolLM2-135M, 8 x 5 rows", 40, 49152, 576),
    ("SmolLM2-135M, 30 x 5 rows", 150, 49152, 576),
    ("Llama-3-8B, 1 x 9 rows", 9, 128256, 4096),
    ("Llama-3-8B, 8 x 9 rows", 72, 128256, 4096),
    ("Llama-3-8B, 32 x 9 rows", 288, 128256, 4096),
]


def configs(rows: int) -> list[tuple[int, int, int, int, int]]:
    """(block_n, block_v, block_d, num_warps, num_stages) worth trying for ``rows`` rows."""
    block_ns = [n for n in (16, 32, 64, 128) if n < 2 * max(rows, 16)]
    grid = list(itertools.product(block_ns, [64, 128, 256], [64, 128], [4, 8], [2, 3, 4]))
    random.Random(0).shuffle(grid)
    return grid


def main() -> None:
    from triton.testing import do_bench, do_bench_cudagraph
    from vllm_selfspec.kernels import lm_head_argmax as lm

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="time budget per shape")
    args = ap.parse_args()
    print("device:", torch.cuda.get_device_name(), " torch", torch.__version__)
    default_plan = lm.launch_config
    for name, n, vocab, d in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(n, d, generator=g, device="cuda").bfloat16()
        weight = (torch.randn(vocab, d, generator=g, device="cuda") * d**-0.5).bfloat16()
        norm = torch.ones(d, device="cuda", dtype=torch.bfloat16)
        tok = torch.randint(0, vocab, (n,), generator=g, device="cuda")
        want = lm.lm_head_argmax_reference(hidden, weight, norm_weight=norm, token_ids=tok)[0]

        def call():
            return lm.lm_head_argmax_triton(hidden, weight, norm_weight=norm, token_ids=tok)

        base = default_plan(n, vocab, lm._target_programs(hidden.device))
        base_ms = do_bench(call, return_mode="median")
        graph = do_bench_cudagraph(call, return_mode="median")
        results, deadline = [], time.time() + args.seconds
        for bn, bv, bd, w, s in configs(n):
            if time.time() > deadline:
                break

            def plan(rows, v, target, bn=bn, bv=bv, bd=bd, w=w, s=s):
                splits = max(1, min(-(-target // -(-rows // bn)), -(-v // bv)))
                return lm.Tiles(bn, *lm._split_vocab(v, splits, bv), bv, bd, w, s)

            lm.launch_config = plan
            try:
                ok = torch.equal(call()[0], want)
                ms = do_bench(call, warmup=10, rep=40, return_mode="median")
                results.append((ms, bn, bv, bd, w, s, ok))
            except Exception as e:  # a tile that does not fit (shared memory): reported, skipped
                results.append((float("inf"), bn, bv, bd, w, s, type(e).__name__))
            finally:
                lm.launch_config = default_plan
        results.sort(key=lambda r: r[0])
        print(
            f"\n{name}: launch_config {tuple(base)} {base_ms:.3f} ms (graph {graph:.3f} ms); "
            f"{len(results)} of {len(configs(n))} alternatives tried"
        )
        for r in results[:5]:
            ms, bn, bv, bd, w, st, ok = r
            print(
                f"   {ms:.3f} ms  block_n {bn} block_v {bv} block_d {bd} warps {w} stages {st}"
                f"  ids equal {ok}"
            )
        bad = [r for r in results if r[6] is not True]
        if bad:
            print(f"   {len(bad)} alternatives failed or disagreed: {bad[:3]}")

    # where an eager call's time goes, on SmolLM2's 150 rows (host-bound: see the graph column)
    name, n, vocab, d = SHAPES[2]
    hidden = torch.randn(n, d, device="cuda").bfloat16()
    weight = (torch.randn(vocab, d, device="cuda") * d**-0.5).bfloat16()
    norm = torch.ones(d, device="cuda", dtype=torch.bfloat16)
    tok = torch.randint(0, vocab, (n,), device="cuda")
    for _ in range(20):
        lm.lm_head_argmax_triton(hidden, weight, norm_weight=norm, token_ids=tok)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(50):
            lm.lm_head_argmax_triton(hidden, weight, norm_weight=norm, token_ids=tok)
        torch.cuda.synchronize()
    print(f"\nprofile of 50 eager calls, {name}:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    t0 = time.perf_counter()
    for _ in range(200):
        lm.lm_head_argmax_triton(hidden, weight, norm_weight=norm, token_ids=tok)
    host = (time.perf_counter() - t0) / 200
    torch.cuda.synchronize()
    print(f"host time per call without synchronising: {host * 1e3:.3f} ms")


if __name__ == "__main__":
    main()

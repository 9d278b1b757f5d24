"""What one draft step's GEMMs cost on this CPU, per weight of the embedded model.

Times vLLM's own CPU GEMM (oneDNN with a prepacked weight, what every linear layer of the model
runs) and ``torch.nn.functional.linear`` for 1-16 rows, for each weight of one SmolLM2-135M decoder
layer, the full LM head (49,152 x 576) and reduced draft vocabularies. One thread, pinned like
vLLM's CPU worker. Medians of ``--repeats`` timings, milliseconds.

    python benchmarks/cpu_gemm.py [--rows 1,2,5,8,16] [--repeats 200]

A layer's weights (14 MB) stay in the CPU caches when timed alone; inside a forward the 30 layers
(424 MB) stream from memory, so the model's per-layer cost is higher than this table's. The LM
head (113 MB) streams from memory either way: it is the one GEMM that a smaller vocabulary cuts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# (in, out) of the embedded model's weights: hidden 576, 9 heads x 64, 3 KV heads, MLP 1536
SHAPES = {
    "qkv_proj": (576, 960),
    "o_proj": (576, 576),
    "gate_up_proj": (576, 3072),
    "down_proj": (1536, 576),
    "lm_head 49152": (576, 49152),
    "lm_head 16384": (576, 16384),
    "lm_head 8192": (576, 8192),
    "lm_head 4096": (576, 4096),
}


def timed(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,5,8,16")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    from vllm import _custom_ops as ops

    torch.set_num_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    print("| weight | " + " | ".join(f"{m} rows oneDNN / F.linear" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k)
        handle = ops.create_onednn_mm(w.t(), 32)
        reps = max(20, args.repeats // 10) if n > 10000 else args.repeats
        cells = []
        for m in rows:
            x = torch.randn(m, k)
            a = timed(lambda: ops.onednn_mm(handle, x, None), reps)
            b = timed(lambda: torch.nn.functional.linear(x, w), reps)
            cells.append(f"{a:.3f} / {b:.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

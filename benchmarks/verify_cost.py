"""What verifying a greedy batch's drafts costs: vLLM's rejection sampler against the one-argmax
path of ``vllm_selfspec/engine/greedy_verify.py``, on random logits of the embedded model's
vocabulary (49,152), one thread, as an engine's worker runs it. Each call gets a fresh copy of
the logits (the rejection sampler may write into them), made before the clock starts.

    python benchmarks/verify_cost.py [--vocab 49152] [--repeats 50]

Prints, per shape (requests x drafts each), the median milliseconds of a call of each and of
vLLM's plain sampler over one row per request (what a step without drafts pays).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def _median_ms(call, logits: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats + 3):
        x = logits.clone()
        t0 = time.perf_counter()
        call(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    # the builders of vLLM's verification inputs the tests use (tests/vllm_testing.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from vllm_selfspec.engine.greedy_verify import GreedyVerification
    from vllm_selfspec.engine.stats import EngineStats
    from vllm_testing import cpu_rejection_sampler, greedy_sampling_metadata, spec_decode_metadata

    vllm_rs = cpu_rejection_sampler()
    fast = GreedyVerification(vllm_rs, EngineStats())
    plain = vllm_rs.sampler
    print(f"{'requests x drafts':>18} {'plain':>7} {'vLLM':>7} {'one argmax':>10}  (ms, median)")
    for reqs, k in ((1, 1), (1, 6), (8, 1), (8, 4), (8, 6), (16, 4)):
        drafts = [[7] * k for _ in range(reqs)]
        md, meta = spec_decode_metadata(drafts), greedy_sampling_metadata(reqs)
        logits = torch.randn(reqs * (k + 1), args.vocab)
        rows = torch.randn(reqs, args.vocab)
        t_plain = _median_ms(lambda x: plain(x, meta), rows, args.repeats)
        t_vllm = _median_ms(lambda x: vllm_rs(md, None, x, meta), logits, args.repeats)
        t_fast = _median_ms(lambda x: fast(md, None, x, meta), logits, args.repeats)
        assert torch.equal(
            vllm_rs(md, None, logits.clone(), meta).sampled_token_ids,
            fast(md, None, logits.clone(), meta).sampled_token_ids,
        )
        print(f"{f'{reqs} x {k}':>18} {t_plain:7.2f} {t_vllm:7.2f} {t_fast:10.2f}")


if __name__ == "__main__":
    main()

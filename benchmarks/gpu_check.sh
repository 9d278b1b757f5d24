#!/usr/bin/env bash
# The first check on a CUDA machine with vLLM 0.32 and vllm-selfspec installed: greedy parity of
# every method with vanilla vLLM, the bench against vanilla, ngram and suffix at batch 1, 8 and 32,
# the Triton kernel tests compiled; one report, OUT/report.md. --cpu: the same, small, on the CPU.
#     bash benchmarks/gpu_check.sh MODEL [--cpu] [--out DIR] [--heads KIND=DIR ...]
# benchmarks/gpu_check.py does the work (its --help says what each check runs); PYTHON picks the
# interpreter (default python3).
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_check.py" "$@"

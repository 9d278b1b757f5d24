"""ModelInfo: what a policy, the config check and the engine know of the target model's shape.

A bottom-level module (no vLLM, no other module of the package): the policies take it, compat
builds it from a running engine's config, the benchmark from an HF checkpoint's config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelInfo:
    """What a policy may know about the target model."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    architecture: str
    #: the LM head's weight count in decoder layers (V·d / weights per layer): what reading the
    #: head costs a memory-bound step, in the unit of TPL's "loaded layers"
    lm_head_layers: float = 0.0
    #: the same for the draft's head (less with a reduced draft vocabulary); None: lm_head_layers
    draft_head_layers: float | None = None

    def check_built_for(self, base_model: dict[str, Any], what: str) -> None:
        """Raise ValueError unless ``base_model`` (the sizes a head set or a draft vocabulary
        records) are this model's; ``what`` begins the message, e.g. "the map in DIR was built"
        -> "the map in DIR was built for a model with vocab_size=10, this model has 20"."""
        for key in ("num_layers", "hidden_size", "vocab_size"):
            if base_model[key] != getattr(self, key):
                raise ValueError(
                    f"{what} for a model with {key}={base_model[key]}, "
                    f"this model has {getattr(self, key)}"
                )


def model_info_from_hf(text_config, config=None) -> ModelInfo:
    """ModelInfo from an HF config (``config`` holds ``architectures`` when it is not the text
    config itself, as for multimodal wrappers)."""
    archs = getattr(config or text_config, "architectures", None) or ["?"]
    return ModelInfo(
        num_layers=text_config.num_hidden_layers,
        hidden_size=text_config.hidden_size,
        vocab_size=text_config.vocab_size,
        architecture=archs[0],
        lm_head_layers=lm_head_layers(text_config),
    )


def lm_head_layers(hf_config) -> float:
    """LM-head weights / decoder-layer weights of a Llama-family config (0 for other layouts,
    which the config check refuses anyway)."""
    if not hasattr(hf_config, "intermediate_size"):
        return 0.0
    d = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or d // heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    attn = d * head_dim * (heads + 2 * kv) + heads * head_dim * d
    mlp = 3 * d * hf_config.intermediate_size
    return hf_config.vocab_size * d / (attn + mlp)

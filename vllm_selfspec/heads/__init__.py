"""Trained exit heads for self-speculative drafting: AdaDecode lightweight LM heads,
CascadeExit adapters + confidence estimators, and feature heads, which also read the final
layer's output at the verified position (docs/heads.md).

Engine use::

    from vllm_selfspec.heads import identity_from_tensors, load_heads
    expect = identity_from_tensors(architecture=..., num_layers=..., hidden_size=...,
                                   vocab_size=..., embed_weight=..., norm_weight=...)
    heads = load_heads(path, expect=expect)      # HeadsMismatchError for another model
    logits = lm_head(final_norm(heads[layer].transform(x)))   # x: pre-norm residual stream
    # cascade: heads[layer].confidence(x) >= heads[layer].threshold -> exit here
    # feature: heads[layer].transform(x, f, offset), f = the final layer's output offset back
"""

from .embedded import EMBEDDED_LAYERS, embedded_heads_dir
from .identity import (
    HeadsMismatchError,
    ModelIdentity,
    identity_from_hf,
    identity_from_tensors,
    weights_fingerprint,
)
from .io import HeadSet, HeadsFormatError, load_heads, save_heads
from .modules import (
    AdaDecodeHead,
    CascadeHead,
    FeatureHead,
    Readout,
    make_head,
    reference_logits,
)

__all__ = [
    "EMBEDDED_LAYERS",
    "embedded_heads_dir",
    "HeadsMismatchError",
    "ModelIdentity",
    "identity_from_hf",
    "identity_from_tensors",
    "weights_fingerprint",
    "HeadSet",
    "HeadsFormatError",
    "load_heads",
    "save_heads",
    "AdaDecodeHead",
    "CascadeHead",
    "FeatureHead",
    "Readout",
    "make_head",
    "reference_logits",
]

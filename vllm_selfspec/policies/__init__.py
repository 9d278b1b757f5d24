"""Policies: one file per method. Each is pure tensor logic: it never imports vLLM, reads no files."""

from __future__ import annotations

from ..model_info import ModelInfo
from .adadecode import AdaDecodePolicy
from .base import DraftDecision, Feedback, Policy
from .cascade import CascadePolicy
from .del_ import DELPolicy
from .feature import FeaturePolicy
from .knapspec import KnapSpecPolicy
from .layerskip import LayerSkipPolicy

#: method name -> policy class
POLICIES: dict[str, type[Policy]] = {
    LayerSkipPolicy.name: LayerSkipPolicy,
    DELPolicy.name: DELPolicy,
    KnapSpecPolicy.name: KnapSpecPolicy,
    CascadePolicy.name: CascadePolicy,
    AdaDecodePolicy.name: AdaDecodePolicy,
    FeaturePolicy.name: FeaturePolicy,
}

__all__ = [
    "POLICIES",
    "AdaDecodePolicy",
    "DraftDecision",
    "Feedback",
    "ModelInfo",
    "Policy",
    "CascadePolicy",
    "DELPolicy",
    "FeaturePolicy",
    "KnapSpecPolicy",
    "LayerSkipPolicy",
]

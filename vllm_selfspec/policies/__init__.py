"""Policies: one file per method. Each is pure tensor logic and never imports vLLM."""
from __future__ import annotations

from .base import DraftDecision, Feedback, ModelInfo, Policy
from .del_ import DELPolicy
from .knapspec import KnapSpecPolicy
from .layerskip import LayerSkipPolicy

#: method name -> policy class. Methods land here as their issues are resolved.
POLICIES: dict[str, type[Policy]] = {
    LayerSkipPolicy.name: LayerSkipPolicy,
    DELPolicy.name: DELPolicy,
    KnapSpecPolicy.name: KnapSpecPolicy,
}

__all__ = ["POLICIES", "DraftDecision", "Feedback", "ModelInfo", "Policy", "DELPolicy",
           "KnapSpecPolicy", "LayerSkipPolicy"]

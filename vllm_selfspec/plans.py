"""Layer plans: which sub-layers of the target model a draft step runs (pure data, no vLLM).

A plan covers the first ``exit_layer`` decoder layers of an ``num_layers``-layer model. For each
of them it says whether the attention sub-layer and the MLP sub-layer run. The draft exits after
layer ``exit_layer`` (1-based count: ``exit_layer == num_layers`` is the full model) and reads
logits from ``head``: ``"lm_head"`` is the model's own final norm + LM head; any other name is a
trained exit head supplied by the engine.

* early exit (LayerSkip, DEL, Cascade): ``LayerPlan.prefix(L, E)``
* sub-layer skipping (KnapSpec):        ``LayerPlan.skip(L, skip_attn=..., skip_mlp=...)``
* the correctness canary:               ``LayerPlan.full(L)``
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

LM_HEAD = "lm_head"


@dataclass(frozen=True)
class LayerPlan:
    num_layers: int
    exit_layer: int
    attn: tuple[bool, ...]
    mlp: tuple[bool, ...]
    head: str = LM_HEAD

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not 0 <= self.exit_layer <= self.num_layers:
            raise ValueError(f"exit_layer must be in [0, {self.num_layers}], got {self.exit_layer}")
        if len(self.attn) != self.exit_layer or len(self.mlp) != self.exit_layer:
            raise ValueError("attn/mlp flags must have one entry per layer up to exit_layer")

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def prefix(cls, num_layers: int, exit_layer: int, head: str = LM_HEAD) -> LayerPlan:
        return cls(num_layers, exit_layer, (True,) * exit_layer, (True,) * exit_layer, head)

    @classmethod
    def full(cls, num_layers: int) -> LayerPlan:
        return cls.prefix(num_layers, num_layers)

    @classmethod
    def skip(
        cls,
        num_layers: int,
        skip_attn: Iterable[int] = (),
        skip_mlp: Iterable[int] = (),
        exit_layer: int | None = None,
        head: str = LM_HEAD,
    ) -> LayerPlan:
        exit_layer = num_layers if exit_layer is None else exit_layer
        sa, sm = set(skip_attn), set(skip_mlp)
        for name, s in (("skip_attn", sa), ("skip_mlp", sm)):
            bad = sorted(i for i in s if not 0 <= i < num_layers)
            if bad:
                raise ValueError(f"{name} has layer indices outside [0, {num_layers}): {bad}")
        return cls(
            num_layers,
            exit_layer,
            tuple(i not in sa for i in range(exit_layer)),
            tuple(i not in sm for i in range(exit_layer)),
            head,
        )

    # ---- derived ------------------------------------------------------------------------------
    @property
    def is_full(self) -> bool:
        return (
            self.exit_layer == self.num_layers
            and all(self.attn)
            and all(self.mlp)
            and self.head == LM_HEAD
        )

    @property
    def num_sublayers(self) -> int:
        return sum(self.attn) + sum(self.mlp)

    @property
    def layer_cost(self) -> float:
        """Decoder layers this plan executes (a sub-layer counts as half a layer)."""
        return self.num_sublayers / 2

    def attn_layers(self) -> list[int]:
        """0-based indices of the layers whose attention runs (and so reads/writes KV)."""
        return [i for i, a in enumerate(self.attn) if a]

    def describe(self) -> str:
        if all(self.attn) and all(self.mlp):
            s = f"exit@{self.exit_layer}/{self.num_layers}"
        else:
            sa = [i for i, a in enumerate(self.attn) if not a]
            sm = [i for i, m in enumerate(self.mlp) if not m]
            s = f"exit@{self.exit_layer}/{self.num_layers} skip_attn={sa} skip_mlp={sm}"
        return s if self.head == LM_HEAD else f"{s} head={self.head}"

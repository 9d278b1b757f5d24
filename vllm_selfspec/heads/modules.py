"""Exit-head modules and the frozen read-out they feed.

Engine interface (fixed): an exit head for layer ``l`` is an ``nn.Module`` with
``transform(x) -> x'`` on the PRE-norm residual stream ``x`` [N, d] after ``l`` decoder layers.
The engine then applies the model's OWN final RMSNorm and LM head (vLLM's, so tensor parallelism
works); heads therefore never hold norm or LM-head weights. Cascade heads add
``confidence(x) -> [N]`` in [0, 1] on the same ``x`` and a float ``threshold``.

The PyTorch reference forward (training, evaluation) is ``Readout(model).logits(head.transform(x))``
= ``lm_head(final_norm(head.transform(x)))`` on the HF model's frozen modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("adadecode", "cascade", "feature")
#: feature heads: the largest offset (draft position in a round) they are trained for
FEATURE_MAX_OFFSET = 4


class AdaDecodeHead(nn.Module):
    """AdaDecode's lightweight LM head (§2.1): a d×d matrix ``T`` in front of the frozen final
    norm + LM head, identity-initialised (so an untrained head is the raw LM head).

    Orientation: row vectors, ``transform(x) = x @ T`` (``T[i, j]`` maps input feature i to
    output feature j). The paper's logits ``h (E* T_i)ᵀ = h T_iᵀ E*ᵀ`` make our ``T`` its
    ``T_iᵀ``; and the paper's ``h`` is post-norm, while we put ``T`` before the final norm
    because the engine's exit interface transforms the pre-norm stream."""

    kind = "adadecode"

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.T = nn.Parameter(torch.eye(hidden_size))

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.T


class CascadeHead(nn.Module):
    """CascadeExit's exit adapter + confidence estimator (§3.1).

    * ``transform(h) = h + Up(SiLU(Gate(h)) ⊙ Down(h))`` (bias-free SwiGLU bottleneck; ``Up`` is
      zero-initialised so an untrained adapter is the identity, i.e. the raw LM head);
    * ``confidence(h) = σ(MLP(z))``, MLP d → 256 → 1 with SiLU, probability that this exit's
      top-1 equals the final layer's. ``z`` is ``h`` RMS-normalised (no weights) and standardised
      with per-feature statistics of the estimator's training data (buffers): the raw stream's
      scale varies widely across positions (docs/heads.md, "Engine interface"), which a small MLP
      with a short schedule copes badly with.
    * ``threshold``: exit when ``confidence >= threshold`` (chosen by F1 on a held-out split).
    """

    kind = "cascade"

    def __init__(self, hidden_size: int, bottleneck: int, estimator_hidden: int = 256) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, bottleneck, bias=False)
        self.down = nn.Linear(hidden_size, bottleneck, bias=False)
        self.up = nn.Linear(bottleneck, hidden_size, bias=False)
        nn.init.zeros_(self.up.weight)
        self.estimator = nn.Sequential(
            nn.Linear(hidden_size, estimator_hidden), nn.SiLU(), nn.Linear(estimator_hidden, 1)
        )
        self.register_buffer("feature_mean", torch.zeros(hidden_size))
        self.register_buffer("feature_std", torch.ones(hidden_size))
        self.threshold: float = 0.5

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(F.silu(self.gate(x)) * self.down(x))

    @staticmethod
    def _rms_normalise(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The estimator's input: RMS-normalised, then standardised ``x``."""
        return (self._rms_normalise(x) - self.feature_mean) / self.feature_std

    @torch.no_grad()
    def fit_feature_stats(self, x: torch.Tensor) -> None:
        """Set the standardisation buffers from the estimator's training inputs ``x``."""
        z = self._rms_normalise(x)
        self.feature_mean.copy_(z.mean(0))
        self.feature_std.copy_(z.std(0).clamp(min=1e-4))

    def confidence_logit(self, x: torch.Tensor) -> torch.Tensor:
        return self.estimator(self.features(x)).squeeze(-1)

    def confidence(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.confidence_logit(x))


class FeatureHead(nn.Module):
    """An exit that also reads the final layer: the input of Hydra's and EAGLE's draft heads on
    a shallow exit (docs/heads.md, "Feature heads"). Its ``transform`` takes two more inputs
    than the other kinds, so the engine's exit interface above does not apply to it.

    ``transform(x, f, offset) = x + Up(SiLU(Gate(u)) ⊙ Down(u))``, ``u = [rmsnorm(x); f] + E[offset]``:

    * ``x`` [N, d]: the pre-norm stream of the token at position t after ``layer`` layers (layer
      0: the token's embedding, so a draft runs no decoder layer at all);
    * ``f`` [N, d]: the final layer's normed output at position t - offset (HF's last hidden
      state, what the LM head reads), which the target's last verification computed: offset 1
      for a round's first draft token, j for its j-th (zeros where the sequence has none);
    * ``offset`` [N] int64 in 1..max_offset; ``E`` a learned vector per offset.

    ``Up`` and ``E`` start at zero, so an untrained head is the raw LM head on ``x``. The caller
    then applies the model's own final norm and LM head, as for every kind."""

    kind = "feature"

    def __init__(self, hidden_size: int, bottleneck: int, max_offset: int) -> None:
        super().__init__()
        self.gate = nn.Linear(2 * hidden_size, bottleneck, bias=False)
        self.down = nn.Linear(2 * hidden_size, bottleneck, bias=False)
        self.up = nn.Linear(bottleneck, hidden_size, bias=False)
        self.offset = nn.Embedding(max_offset + 1, 2 * hidden_size)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.offset.weight)

    @property
    def max_offset(self) -> int:
        return self.offset.num_embeddings - 1

    def transform(self, x: torch.Tensor, f: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        u = torch.cat((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), f), -1)
        u = u + self.offset(offset)
        return x + self.up(F.silu(self.gate(u)) * self.down(u))


def make_head(
    kind: str, hidden_size: int, bottleneck: int | None = None, max_offset: int | None = None
) -> nn.Module:
    """A fresh (untrained) head; ``bottleneck`` (cascade, feature) defaults to min(512, d),
    ``max_offset`` (feature) to FEATURE_MAX_OFFSET."""
    if kind == "adadecode":
        return AdaDecodeHead(hidden_size)
    if kind == "cascade":
        return CascadeHead(hidden_size, bottleneck or min(512, hidden_size))
    if kind == "feature":
        return FeatureHead(
            hidden_size, bottleneck or min(512, hidden_size), max_offset or FEATURE_MAX_OFFSET
        )
    raise ValueError(f"unknown head kind {kind!r}; expected one of {KINDS}")


class Readout:
    """The HF model's frozen final norm + LM head (what the engine applies after a head).

    ``logits(x)`` is the exact float32 reference. ``logits(x, fast=True)`` runs the big
    [N, d] × [d, V] product in bfloat16 (faster on CPUs with AVX512-BF16/AMX: docs/heads.md,
    "Training"); training uses it for speed, while every reported number and every label uses the
    exact path."""

    def __init__(self, model) -> None:
        self.norm = model.model.norm
        self.lm_head = model.get_output_embeddings()
        if getattr(self.lm_head, "bias", None) is not None:
            raise ValueError("LM heads with a bias are not supported")
        for p in (*self.norm.parameters(), *self.lm_head.parameters()):
            p.requires_grad_(False)
        self._weight_bf16: torch.Tensor | None = None

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def logits(self, x: torch.Tensor, fast: bool = False) -> torch.Tensor:
        h = self.norm(x)
        if not fast:
            return self.lm_head(h)
        if self._weight_bf16 is None:
            self._weight_bf16 = self.lm_head.weight.detach().to(torch.bfloat16)
        return F.linear(h.to(torch.bfloat16), self._weight_bf16).float()


def reference_logits(head: nn.Module, x: torch.Tensor, readout: Readout) -> torch.Tensor:
    """``lm_head(final_norm(head.transform(x)))``: what the engine computes, in float32."""
    return readout.logits(head.transform(x))

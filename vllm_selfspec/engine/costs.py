"""Measured step costs for time-based policies (tokens per *second* instead of per layer).

The engine times, on the device it runs on and at the load it sees:

* every draft step: seconds against the layers it ran (``plan.layer_cost``);
* every verification step: seconds against the tokens per request it verified.

Each is an online least-squares line with exponential forgetting, so the costs follow the batch
size and the context length as they drift. Until a line has seen two distinct x values, its
prediction is None and policies fall back to their layer-count model.

Under tensor parallelism every rank measures its own times, so decisions built on them would
differ between ranks; the engine broadcasts rank 0's ``state()`` before each round.
"""
from __future__ import annotations


class LinearFit:
    """y ≈ a + b·x, fitted online with forgetting factor ``decay`` per sample."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n = d * self.n + 1.0
        self.sx = d * self.sx + x
        self.sy = d * self.sy + y
        self.sxx = d * self.sxx + x * x
        self.sxy = d * self.sxy + x * y

    def coefficients(self) -> tuple[float, float] | None:
        var = self.n * self.sxx - self.sx * self.sx
        if var <= 1e-9 * max(1.0, self.n * self.sxx):
            return None  # one distinct x seen so far: no slope yet
        b = (self.n * self.sxy - self.sx * self.sy) / var
        a = (self.sy - b * self.sx) / self.n
        return a, b

    def predict(self, x: float) -> float | None:
        c = self.coefficients()
        return None if c is None else max(0.0, c[0] + c[1] * x)


class StepCosts:
    """Seconds of a draft step through ``layers`` layers and of a verification of ``tokens``
    tokens per request, as measured by the engine."""

    def __init__(self) -> None:
        self.draft = LinearFit()
        self.verify = LinearFit()
        self._frozen: tuple | None = None  # rank 0's coefficients under TP

    def state(self) -> tuple:
        return (self.draft.coefficients(), self.verify.coefficients())

    def freeze(self, state: tuple | None) -> None:
        """Use these coefficients (rank 0's, broadcast) instead of this rank's own."""
        self._frozen = state

    def _coef(self, which: int, fit: LinearFit):
        return self._frozen[which] if self._frozen is not None else fit.coefficients()

    def draft_seconds(self, layers: float) -> float | None:
        c = self._coef(0, self.draft)
        return None if c is None else max(0.0, c[0] + c[1] * layers)

    def verify_seconds(self, tokens: float) -> float | None:
        c = self._coef(1, self.verify)
        return None if c is None else max(1e-9, c[0] + c[1] * tokens)

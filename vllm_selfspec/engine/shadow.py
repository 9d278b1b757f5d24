"""Shadow tokens: captured residual-stream rows projected through an exit head, batched.

For every (capture layer, row) the greedy token and its probability. With the model's own LM head
and one TP rank, all layers go through one call of the fused LM-head argmax kernel
(``vllm_selfspec.kernels.lm_head_argmax``: Triton on CUDA, its PyTorch reference on CPU), which
never materialises the [rows, vocab] logits on GPU. Trained heads, a vocabulary sharded over TP
ranks, or logits that vLLM scales or soft-caps (Gemma 2) take vLLM's own final norm +
``compute_logits`` path (which all-gathers the logits).
With a reduced draft vocabulary (``draft_vocab_size``) shadow tokens read the same N tokens the
draft does, so the statistics describe the draft that will actually run.
"""

from __future__ import annotations

import torch

from ..kernels.lm_head_argmax import lm_head_argmax
from ..plans import LM_HEAD
from .executor import PlanExecutor

#: rows projected at once (per layer, ``n_layers`` x this in the fused kernel): bounds the
#: logits a projection holds to [CHUNK_ROWS, vocab] float32 (128 MiB at a 128k vocabulary)
CHUNK_ROWS = 256


class ShadowProjector:
    def __init__(self, executor: PlanExecutor, vocab_size: int, tp_size: int) -> None:
        self.executor = executor
        self.vocab_size = vocab_size
        self.fused = tp_size == 1

    @torch.inference_mode()
    def project(self, hidden: torch.Tensor, heads: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [n_layers, rows, d] (pre-norm stream), heads[j] for layer j ->
        (tokens [n_layers, rows] int64, probs [n_layers, rows] float32), both on the CPU.
        Projected ``CHUNK_ROWS`` rows at a time: the logits of one chunk, [CHUNK_ROWS, vocab]
        float32, are the most it holds at once, whatever the batch and ``capture_tokens``."""
        rows = hidden.shape[1]
        if rows <= CHUNK_ROWS:
            return self._project(hidden, heads)
        parts = [
            self._project(hidden[:, i : i + CHUNK_ROWS], heads) for i in range(0, rows, CHUNK_ROWS)
        ]
        return torch.cat([t for t, _ in parts], 1), torch.cat([p for _, p in parts], 1)

    def _project(self, hidden: torch.Tensor, heads: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        n, rows, d = hidden.shape
        ex = self.executor
        lay = ex.layout
        plain_head = lay.logit_soft_cap is None and lay.logit_scale == 1.0
        if self.fused and plain_head and all(h == LM_HEAD for h in heads):
            weight = (
                ex.vocab_weight
                if ex.vocab_ids is not None
                else lay.model.lm_head.weight[: self.vocab_size]
            )
            ids, prob, _ = lm_head_argmax(
                hidden.reshape(n * rows, d),
                weight,
                norm_weight=lay.final_norm_scale(),
                eps=lay.norm.variance_epsilon,
            )
            tokens, probs = ids.view(n, rows), prob.view(n, rows).float()
        else:
            tokens, probs = [], []
            for j, name in enumerate(heads):
                x = hidden[j]
                if name != LM_HEAD:
                    x = ex.heads[name].transform(x)
                logits = ex.project(lay.norm(x)).float()
                p, t = torch.softmax(logits, dim=-1).max(dim=-1)
                tokens.append(t)
                probs.append(p)
            tokens, probs = torch.stack(tokens), torch.stack(probs)
        if ex.vocab_ids is not None:  # draft-vocabulary columns -> token ids
            tokens = ex.vocab_ids[tokens]
        return tokens.cpu(), probs.cpu()

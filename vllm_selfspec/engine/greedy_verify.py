"""Greedy verification without the rejection sampler's copies of the logits.

vLLM's rejection sampler, given the logits rows of a verifying step (each request's draft
positions, then its bonus position), gathers the bonus rows into a new tensor and samples them,
gathers the draft rows into another, clones that one for its logits processors, takes a
``torch.argmax`` over it and runs its greedy acceptance kernel. When every request is greedy and
nothing can move an argmax (``compat.argmax_is_plain``: no penalties, bad words, allowed-token
mask, active min_tokens / logit_bias, logprobs, thinking budget), all of that is one argmax
per row. This wrapper takes that path: vLLM's own greedy argmax (on CPU its C++ op, ~3x faster
than ``torch.argmax``) once over all rows, then vLLM's own acceptance kernel on the draft rows'
argmax and the bonus rows'. Any other batch goes to vLLM's sampler unchanged.

Same tokens as vLLM's path: an argmax does not depend on which tensor holds the row, and both
paths take the first index of the maximum (on CPU vLLM's own bonus row already uses the C++ op).

Worked example, two requests (4 drafts in all, so 6 logits rows; argmax of each row below)::

    request            A: drafts [5, 7, 9]        B: drafts [4]
    rows' argmax       [5, 7, 2, 8 | 4, 6]        (A's three draft rows, A's bonus; B's, B's bonus)
    A: 5 == 5, 7 == 7, 9 != 2  -> [5, 7, 2, -1]   (two accepted, the target's 2, placeholder)
    B: 4 == 4, bonus 6         -> [4, 6, -1, -1]

On this CPU, 8 requests with 4 drafts each (40 rows of a 49k vocabulary): 4.1 ms in vLLM's path,
1.2 ms in this one; with 6 drafts each 8.6 against 1.3 ms (``benchmarks/verify_cost.py``;
docs/architecture.md, "One decode step").
"""

from __future__ import annotations

import torch

from .. import compat


class GreedyVerification:
    """Wraps ``runner.rejection_sampler`` (called as vLLM's runner calls it); ``stats`` counts
    the steps verified here (``greedy_verifications``) and by vLLM's sampler
    (``sampled_verifications``)."""

    def __init__(self, sampler, stats) -> None:
        self.sampler = sampler
        self.stats = stats
        self._argmax, self._accept, self._placeholder, self._output = (
            compat.greedy_verification_internals()
        )

    def __call__(self, metadata, draft_probs, logits, sampling_metadata):
        if not compat.argmax_is_plain(sampling_metadata, self.sampler):
            self.stats.sampled_verifications += 1
            return self.sampler(metadata, draft_probs, logits, sampling_metadata)
        self.stats.greedy_verifications += 1
        return self._output(sampled_token_ids=self.verify(metadata, logits), logprobs_tensors=None)

    def verify(self, metadata, logits: torch.Tensor) -> torch.Tensor:
        """[requests, max drafts + 1] int32: each request's accepted drafts, then the target's
        token (at the first rejected draft, else the bonus position's), then placeholders."""
        rows = self._argmax(logits if logits.dtype == torch.float32 else logits.float())
        target_argmax = rows[metadata.target_logits_indices]
        bonus = rows[metadata.bonus_logits_indices].to(torch.int32).unsqueeze(-1)
        out = torch.full(
            (len(metadata.num_draft_tokens), metadata.max_spec_len + 1),
            self._placeholder,
            dtype=torch.int32,
            device=logits.device,
        )
        self._accept(
            out,
            metadata.cu_num_draft_tokens,
            metadata.draft_token_ids,
            target_argmax,
            bonus,
            None,  # is_greedy: all are
            metadata.max_spec_len,
            None,  # uniform_probs: not synthetic
            None,
        )
        return out

    def __getattr__(self, name):  # everything else is the wrapped sampler's
        return getattr(self.sampler, name)

"""The goodput controller: how many tokens each request of the batch drafts this step.

Pure logic (numpy, no vLLM), unit-tested on synthetic costs in ``tests/unit/test_goodput.py``.
The engine (``engine/proposer.py``) feeds it measured seconds and verification outcomes; each
policy still decides *how* a request drafts (exit layer, skip set, walk); this package decides
*how much*, for the whole batch at once, so that the batch's expected emitted tokens per second
is as high as it can be — and never, as measured, below plain decoding's.

Its parts, one module each:

* ``costs.StepCostModel`` — seconds of a target forward as a plane in the step's requests and the
  draft tokens it verifies (plain decode steps included: no drafts), plus what a step pays once
  for verifying any, and of one draft step as ``d0 + d1·layers + d2·layers·rows``; both
  measured online with forgetting, steps with one-time costs left out. The slopes are
  bounded below (a noisy fit must not make verification free) and, until the data can tell
  them, taken as conservative priors. Verification is also priced per step shape (requests,
  draft tokens) where shapes were measured: a forward's time is not a line in its tokens.
* ``acceptance.AcceptanceTracker`` — per request and draft position j, P(draft j accepted |
  drafts 1..j-1 accepted), decayed, shrunk towards the same figure over all requests (the prior
  of a new one); for context-lookup drafts (``lookup.py``) the same per slot (``lookup.slot``).
* ``choice`` — what the controller chooses among (``Candidate``, one per request: a self-draft
  or a free lookup draft, ``prefer_free``) and what it chooses (``Choice``);
* ``controller.GoodputController.choose`` — the draft length of every request together (0
  allowed), from ``search``'s best set of draft tokens for each number of draft steps; and
  ``look_due``, whether this step's choice is worth its own cost at all (after a choice that
  drafted nothing, one is skipped while choices save less than the proposer takes to make
  them);
* ``safety`` — the safety net (``SafetyNet``, ``PlainReference``) and ``SearchBudget``, the share
  of time that costly feedback (a plan search, shadow projections) may take.

Worked example (one step, batch of 2, round costs of the order docs/performance.md, "Step
costs", reports for the CPU)::

    target forward V(R, D) = 70 ms + 7 ms · R + 7 ms · D   (R = 2 requests, D = their drafts;
                                                            no fixed cost of verifying here)
    draft step         = 5 ms fixed + 4 ms per drafting row
    request a: P(first j drafts accepted) = 0.9, 0.8, 0.7      (a code request)
    request b: P = 0.3, 0.1, 0.03                              (a chat request)

    no drafts:            2 tokens / 84 ms                          = 23.8 tokens/s
    a drafts 1:           2.9 / (84 + 7 + 5 + 4)                    = 29.0
    a drafts 3:           (2 + 2.4) / (84 + 21 + 3·(5 + 4))         = 33.0   <- chosen
    a 3 and b 1:          (2 + 2.4 + 0.3) / (84 + 28 + 3·5 + 4·4)   = 32.9

so request a drafts three tokens and request b none; at batch 16 the same request a would draft
less, because its drafts then lengthen a step that already yields 16 tokens. A request whose
drafts keep failing drafts nothing; every ``probe_every`` steps (doubling while probes fail, no
rarer than a cheap drafter can afford) one such request drafts again, a few tokens, so its
estimate can recover (self-drafts and lookup drafts each on their own clock).

The safety net compares what speculation *achieved* with plain decoding at the same batch size,
both in wall-clock seconds of whole engine cycles (one proposer call to the next: the drafting,
the scheduler, the verifying forward, the rejection sampler and vLLM's bookkeeping, all in):
each speculative cycle's emitted tokens per second over a plain cycle's at its batch size, the
fitted ``B / V(B, 0)`` corrected by what plain cycles measured beyond it (``PlainReference``;
without plain cycles in the last ``plain_every`` steps, the controller runs one). While that
ratio's running mean is below 1 the controller drafts nothing but probes, so a wrong cost or
acceptance estimate, or a cost the model does not see, costs a few steps, not a run.
"""

from .acceptance import AcceptanceTracker
from .choice import Candidate, Choice, prefer_free
from .controller import GoodputController
from .costs import OnlineFit, StepCostModel
from .safety import PlainReference, SafetyNet, SearchBudget

__all__ = [
    "AcceptanceTracker",
    "Candidate",
    "Choice",
    "GoodputController",
    "OnlineFit",
    "PlainReference",
    "SafetyNet",
    "SearchBudget",
    "StepCostModel",
    "prefer_free",
]

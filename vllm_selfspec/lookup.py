"""Context lookup: free drafts from what a request has already seen (no vLLM, no torch).

Prompt lookup (vLLM's ``ngram``) copies the tokens that followed the last occurrence of the
request's last n tokens. This module drafts as SuffixDecoding does (vLLM's ``suffix`` method),
on the same suffix trees: ArcticInference's ``SuffixTree`` (C++, ``arctic_inference``'s
``suffix_decoding`` module, which ``make`` builds from its PyPI sdist: ``scripts/``).

* A suffix tree of a token sequence holds every substring of it up to ``max_depth`` tokens,
  with how often each occurred. ``speculate`` matches the end of the context in the tree and
  walks down its most frequent continuation: each draft token carries the tree's estimate of
  the probability that the draft is right up to it (counts along the path). The walk stops
  where that estimate falls below ``min_token_prob`` (a rare branch is not drafted) or past
  ``max_spec_factor`` times the match's length (a short match drafts little): the draft
  length follows the match. The factor's part past 1 shrinks as the step's requests grow
  (``_Drafting.factor_for``).
* A request's own tree (``ContextIndex``) holds its prompt's last ``window`` tokens and all of
  its output, updated as tokens arrive; a long prompt is indexed from its end back, at most
  ``budget`` tokens per engine step, so that admitting it does not stall the batch.
* ``SharedIndex`` holds, per *tenant*, the outputs of its recently finished requests (bounded:
  the oldest go first), and, pinned, a *datastore*: the model's own greedy generations on an
  offline corpus (the draft-vocabulary map's, ``vocab.py``), so a request has the model's
  habitual phrasing to draft from before any other request has finished. A request drafts from
  its own tree, its tenant's outputs and the datastore: the draft with the highest expected
  number of accepted tokens (the sum of its estimates) wins, its own on ties.
* Each draft token carries its *slot* (``slot``): where it came from (own context, shared),
  its match's length and its estimate, in buckets. The engine measures acceptance per slot
  (``goodput.AcceptanceTracker``), so the goodput controller prices a draft by what such
  drafts achieved on this model, and decides how many of its tokens to verify.

Worked example (``max_depth=8``, factor 1, minimum estimate 0.1)::

    tokens:  a b c d a b c e a b
    propose(4): the end "a b" (match 2) occurred three times, the last one the end itself:
        twice followed by "c", then by "d" once and "e" once: the draft is "c" (estimate
        2/3), then "d" (1/3); 2 tokens at most (factor 1 x match 2)  =>  [c, d], estimates
        [0.67, 0.33]
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Sequence

#: lookup options of the config (``"lookup": true`` takes these; a dict overrides them), with
#: SuffixDecoding's (and vLLM's ``suffix`` method's) defaults for the tree, but twice its draft
#: length: there every drafted token is verified, so a draft stops at the match's length; here
#: the goodput controller verifies only the tokens whose slot's measured acceptance pays for
#: their measured cost, so the tree offers more and the costs decide (``goodput`` false
#: verifies every drafted token: set 1.0 there):
#: ``max_depth``: the longest match (and context suffix) the trees hold;
#: ``max_spec_factor``: a match of n tokens drafts at most ``max_spec_factor * n`` tokens for a
#: request alone (less in a fuller batch: ``_Drafting.factor_for``);
#: ``min_token_prob``: the walk stops where the tree's estimate falls below it;
#: ``shared``: whose finished outputs a request drafts from besides its own context and the
#: datastore: "tenant" (its tenant's: ``request_tenant``), "global" (every request's) or "off";
#: ``datastore``: "auto" (the model's cached corpus generations, none if it has no map), null
#: (none) or a draft-vocabulary directory built with ``vllm-selfspec build-vocab``
DEFAULTS = {
    "max_depth": 24,
    "max_spec_factor": 2.0,
    "min_token_prob": 0.1,
    "shared": "tenant",
    "datastore": "auto",
}
SHARING = ("tenant", "global", "off")

#: the most recent prompt tokens a request's tree holds (its output is held whole)
INDEX_WINDOW = 16384
#: the most prompt tokens indexed in one engine step: a long prompt is indexed from its end back
INDEX_BUDGET = 2048

#: slot buckets: a draft token's match length (1, 2-3, 4-7, 8-15, 16+) and its conditional
#: estimate (its path estimate over its predecessor's: < 0.5, < 0.9, >= 0.9), per source
MATCH_BUCKETS = 5
ESTIMATE_BUCKETS = (0.5, 0.9)
SOURCE_SLOTS = MATCH_BUCKETS * (len(ESTIMATE_BUCKETS) + 1)
#: slots in all: the request's own context first, then the shared index (``is_shared``)
SLOTS = 2 * SOURCE_SLOTS


def suffix_tree_class():
    """ArcticInference's ``SuffixTree``, or an ImportError that says how to get it."""
    try:
        from arctic_inference.suffix_decoding._C import SuffixTree
    except ImportError as e:
        raise ImportError(
            "context lookup needs ArcticInference's suffix trees (module "
            "arctic_inference.suffix_decoding): `make` installs it, or run "
            "`bash scripts/install_suffix_decoding.sh .venv/bin/python`"
        ) from e
    return SuffixTree


def check_options(options) -> dict:
    """The config's ``lookup`` value as options, or a ValueError (None: lookup off)."""
    if options is None or options is False:
        return {}
    if options is True:
        return dict(DEFAULTS)
    if not isinstance(options, dict):
        raise ValueError(
            f"lookup must be true, false or an object with {sorted(DEFAULTS)}, got {options!r}"
        )
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown lookup option(s) {unknown}; allowed: {sorted(DEFAULTS)}")
    merged = {**DEFAULTS, **options}
    shared = merged["shared"]
    if isinstance(shared, bool):  # true: the default sharing, false: none
        merged["shared"] = DEFAULTS["shared"] if shared else "off"
    elif shared not in SHARING:
        raise ValueError(
            f"lookup: shared must be one of {', '.join(map(repr, SHARING))} (or true / false), "
            f"got {shared!r}"
        )
    store = merged["datastore"]
    if store is not None and not (isinstance(store, str) and store):
        raise ValueError(
            f'lookup: datastore must be "auto", null or a draft-vocabulary directory, got {store!r}'
        )
    depth = merged["max_depth"]
    if not (isinstance(depth, int) and not isinstance(depth, bool) and 2 <= depth <= 256):
        raise ValueError(f"lookup: max_depth must be an integer in [2, 256], got {depth!r}")
    for key, lo, hi in (("max_spec_factor", 0.0, 64.0), ("min_token_prob", 0.0, 1.0)):
        v = merged[key]
        if not (isinstance(v, int | float) and not isinstance(v, bool) and lo <= v <= hi):
            raise ValueError(f"lookup: {key} must be a number in [{lo:g}, {hi:g}], got {v!r}")
        merged[key] = float(v)
    return merged


def slot(shared: bool, match_len: int, estimate: float) -> int:
    """A draft token's slot: its source, its match's length and its conditional estimate."""
    m = min(max(match_len, 1).bit_length() - 1, MATCH_BUCKETS - 1)
    e = bisect_right(ESTIMATE_BUCKETS, estimate) if estimate >= 0.0 else 0  # buckets reached
    return shared * SOURCE_SLOTS + m * (len(ESTIMATE_BUCKETS) + 1) + e


def is_shared(s: int) -> bool:
    """Whether slot ``s`` is the shared index's (other requests' outputs, the datastore)."""
    return s >= SOURCE_SLOTS


class _Drafting:
    """How every tree of one engine drafts (the config's options, read once)."""

    def __init__(self, options: dict) -> None:
        opts = {**DEFAULTS, **options}
        self.max_depth = int(opts["max_depth"])
        self.factor = float(opts["max_spec_factor"])
        self.min_prob = float(opts["min_token_prob"])

    def factor_for(self, requests: int) -> float:
        """The draft length's factor in a step of ``requests`` requests: ``max_spec_factor``
        for a request alone; its part past 1 (the tokens past the match's length) shrinks as
        ``1 / requests``. Measured on the embedded model's CPU, in the same runs against
        factor 1: at batch 1 those tokens paid (edits: 126 engine steps against 142), at batch
        8 they cost 2-5% on HumanEval and edits, though the controller verifies only what it
        prices as paying (docs/performance.md, "How far a lookup draft runs")."""
        if self.factor <= 1.0 or requests <= 1:
            return self.factor
        return 1.0 + (self.factor - 1.0) / requests

    def speculate(self, tree, context: Sequence[int], k: int, factor: float | None = None):
        """The tree's draft of at most ``k`` tokens after ``context`` (arctic's ``Draft``), at
        ``factor`` (default ``max_spec_factor``)."""
        factor = self.factor if factor is None else factor
        return tree.speculate(context, k, factor, 0.0, self.min_prob, False)


class SharedIndex:
    """What a request may draft from beyond its own context: the ``pinned`` datastore sequences,
    and the outputs of recently finished requests of its *tenant* (SuffixDecoding's global
    tree, one per tenant). Bounded: past ``capacity`` tokens over all tenants the oldest outputs
    are forgotten; pinned ones stay.

    A request sees one tenant's outputs and the datastore (``view(tenant)``). One tenant's
    outputs are never proposed to another's requests, so acceptance (a streamed multi-token
    chunk, the shared-lookup counter) says nothing about what another tenant generated.
    ``"tenant"`` sharing keys outputs by the request's tenant, ``"global"`` puts every output
    under one key (every request sees every other's), ``"off"`` adds none.
    """

    def __init__(
        self, options: dict | None = None, capacity: int = 100_000, pinned: Sequence = ()
    ) -> None:
        self.drafting = _Drafting(options or {})
        self.capacity = capacity
        tree_cls = suffix_tree_class()
        self._new_tree = lambda: tree_cls(self.drafting.max_depth)
        self.datastore = self._new_tree()
        self.datastore_tokens = 0
        for seq_id, seq in enumerate(pinned):
            seq = [int(t) for t in seq]
            self.datastore.extend(seq_id, seq)
            self.datastore_tokens += len(seq)
        #: tenant -> the suffix tree of its requests' outputs (dropped once empty)
        self.tables: dict[str, object] = {}
        #: (tenant, sequence id, tokens) of every output held, oldest first, over all tenants
        self.outputs: deque[tuple[str, int, int]] = deque()
        self.size = 0
        self._next_id = 0

    def view(self, tenant: str = "") -> TenantView:
        """What a request of ``tenant`` drafts from: its tenant's outputs and the datastore."""
        return TenantView(self, tenant)

    def forget(self) -> None:
        """Take back every output added (the pinned sequences stay)."""
        self.tables.clear()
        self.outputs.clear()
        self.size = 0

    def add(self, tokens: Sequence[int], tenant: str = "") -> None:
        """Hold a finished request's output under its tenant."""
        tokens = [int(t) for t in tokens][-self.capacity :]
        if not tokens:
            return
        tree = self.tables.get(tenant)
        if tree is None:
            tree = self.tables[tenant] = self._new_tree()
        seq_id, self._next_id = self._next_id, (self._next_id + 1) & 0x7FFFFFFF
        tree.extend(seq_id, tokens)
        self.outputs.append((tenant, seq_id, len(tokens)))
        self.size += len(tokens)
        while self.size > self.capacity:
            who, old, n = self.outputs.popleft()
            self.size -= n
            tree = self.tables[who]
            tree.remove(old)
            if tree.num_seqs() == 0:
                del self.tables[who]

    def memory_bytes(self) -> int:
        """What the trees hold, as their own estimate."""
        trees = [self.datastore, *self.tables.values()]
        return sum(t.estimate_memory() for t in trees)


class TenantView:
    """``SharedIndex`` as one tenant's requests see it: the better of the tenant's outputs'
    draft and the datastore's (the outputs' on ties: they are recent)."""

    def __init__(self, shared: SharedIndex, tenant: str) -> None:
        self.shared, self.tenant = shared, tenant

    def speculate(self, context: Sequence[int], k: int, factor: float | None = None):
        shared = self.shared
        best = shared.drafting.speculate(shared.datastore, context, k, factor)
        tree = shared.tables.get(self.tenant)
        if tree is not None:
            own = shared.drafting.speculate(tree, context, k, factor)
            if own.score >= best.score:
                best = own
        return best


class ContextIndex:
    """One request's suffix tree: its prompt's last ``window`` tokens and all of its output,
    indexing at most ``budget`` prompt tokens per ``extend`` (see the module docstring).

    The tree holds sequences: the *live* one, which starts ``budget`` tokens before the end of
    what the first ``extend`` brought and grows as tokens arrive, and the older prompt tokens
    in chunks of ``budget``, newest first (a match across two chunks' boundary is not found:
    a draft there stops at the boundary)."""

    def __init__(
        self, options: dict | None = None, window: int = INDEX_WINDOW, budget: int = INDEX_BUDGET
    ) -> None:
        self.drafting = _Drafting(options or {})
        self.tree = suffix_tree_class()(self.drafting.max_depth)
        self.tokens: list[int] = []
        self.window, self.budget = window, budget
        self.lo = self.hi = 0  # the positions indexed: [lo, hi)
        self.floor = 0  # the oldest position to index (the window's start)
        self._chunks = 0  # older prompt chunks indexed (sequences 1, 2, ...)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Sequence[int]) -> None:
        """Append tokens, index them, then index older prompt tokens with what is left of the
        step's budget, newest first."""
        toks = self.tokens
        first = not toks
        toks.extend(map(int, new))
        n = len(toks)
        if first:
            self.floor = max(0, n - self.window)
            self.lo = self.hi = max(self.floor, n - self.budget)
        # new tokens of the live sequence (more than a budget at once only at admission)
        self.tree.extend(0, toks[self.hi : n])
        left = self.budget - (n - self.hi)
        self.hi = n
        if left > 0 and self.lo > self.floor:  # the next older chunk of the prompt
            start = max(self.floor, self.lo - left)
            self._chunks += 1
            self.tree.extend(self._chunks, toks[start : self.lo])
            self.lo = start

    def propose(
        self, k: int, shared: TenantView | None = None, requests: int = 1
    ) -> tuple[list[int], list[int]]:
        """Up to ``k`` draft tokens continuing the sequence, with each one's slot: from this
        request's tree or, where its draft is expected to yield more, the ``shared`` index's;
        as long as a step of ``requests`` requests lets a draft run (``factor_for``)."""
        if k <= 0:
            return [], []
        drafting = self.drafting
        context = self.tokens[-drafting.max_depth :]
        factor = drafting.factor_for(requests)
        best = drafting.speculate(self.tree, context, k, factor)
        from_shared = False
        if shared is not None:
            other = shared.speculate(context, k, factor)
            if other.score > best.score:
                best, from_shared = other, True
        tokens = list(best.token_ids)
        if not tokens:
            return [], []
        probs, match = best.probs, best.match_len
        slots, prev = [], 1.0
        for j, p in enumerate(probs):
            slots.append(slot(from_shared, match + j, p / prev if prev > 0 else 0.0))
            prev = p
        return tokens, slots

    def memory_bytes(self) -> int:
        return self.tree.estimate_memory()

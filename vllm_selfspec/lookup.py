"""Context lookup: free drafts from what a request has already seen (pure Python, no vLLM).

Prompt lookup (vLLM's ``ngram``) copies the tokens that followed the last occurrence of the
request's last n tokens. ``ContextIndex`` goes further, in the manner of SuffixDecoding:

* it keeps, for every n-gram of the request's tokens (prompt + output, ``min_n``..``max_n``
  tokens long), how often each token followed it — updated incrementally as tokens arrive
  (each new token adds ``max_n`` entries; nothing is ever rescanned);
* a draft is a walk: at each position the longest n-gram ending there that was seen before
  proposes its most frequent follower (the latest one on ties), and the walk continues from the
  drafted token, so a draft can follow a repeated pattern past the end of its first match;
* beside the request's own index, ``SharedIndex`` holds the outputs of recently finished
  requests of the same tenant (bounded; ``"shared"``: "tenant", "global" or "off") and, pinned,
  a *datastore*: the model's own greedy generations on an offline corpus (``"datastore"``: the
  draft-vocabulary map's, ``vocab.py``), so a request has the model's habitual phrasing to draft
  from before any other request has finished. At each position of a walk the longest match of
  the indexes proposes (the request's own on ties: its context is the more specific);
* each draft token carries its *slot*, the length of the match that proposed it (shared-index
  matches in slots of their own): the engine measures acceptance per slot
  (``goodput.AcceptanceTracker``) and the goodput controller decides how many of the tokens to
  verify (a lookup draft costs no draft step, only its verification).

Worked example (``max_n=3, min_n=2``)::

    tokens:  a b c d a b c e a b
    index:   "a b" -> {c: 2}, "b c" -> {d: 1, e: 1}, "a b c" -> {d: 1, e: 1}, ...
    propose(4) after "... a b":  "e a b" was never followed, "a b" -> c (match 2); then
             "a b c" -> e (match 3: e is the later of two equally frequent followers);
             "b c e" -> a (match 3); "c e a" -> b (match 3)  => [c, e, a, b], matches [2, 3, 3, 3]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

#: lookup options of the config (``"lookup": true`` takes these; a dict overrides them);
#: ``datastore``: "auto" (the model's cached corpus generations, none if it has no map), null
#: (none) or a draft-vocabulary directory built with ``vllm-selfspec build-vocab``
#: ``shared``: whose finished outputs a request drafts from besides its own context and the
#: datastore: "tenant" (its tenant's: ``request_tenant``), "global" (every request's) or "off"
DEFAULTS = {"max_ngram": 4, "min_ngram": 1, "shared": "tenant", "datastore": "auto"}
SHARING = ("tenant", "global", "off")


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
    lo, hi = merged["min_ngram"], merged["max_ngram"]
    if (
        not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi))
        or not 1 <= lo <= hi <= 16
    ):
        raise ValueError(
            f"lookup: need integers 1 <= min_ngram <= max_ngram <= 16, got "
            f"min_ngram={lo!r}, max_ngram={hi!r}"
        )
    return merged


class NGramTable:
    """n-gram (``min_n``..``max_n`` tokens) -> {token that followed it: (count, last position)}.

    Every key and entry is an immutable tuple of ints (an update replaces the entry), so that
    Python's garbage collector stops tracking them after their first collection: a datastore of
    ~50k tokens was ~155k tracked lists and dicts, each of which every full collection of the
    worker walked (docs/architecture.md, "Runner hooks")."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.follow: dict[tuple[int, ...], dict[int, tuple[int, int]]] = {}
        #: n-gram -> its follower that ``next`` proposes, kept until the n-gram's counts change
        #: (a frequent token has many followers: the max over them took about half a walk's time
        #: in a synthetic test of Zipf-distributed tokens)
        self._best: dict[tuple[int, ...], int] = {}

    def _count(self, tokens: Sequence[int], end: int, delta: int) -> None:
        """Count ``tokens[end]`` as the follower of every n-gram ending just before it."""
        t = tokens[end]
        for n in range(self.min_n, min(self.max_n, end) + 1):
            key = tuple(tokens[end - n : end])
            self._best.pop(key, None)
            seen = self.follow.setdefault(key, {})
            entry = seen.get(t)
            if entry is None:
                seen[t] = (delta, end)
                continue
            count = entry[0] + delta
            if count > 0:
                seen[t] = (count, max(entry[1], end) if delta > 0 else entry[1])
            else:
                del seen[t]
                if not seen:
                    del self.follow[key]

    def next(self, context: Sequence[int]) -> tuple[int, int] | None:
        """(token, match length) from the longest n-gram ending the context that was seen."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            key = tuple(context[-n:])
            token = self._best.get(key)
            if token is not None:
                return token, n
            seen = self.follow.get(key)
            if seen:
                token = max(seen, key=lambda t: seen[t])  # count, then the latest position
                self._best[key] = token
                return token, n
        return None


class SharedIndex:
    """What a request may draft from beyond its own context: the ``pinned`` datastore sequences,
    and the outputs of recently finished requests of its *tenant* (SuffixDecoding's global
    tree, kept as n-gram counts, one table per tenant). Bounded: past ``capacity`` tokens over
    all tenants the oldest outputs are forgotten (their counts taken back); pinned ones stay.

    A request sees one tenant's outputs and the datastore (``view(tenant)``): where both
    match, the longer match proposes (the tenant's outputs on ties: they are recent). One
    tenant's outputs are never proposed to another's requests, so acceptance (a streamed
    multi-token chunk, the shared-lookup counter) says nothing about what another tenant
    generated. ``"tenant"`` sharing keys outputs by the request's tenant, ``"global"`` puts
    every output under one key (every request sees every other's), ``"off"`` adds none.
    """

    def __init__(
        self,
        max_n: int = 4,
        min_n: int = 1,
        capacity: int = 100_000,
        pinned: Sequence[Sequence[int]] = (),
    ) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.capacity = capacity
        self.datastore = NGramTable(max_n, min_n)
        for seq in pinned:
            seq = [int(t) for t in seq]
            for end in range(1, len(seq)):
                self.datastore._count(seq, end, +1)
        #: tenant -> the n-gram counts of its requests' outputs (dropped once empty)
        self.tables: dict[str, NGramTable] = {}
        #: (tenant, output) of every output counted, oldest first, over all tenants
        self.outputs: deque[tuple[str, list[int]]] = deque()
        self.size = 0

    def view(self, tenant: str = "") -> TenantView:
        """What a request of ``tenant`` drafts from: its tenant's outputs and the datastore."""
        return TenantView(self, tenant)

    def forget(self) -> None:
        """Take back every output added (the pinned sequences stay)."""
        self.tables.clear()
        self.outputs.clear()
        self.size = 0

    def add(self, tokens: Sequence[int], tenant: str = "") -> None:
        """Count a finished request's output under its tenant."""
        tokens = [int(t) for t in tokens][-self.capacity :]
        table = self.tables.get(tenant)
        if table is None:
            table = self.tables[tenant] = NGramTable(self.max_n, self.min_n)
        for end in range(1, len(tokens)):
            table._count(tokens, end, +1)
        self.outputs.append((tenant, tokens))
        self.size += len(tokens)
        while self.size > self.capacity:
            who, old = self.outputs.popleft()
            self.size -= len(old)
            table = self.tables[who]
            for end in range(1, len(old)):
                table._count(old, end, -1)
            if not table.follow:
                del self.tables[who]


class TenantView:
    """``SharedIndex`` as one tenant's requests see it: ``next`` like an ``NGramTable``'s."""

    def __init__(self, shared: SharedIndex, tenant: str) -> None:
        self.shared, self.tenant = shared, tenant

    def next(self, context: Sequence[int]) -> tuple[int, int] | None:
        table = self.shared.tables.get(self.tenant)
        own = table.next(context) if table is not None else None
        if own is not None and own[1] >= self.shared.max_n:
            return own
        store = self.shared.datastore.next(context)
        if store is not None and (own is None or store[1] > own[1]):
            return store
        return own


#: the most recent positions of a request's tokens its index counts: older ones are taken back
#: as new ones arrive, so the index of a long context holds at most this many positions' n-grams
INDEX_WINDOW = 8192
#: the most positions one ``extend`` counts: a long prompt is indexed from its end back, over
#: several engine steps, instead of stalling the step that admits it
INDEX_BUDGET = 2048


class ContextIndex(NGramTable):
    """The n-grams of one request's tokens and what followed each (see the module docstring),
    over its last ``window`` positions, counting at most ``budget`` positions per ``extend``.

    The positions counted are always one contiguous range ``[lo, hi)`` ending at the newest
    token once the index has caught up: new tokens are counted as they arrive (a decode step
    adds a few), and what is left of a long prompt is counted from the end back, ``budget`` at
    a time. A position's order of counting does not change any count, so the index that has
    caught up equals one built token by token."""

    def __init__(
        self, max_n: int = 4, min_n: int = 1, window: int = INDEX_WINDOW, budget: int = INDEX_BUDGET
    ) -> None:
        super().__init__(max_n, min_n)
        self.tokens: list[int] = []
        self.window, self.budget = window, budget
        self.lo = self.hi = 0  # the positions counted: [lo, hi)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Sequence[int]) -> None:
        """Append tokens, then count up to ``budget`` positions: the newest first, then back
        towards the window's start; positions that left the window are taken back."""
        toks = self.tokens
        toks.extend(int(t) for t in new)
        n, left = len(toks), self.budget
        start = max(0, n - self.window)  # the window's first position
        if n - self.hi > left:  # too many new positions to count now: start again at the end
            self._take_back(self.lo, self.hi)
            self.lo = self.hi = n - left
        for end in range(self.hi, n):  # the new positions
            self._count(toks, end, +1)
        left -= n - self.hi
        self.hi = n
        if self.lo < start:  # positions that left the window
            self._take_back(self.lo, min(start, self.hi))
            self.lo = max(start, self.lo)
        back = max(start, self.lo - left)  # then back towards the window's start
        for end in range(back, self.lo):
            self._count(toks, end, +1)
        self.lo = min(self.lo, back)

    def _take_back(self, lo: int, hi: int) -> None:
        for end in range(lo, hi):
            self._count(self.tokens, end, -1)

    def propose(
        self, k: int, shared: NGramTable | TenantView | None = None
    ) -> tuple[list[int], list[int]]:
        """Up to ``k`` draft tokens continuing the sequence, with each one's *slot*: its match
        length n in this request's context, or ``max_n + n`` where the ``shared`` index (other
        requests' outputs, the datastore) had the longer match."""
        context = self.tokens[-self.max_n :]
        drafts: list[int] = []
        slots: list[int] = []
        for _ in range(k):
            found, slot_base = self.next(context), 0
            if shared is not None and (found is None or found[1] < self.max_n):
                other = shared.next(context)
                if other is not None and (found is None or other[1] > found[1]):
                    found, slot_base = other, self.max_n
            if found is None:
                break
            token, n = found
            drafts.append(token)
            slots.append(slot_base + n)
            context = (context + [token])[-self.max_n :]
        return drafts, slots

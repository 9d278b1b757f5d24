"""Context lookup: free drafts from what a request has already seen (pure Python, no vLLM).

Prompt lookup (vLLM's ``ngram``) copies the tokens that followed the last occurrence of the
request's last n tokens. ``ContextIndex`` goes further, in the manner of SuffixDecoding:

* it keeps, for every n-gram of the request's tokens (prompt + output, ``min_n``..``max_n``
  tokens long), how often each token followed it — updated incrementally as tokens arrive
  (each new token adds ``max_n`` entries; nothing is ever rescanned);
* a draft is a walk: at each position the longest n-gram ending there that was seen before
  proposes its most frequent follower (the latest one on ties), and the walk continues from the
  drafted token, so a draft can follow a repeated pattern past the end of its first match;
* each draft token carries the length of the match that proposed it: the engine measures
  acceptance per match length (``goodput.AcceptanceTracker`` over those slots) and the goodput
  controller decides how many of the tokens to verify (a lookup draft costs no draft step, only
  its verification).

Worked example (``max_n=3``)::

    tokens:  a b c d a b c e a b
    index:   "a b" -> {c: 2}, "b c" -> {d: 1, e: 1}, "a b c" -> {d: 1, e: 1}, ...
    propose(4) after "... a b":  "e a b" was never followed, "a b" -> c (match 2); then
             "a b c" -> e (match 3: e is the later of two equally frequent followers);
             "b c e" -> a (match 3); "c e a" -> b (match 3)  => [c, e, a, b], matches [2, 3, 3, 3]
"""
from __future__ import annotations

from collections.abc import Sequence

#: lookup options of the config (``"lookup": true`` takes these; a dict overrides them)
DEFAULTS = {"max_ngram": 4, "min_ngram": 1}


def check_options(options) -> dict:
    """The config's ``lookup`` value as options, or a ValueError (None: lookup off)."""
    if options is None or options is False:
        return {}
    if options is True:
        return dict(DEFAULTS)
    if not isinstance(options, dict):
        raise ValueError(f"lookup must be true, false or an object with {sorted(DEFAULTS)}, "
                         f"got {options!r}")
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown lookup option(s) {unknown}; allowed: {sorted(DEFAULTS)}")
    merged = {**DEFAULTS, **options}
    lo, hi = merged["min_ngram"], merged["max_ngram"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) \
            or not 1 <= lo <= hi <= 16:
        raise ValueError(f"lookup: need integers 1 <= min_ngram <= max_ngram <= 16, got "
                         f"min_ngram={lo!r}, max_ngram={hi!r}")
    return merged


class ContextIndex:
    """The n-grams of one request's tokens and what followed each (see the module docstring)."""

    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        #: n-gram -> {next token: (count, last position it followed at)}
        self.follow: dict[tuple[int, ...], dict[int, list[int]]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Sequence[int]) -> None:
        """Append tokens; each becomes the follower of the n-grams that end just before it."""
        toks = self.tokens
        for t in new:
            t = int(t)
            end = len(toks)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                seen = self.follow.setdefault(tuple(toks[end - n:end]), {})
                entry = seen.get(t)
                if entry is None:
                    seen[t] = [1, end]
                else:
                    entry[0] += 1
                    entry[1] = end
            toks.append(t)

    def _next(self, context: list[int]) -> tuple[int, int] | None:
        """(token, match length) from the longest n-gram ending the context that was seen."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            seen = self.follow.get(tuple(context[-n:]))
            if seen:
                token = max(seen, key=lambda t: seen[t])  # count, then the latest position
                return token, n
        return None

    def propose(self, k: int) -> tuple[list[int], list[int]]:
        """Up to ``k`` draft tokens continuing the sequence, with each one's match length."""
        context = self.tokens[-self.max_n:]
        drafts: list[int] = []
        matches: list[int] = []
        for _ in range(k):
            found = self._next(context)
            if found is None:
                break
            token, n = found
            drafts.append(token)
            matches.append(n)
            context = (context + [token])[-self.max_n:]
        return drafts, matches

"""Context lookup (vllm_selfspec/lookup.py) against brute force, and the free/paid choice."""

import random

import numpy as np
import pytest

from vllm_selfspec.goodput import Candidate, prefer_free
from vllm_selfspec.lookup import ContextIndex, SharedIndex, check_options


def brute_next(tokens, context, max_n, min_n):
    """The longest n-gram ending ``context`` that occurred in ``tokens`` with a follower: its
    most frequent follower, the latest one on ties."""
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        key = list(context[-n:])
        followers = {}
        for end in range(n, len(tokens)):
            if tokens[end - n : end] == key:
                count, _ = followers.get(tokens[end], (0, -1))
                followers[tokens[end]] = (count + 1, end)
        if followers:
            return max(followers, key=lambda t: followers[t]), n
    return None


@pytest.mark.parametrize("seed", range(20))
def test_next_matches_brute_force_on_random_sequences(seed):
    rng = random.Random(seed)
    vocab, max_n, min_n = rng.choice([2, 3, 5, 8]), rng.randint(1, 5), 1
    min_n = rng.randint(1, max_n)
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 120))]
    index = ContextIndex(max_n, min_n)
    index.extend(tokens)
    for _ in range(20):
        context = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        assert index.next(context) == brute_next(tokens, context, max_n, min_n)
    assert index.next(tokens) == brute_next(tokens, tokens, max_n, min_n)


@pytest.mark.parametrize("seed", range(5))
def test_lookups_between_updates_see_every_update(seed):
    """``next`` keeps each n-gram's proposed follower until that n-gram's counts change: a
    lookup between two extends answers as a brute-force search over the tokens so far."""
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(200)]
    index = ContextIndex(3, 1)
    for end in range(len(tokens)):
        index.extend(tokens[end : end + 1])
        for context in (tokens[: end + 1], tokens[: end + 1] + [rng.randrange(4)]):
            assert index.next(context) == brute_next(tokens[: end + 1], context, 3, 1)


def test_incremental_updates_equal_a_rebuild():
    rng = random.Random(7)
    tokens = [rng.randrange(6) for _ in range(300)]
    whole = ContextIndex(4, 1)
    whole.extend(tokens)
    pieces = ContextIndex(4, 1)
    i = 0
    while i < len(tokens):
        step = rng.randint(1, 7)
        pieces.extend(tokens[i : i + step])
        i += step
    assert pieces.follow == whole.follow and pieces.tokens == whole.tokens


def test_propose_walks_and_reports_match_lengths():
    index = ContextIndex(3, 2)
    index.extend([0, 1, 2, 3, 0, 1, 2, 4, 0, 1])  # the module docstring's example
    assert index.propose(4) == ([2, 4, 0, 1], [2, 3, 3, 3])
    assert index.propose(0) == ([], [])
    assert ContextIndex(3, 2).propose(4) == ([], [])


def test_shared_index_continues_where_the_context_has_no_match_and_forgets_the_oldest():
    shared = SharedIndex(3, 1, capacity=8)
    shared.add([7, 8, 9, 10])
    index = ContextIndex(3, 1)
    index.extend([1, 2, 7, 8])
    # the context has no follower for "7 8" (it ends there): the shared index continues it
    assert index.propose(2, shared) == ([9, 10], [3 + 2, 3 + 3])
    shared.add([20, 21, 22, 23, 24])  # over capacity: [7, 8, 9, 10] is forgotten
    assert index.propose(2, shared) == ([], [])
    rebuilt = SharedIndex(3, 1, capacity=8)
    rebuilt.add([20, 21, 22, 23, 24])
    counts = {k: {t: e[0] for t, e in v.items()} for k, v in shared.follow.items()}
    assert counts == {k: {t: e[0] for t, e in v.items()} for k, v in rebuilt.follow.items()}


def test_options():
    assert check_options(False) == {} and check_options(None) == {}
    assert check_options(True) == {"max_ngram": 4, "min_ngram": 1, "shared": True}
    assert check_options({"max_ngram": 6})["max_ngram"] == 6
    for bad in ({"max_ngram": 0}, {"min_ngram": 3, "max_ngram": 2}, {"x": 1}, "yes", {"shared": 1}):
        with pytest.raises(ValueError):
            check_options(bad)


def test_prefer_free_weighs_tokens_per_second_of_cost():
    free = Candidate(3, np.array([0.3, 0.2, 0.1]), free=True)
    dear = Candidate(3, np.array([0.9, 0.8, 0.7]), row_seconds=0.010, plan_seconds=0.005)
    cheap = Candidate(3, np.array([0.9, 0.8, 0.7]), row_seconds=0.0001, plan_seconds=0.0)
    v1 = 0.002
    assert prefer_free(free, dear, v1)  # 0.3 per 2 ms beats 0.9 per 17 ms
    assert not prefer_free(free, cheap, v1)  # 0.9 per 2.1 ms beats 0.3 per 2 ms
    assert prefer_free(free, Candidate(0, np.zeros(0)), v1)
    assert not prefer_free(Candidate(0, np.zeros(0), free=True), dear, v1)

"""Context lookup (vllm_selfspec/lookup.py) against brute force, and the free/paid choice."""

import random

import numpy as np
import pytest

from vllm_selfspec.goodput import Candidate, prefer_free
from vllm_selfspec.lookup import (
    INDEX_BUDGET,
    INDEX_WINDOW,
    ContextIndex,
    SharedIndex,
    check_options,
)


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


def brute_longest(sequences, context, max_n, min_n):
    """The longest n-gram ending ``context`` with a follower in any of ``sequences`` (n-grams do
    not span two of them): its follower with the highest total count (ties: any of them)."""
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        key = list(context[-n:])
        counts = {}
        for seq in sequences:
            for end in range(n, len(seq)):
                if seq[end - n : end] == key:
                    counts[seq[end]] = counts.get(seq[end], 0) + 1
        if counts:
            top = max(counts.values())
            return {t for t, c in counts.items() if c == top}, n
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
    assert index.propose(2, shared.view()) == ([9, 10], [3 + 2, 3 + 3])
    shared.add([20, 21, 22, 23, 24])  # over capacity: [7, 8, 9, 10] is forgotten
    assert index.propose(2, shared.view()) == ([], [])
    rebuilt = SharedIndex(3, 1, capacity=8)
    rebuilt.add([20, 21, 22, 23, 24])
    counts = {k: {t: e[0] for t, e in v.items()} for k, v in shared.tables[""].follow.items()}
    assert counts == {
        k: {t: e[0] for t, e in v.items()} for k, v in rebuilt.tables[""].follow.items()
    }


@pytest.mark.parametrize("seed", range(20))
def test_each_draft_token_comes_from_the_longer_match_of_the_two_indexes(seed):
    """A walk with a shared index: at each position the longer of the request's match and the
    shared index's (outputs and pinned datastore) proposes, the request's own on ties."""
    rng = random.Random(seed)
    vocab, max_n = rng.choice([3, 5, 8]), rng.randint(2, 4)
    seq = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    pinned, outputs = [seq(rng.randint(0, 40)) for _ in range(3)], [seq(rng.randint(0, 30))]
    shared = SharedIndex(max_n, 1, pinned=pinned)
    for out in outputs:
        shared.add(out)
    index = ContextIndex(max_n, 1)
    index.extend(seq(rng.randint(1, 30)))
    drafts, slots = index.propose(8, shared.view())
    context = list(index.tokens)
    for token, slot in zip(drafts, slots):
        own = brute_next(index.tokens, context, max_n, 1)
        # the shared view: the longer of the tenant's outputs' match and the datastore's (the
        # outputs' on ties), each table proposing its own most frequent follower
        mine, store = (
            brute_longest(outputs, context, max_n, 1),
            brute_longest(pinned, context, max_n, 1),
        )
        other = mine if mine is not None and (store is None or mine[1] >= store[1]) else store
        if own is not None and (other is None or own[1] >= other[1]):
            assert (token, slot) == own
        else:
            assert token in other[0] and slot == max_n + other[1]
        context.append(token)
    assert len(drafts) == 8 or (own, other) == (None, None)


def test_a_tenants_outputs_are_never_proposed_to_another_tenant():
    """The membership oracle this closes: acceptance of a shared draft would tell a request of
    tenant B that tenant A's output held the n-gram."""
    shared = SharedIndex(3, 1, pinned=[[40, 41, 42]])
    shared.add([1, 2, 3, 4, 5, 6], tenant="a")
    index = ContextIndex(3, 1)
    index.extend([9, 1, 2, 3])
    assert index.propose(3, shared.view("a")) == ([4, 5, 6], [6, 6, 6])
    assert index.propose(3, shared.view("b")) == ([], [])  # nothing of a's reaches b
    assert index.propose(3, shared.view()) == ([], [])  # nor requests without a tenant
    index.extend([40, 41])  # the datastore is every tenant's
    assert index.propose(1, shared.view("b")) == ([42], [3 + 2])
    shared.add([7, 8, 9, 1, 2, 3, 7], tenant="b")
    assert index.propose(1, shared.view("a")) == ([42], [3 + 2])


def test_capacity_is_over_all_tenants_and_an_emptied_tenant_is_dropped():
    shared = SharedIndex(2, 1, capacity=8)
    shared.add([1, 2, 3, 4], tenant="a")
    shared.add([5, 6, 7], tenant="b")
    assert set(shared.tables) == {"a", "b"} and shared.size == 7
    shared.add([8, 9], tenant="b")  # 9 > 8: a's output, the oldest, goes
    assert set(shared.tables) == {"b"} and shared.size == 5
    assert shared.view("a").next([1, 2]) is None and shared.view("b").next([5, 6]) == (7, 2)


def test_a_longer_shared_match_outranks_a_short_one_in_the_context():
    shared = SharedIndex(3, 1, pinned=[[5, 6, 7, 8]])
    index = ContextIndex(3, 1)
    index.extend([7, 1, 5, 6, 7])  # the context has "7" -> 1 (match 1); the datastore "5 6 7" -> 8
    assert index.propose(1, shared.view()) == ([8], [3 + 3])
    assert index.propose(1) == ([1], [1])


def test_pinned_sequences_outlast_eviction_and_forget():
    pinned = [[1, 2, 3, 4], [2, 3, 5]]
    shared = SharedIndex(3, 1, capacity=6, pinned=pinned)
    fresh = {k: {t: e[0] for t, e in v.items()} for k, v in shared.datastore.follow.items()}
    shared.add([9, 8, 7, 6])
    shared.add([6, 5, 4, 3])  # over capacity: the first output goes, the pinned ones stay
    assert shared.size == 4 and shared.view().next([1, 2, 3]) == (4, 3)
    shared.forget()
    assert shared.size == 0 and not shared.outputs and not shared.tables
    assert {k: {t: e[0] for t, e in v.items()} for k, v in shared.datastore.follow.items()} == fresh


def test_options():
    assert check_options(False) == {} and check_options(None) == {}
    defaults = {"max_ngram": 4, "min_ngram": 1, "shared": "tenant", "datastore": "auto"}
    assert check_options(True) == defaults
    assert check_options({"shared": True})["shared"] == "tenant"
    assert check_options({"shared": False})["shared"] == "off"
    assert check_options({"shared": "global"})["shared"] == "global"
    assert check_options({"max_ngram": 6})["max_ngram"] == 6
    assert check_options({"datastore": None})["datastore"] is None
    for bad in (
        {"max_ngram": 0},
        {"min_ngram": 3, "max_ngram": 2},
        {"x": 1},
        "yes",
        {"shared": 1},
        {"shared": "per-user"},
        {"datastore": ""},
        {"datastore": True},
    ):
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


def test_the_tables_leave_the_garbage_collectors_tracking():
    """Keys and entries are tuples of ints and each n-gram's dict holds nothing else, so after
    one collection the garbage collector no longer tracks them (a datastore of ~50k tokens was ~155k
    tracked lists, which every full collection of the worker walked)."""
    import gc

    rng = random.Random(3)
    shared = SharedIndex(4, 1, pinned=[[rng.randrange(20) for _ in range(300)]])
    shared.add([rng.randrange(20) for _ in range(100)])
    own = ContextIndex(4, 1)
    own.extend([rng.randrange(20) for _ in range(200)])
    gc.collect()
    for table in (shared.datastore, shared.tables[""], own):
        assert table.follow, "nothing counted"
        # the outer dict stays tracked (its values are dicts), one object a collection visits
        assert not any(gc.is_tracked(seen) for seen in table.follow.values())


def test_the_tenant_of_a_request():
    from types import SimpleNamespace

    from vllm_selfspec import compat

    def runner(extra=None, lora=None):
        state = SimpleNamespace(
            sampling_params=SimpleNamespace(extra_args=extra),
            lora_request=None if lora is None else SimpleNamespace(lora_name=lora),
        )
        return SimpleNamespace(requests={"r": state})

    assert compat.request_tenant(runner({"selfspec_tenant": "acme"}), "r") == "x:acme"
    assert compat.request_tenant(runner({"selfspec_tenant": 7}, lora="sql"), "r") == "x:7"
    assert compat.request_tenant(runner({"other": 1}, lora="sql"), "r") == "lora:sql"
    assert compat.request_tenant(runner(), "r") == ""
    assert compat.request_tenant(runner(), "gone") == ""


def counts_of(table) -> dict:
    return {k: {t: e[0] for t, e in v.items()} for k, v in table.follow.items()}


def window_reference(tokens, start, max_n=4, min_n=1):
    """An index counting exactly the positions ``start..`` of ``tokens``."""
    ref = ContextIndex(max_n, min_n, window=10**9, budget=10**9)
    ref.tokens = list(tokens)
    for end in range(start, len(tokens)):
        ref._count(ref.tokens, end, +1)
    return ref


@pytest.mark.parametrize("seed", range(6))
def test_a_long_prompt_is_indexed_within_the_budget_and_catches_up(seed):
    """A prompt far longer than the per-step budget costs each step at most ``budget``
    positions (the first step counts its end, where a draft matches first); once caught up,
    the counts are those of the window's positions, as if built token by token."""
    rng = random.Random(seed)
    window, budget = rng.choice([(64, 16), (100, 7), (50, 50)])
    tokens = [rng.randrange(6) for _ in range(rng.randint(1, 400))]
    index = ContextIndex(4, 1, window=window, budget=budget)
    counted = []
    real = index._count
    index._count = lambda toks, end, delta: (counted.append(delta), real(toks, end, delta))[1]
    index.extend(tokens)
    steps = 1
    while index.lo > max(0, len(tokens) - window):
        assert counted.count(+1) <= budget
        counted.clear()
        index.extend([rng.randrange(6)])  # a decode step's token
        tokens = index.tokens
        steps += 1
    assert counts_of(index) == counts_of(window_reference(tokens, max(0, len(tokens) - window)))
    for _ in range(3 * window):  # decoding on: the window slides, old positions taken back
        index.extend([rng.randrange(6) for _ in range(rng.randint(1, 3))])
    start = max(0, len(index.tokens) - window)
    assert (index.lo, index.hi) == (start, len(index.tokens))
    assert counts_of(index) == counts_of(window_reference(index.tokens, start))


def test_a_64k_token_prompt_costs_one_step_a_budget_of_positions():
    """The step that admits a 64k-token prompt counts ``INDEX_BUDGET`` positions of it, not
    65,536 (the whole prompt once took hundreds of MB inside one engine step); its index never
    holds more than the window's n-grams."""
    rng = random.Random(0)
    prompt = [rng.randrange(5000) for _ in range(65536)]
    index = ContextIndex(4, 1)
    index.extend(prompt)
    assert index.hi - index.lo == INDEX_BUDGET
    assert len(index.follow) <= 4 * INDEX_BUDGET
    while index.lo > len(index.tokens) - INDEX_WINDOW:
        index.extend([1])
    assert len(index.follow) <= 4 * (INDEX_WINDOW + 64)

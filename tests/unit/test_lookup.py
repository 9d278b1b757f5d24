"""Context lookup (vllm_selfspec/lookup.py): its drafts against vLLM's suffix method on the same
tokens, its budgeted indexing, tenants and slots; and the free/paid choice."""

import random

import numpy as np
import pytest

from vllm_selfspec.goodput import Candidate, prefer_free
from vllm_selfspec.lookup import (
    INDEX_BUDGET,
    INDEX_WINDOW,
    SOURCE_SLOTS,
    ContextIndex,
    SharedIndex,
    check_options,
    is_shared,
    slot,
)

pytest.importorskip("arctic_inference.suffix_decoding")


def suffix_method_draft(prompt, output, k, depth=24, factor=1.0, min_prob=0.1):
    """What vLLM's ``suffix`` method drafts for a request alone (``SuffixDecodingProposer``:
    its prompt, then its output, no other request's)."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(depth, max_cached_requests=0)
    cache.start_request("r", prompt)
    if output:
        cache.add_active_response("r", output)
    tokens = list(prompt) + list(output)
    return cache.speculate(
        "r", tokens[-depth:], max_spec_tokens=k, max_spec_factor=factor, min_token_prob=min_prob
    )


@pytest.mark.parametrize("seed", range(20))
def test_a_request_drafts_what_vllms_suffix_method_drafts_from_its_tokens(seed):
    """Prompt and output within the budget: one sequence, the request's own tree, the same
    draft as vLLM's suffix decoding proposes for it, whatever the options."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 8, 50])
    options = {
        "max_depth": rng.choice([4, 8, 24]),
        "max_spec_factor": rng.choice([0.5, 1.0, 2.0]),
        "min_token_prob": rng.choice([0.0, 0.1, 0.4]),
    }
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 200))]
    index = ContextIndex(options)
    index.extend(prompt)
    output = []
    for _ in range(rng.randint(0, 20)):
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        index.extend(new)
        output += new
    k = rng.randint(1, 16)
    ref = suffix_method_draft(
        prompt,
        output,
        k,
        options["max_depth"],
        options["max_spec_factor"],
        options["min_token_prob"],
    )
    tokens, slots = index.propose(k)
    assert tokens == list(ref.token_ids) and len(slots) == len(tokens)
    assert not any(map(is_shared, slots))


def test_a_repeated_text_is_drafted_at_the_length_of_its_match():
    """The draft length follows the match: a long repeat drafts k tokens, a short one few."""
    text = list(range(100, 140))
    index = ContextIndex()
    index.extend([1, 2, *text, 3, 4, *text[:20]])  # the text again, 20 tokens in
    tokens, _ = index.propose(12)
    assert tokens == text[20:32]
    short = ContextIndex()
    short.extend([7, 8, 9, 5, 6, 7, 8])  # "7 8" matched: 4 tokens at the default factor 2
    assert short.propose(12)[0] == [9, 5, 6, 7]
    suffix_like = ContextIndex({"max_spec_factor": 1.0})  # SuffixDecoding's factor: 2 tokens
    suffix_like.extend([7, 8, 9, 5, 6, 7, 8])
    assert suffix_like.propose(12)[0] == [9, 5]
    assert ContextIndex().propose(4) == ([], [])


def test_drafts_run_past_the_match_less_far_as_the_batch_fills():
    """Factor 2 for a request alone; in a step of R requests the part past 1 shrinks as 1/R
    (``factor_for``), down to the match's length and never below it; factor 1 (SuffixDecoding's)
    and below are the same at every batch size."""
    index = ContextIndex()
    index.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4])  # "1 2 3 4" matched
    assert index.propose(16)[0] == list(range(5, 13))  # 8 tokens: factor 2
    assert index.propose(16, requests=2)[0] == list(range(5, 11))  # 6: factor 1.5
    assert index.propose(16, requests=8)[0] == list(range(5, 9))  # 4.5 -> 4: the match's length
    drafting = index.drafting
    assert [drafting.factor_for(r) for r in (1, 2, 4)] == [2.0, 1.5, 1.25]
    for factor in (0.5, 1.0):
        other = ContextIndex({"max_spec_factor": factor}).drafting
        assert other.factor_for(1) == other.factor_for(8) == factor


def test_slots():
    per = SOURCE_SLOTS // 5
    assert slot(False, 1, 0.2) == 0 and slot(False, 1, 0.95) == 2
    assert slot(False, 3, 0.6) == per + 1 and slot(False, 100, 1.0) == 4 * per + 2
    assert slot(True, 1, 0.2) == SOURCE_SLOTS and is_shared(slot(True, 9, 0.5))
    assert not is_shared(slot(False, 30, 1.0))


def test_a_tenants_outputs_are_never_proposed_to_another_tenant():
    """The membership oracle this closes: acceptance of a shared draft would tell a request of
    tenant B that tenant A's output held the text."""
    shared = SharedIndex(pinned=[[40, 41, 42, 43]])
    shared.add([1, 2, 3, 4, 5, 6], tenant="a")
    index = ContextIndex()
    index.extend([9, 1, 2, 3])
    tokens, slots = index.propose(3, shared.view("a"))
    assert tokens == [4, 5, 6] and all(map(is_shared, slots))
    assert index.propose(3, shared.view("b")) == ([], [])  # nothing of a's reaches b
    assert index.propose(3, shared.view()) == ([], [])  # nor requests without a tenant
    index.extend([40, 41, 42])  # the datastore is every tenant's
    assert index.propose(1, shared.view("b"))[0] == [43]
    shared.add([7, 8, 9, 1, 2, 3, 7], tenant="b")
    assert index.propose(1, shared.view("a"))[0] == [43]


def test_the_draft_expected_to_yield_most_wins_the_requests_own_on_ties():
    shared = SharedIndex(pinned=[[5, 6, 7, 8, 9, 10]])
    index = ContextIndex()
    # own: "7" -> 1 5 (match 1, factor 2); the datastore: "5 6 7" -> 8 9 10
    index.extend([7, 1, 5, 6, 7])
    assert index.propose(3, shared.view())[0] == [8, 9, 10]
    assert index.propose(3)[0] == [1, 5]
    # "3 4" -> 5 here and -> 6 in the datastore, each once in two occurrences: equal estimates
    tie = SharedIndex(pinned=[[3, 4, 6, 0, 3, 4]])
    own = ContextIndex()
    own.extend([3, 4, 5, 3, 4])
    tokens, slots = own.propose(1, tie.view())
    assert tokens == [5] and not is_shared(slots[0])


def test_capacity_is_over_all_tenants_and_an_emptied_tenant_is_dropped():
    shared = SharedIndex(capacity=8)
    shared.add([1, 2, 3, 4], tenant="a")
    shared.add([5, 6, 7], tenant="b")
    assert set(shared.tables) == {"a", "b"} and shared.size == 7
    shared.add([8, 9], tenant="b")  # 9 > 8: a's output, the oldest, goes
    assert set(shared.tables) == {"b"} and shared.size == 5
    index = ContextIndex()
    index.extend([0, 1, 2])
    assert index.propose(2, shared.view("a")) == ([], [])


def test_pinned_sequences_outlast_eviction_and_forget():
    shared = SharedIndex(capacity=6, pinned=[[1, 2, 3, 4], [2, 3, 5]])
    before = shared.memory_bytes()
    shared.add([9, 8, 7, 6])
    shared.add([6, 5, 4, 3])  # over capacity: the first output goes, the pinned ones stay
    assert shared.size == 4 and len(shared.outputs) == 1
    shared.forget()
    assert shared.size == 0 and not shared.outputs and not shared.tables
    assert shared.memory_bytes() == before
    index = ContextIndex()
    index.extend([0, 1, 2])
    assert index.propose(2, shared.view())[0] == [3, 4]


def test_options():
    assert check_options(False) == {} and check_options(None) == {}
    defaults = {
        "max_depth": 24,
        "max_spec_factor": 2.0,
        "min_token_prob": 0.1,
        "shared": "tenant",
        "datastore": "auto",
    }
    assert check_options(True) == defaults
    assert check_options({"shared": True})["shared"] == "tenant"
    assert check_options({"shared": False})["shared"] == "off"
    assert check_options({"shared": "global"})["shared"] == "global"
    assert check_options({"max_depth": 6})["max_depth"] == 6
    assert check_options({"max_spec_factor": 2})["max_spec_factor"] == 2.0
    assert check_options({"datastore": None})["datastore"] is None
    for bad in (
        {"max_depth": 1},
        {"max_depth": 8.0},
        {"max_spec_factor": -1},
        {"min_token_prob": 1.5},
        {"min_token_prob": "0.1"},
        {"max_ngram": 4},
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


class CountingTree:
    """A request's suffix tree that counts the tokens each ``extend`` indexes."""

    def __init__(self, tree):
        self.tree, self.indexed = tree, 0

    def extend(self, seq_id, tokens):
        self.indexed += len(tokens)
        self.tree.extend(seq_id, tokens)

    def __getattr__(self, name):
        return getattr(self.tree, name)


@pytest.mark.parametrize("seed", range(6))
def test_a_long_prompt_is_indexed_within_the_budget_and_catches_up(seed):
    """A prompt far longer than the per-step budget costs each step at most ``budget`` tokens
    (the first step indexes its end, where a draft matches first); the older tokens follow,
    newest first, back to the window's start, and a text there is then drafted from."""
    rng = random.Random(seed)
    window, budget = rng.choice([(640, 64), (1000, 70), (500, 500)])
    text = [1000 + i for i in range(30)]
    prompt = [rng.randrange(6) for _ in range(rng.randint(window, 3 * window))]
    start = len(prompt) - window + 5  # the text inside the window, near its start
    prompt[start : start + 30] = text
    index = ContextIndex(window=window, budget=budget)
    index.tree = CountingTree(index.tree)
    index.extend(prompt)
    assert index.tree.indexed <= budget and index.hi - index.lo == min(budget, len(prompt))
    steps = 1
    while index.lo > index.floor:
        index.tree.indexed = 0
        index.extend([2000 + steps])  # a decode step's token
        assert index.tree.indexed <= budget
        steps += 1
    assert index.lo == len(prompt) - window and steps <= window // budget + 2
    index.extend(text[:20])  # decoding reaches the text's start: the rest of it is drafted
    assert index.propose(8)[0] == text[20:28]


def test_a_64k_token_prompt_costs_one_step_a_budget_of_tokens():
    """The step that admits a 64k-token prompt indexes ``INDEX_BUDGET`` tokens of it, not 65,536
    (about 30 ms here in one engine step); its tree never holds more than the window and the
    output, and says how much memory that is."""
    rng = random.Random(0)
    prompt = [rng.randrange(5000) for _ in range(65536)]
    index = ContextIndex()
    index.tree = CountingTree(index.tree)
    index.extend(prompt)
    assert index.tree.indexed == INDEX_BUDGET
    while index.lo > index.floor:
        index.extend([1])
    assert index.tree.indexed <= INDEX_WINDOW + 64
    assert 0 < index.memory_bytes() < 2000 * (INDEX_WINDOW + 64)

"""``engine/drafting.py`` (the drafter interface and its context) and the parts of the drafters
that are pure logic: which drafter each method gets, the draft token choice, Cascade's walk caps.
The drafters' forwards run in the engine tests (parity of every method against vanilla vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_selfspec.engine.drafters.cascade import CascadeDrafter, CascadeWalks
from vllm_selfspec.engine.drafting import NO_DRAFT, DraftContext, Drafter, finite_rows
from vllm_selfspec.engine.proposer import DRAFTERS
from vllm_selfspec.engine.stats import EngineStats
from vllm_selfspec.plans import LayerPlan
from vllm_selfspec.policies import POLICIES, Feedback


def test_every_method_names_a_registered_drafter():
    for name, policy in POLICIES.items():
        assert policy.drafter in DRAFTERS, f"{name} names drafter {policy.drafter!r}"
    for cls in DRAFTERS.values():
        assert issubclass(cls, Drafter)
        assert cls.draft is not Drafter.draft, f"{cls.__name__} does not draft"
    assert POLICIES["layerskip"].drafter == "plan" and POLICIES["cascade"].drafter == "cascade"


def context(vocab_size: int = 6, vocab_ids=None, seed: int = 0) -> DraftContext:
    """A DraftContext over stand-ins for the proposer's parts (no model, no vLLM runner)."""
    proposer = SimpleNamespace(
        vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(seed=seed),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
        ),
        info=SimpleNamespace(vocab_size=vocab_size),
        policy=None,
        states={},
        costs=None,
        stats=EngineStats(),
        k=3,
        max_model_len=64,
    )
    executor = SimpleNamespace(vocab_ids=vocab_ids)
    return DraftContext(proposer, runner=None, executor=executor, shadow=None)


def test_pick_takes_the_argmax_of_greedy_rows_and_records_q_of_sampled_ones():
    # the draft vocabulary is tokens 4, 1, 5 of 6: logits columns map through vocab_ids
    ctx = context(vocab_ids=torch.tensor([4, 1, 5]))
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    temps = torch.tensor([0.0, 0.5, 1.0, 0.0])  # batch rows 0..3; rows 1, 2, 3 draft here
    probs = torch.zeros(3, 2, 6)
    batch_rows, J = torch.tensor([3, 1, 2]), torch.tensor([0, 1, 2])
    got = ctx.pick(logits, batch_rows, temps, probs, J, step=1)
    assert got[0] == 1  # greedy row: the argmax column 1 is token 1
    assert got[2] in (4, 1, 5) and got[1] in (4, 1, 5)
    for j, t in ((1, 0.5), (2, 1.0)):
        q = probs[j, 1]
        assert q[[0, 2, 3]].sum() == 0, "q lives on the draft vocabulary only"
        want = torch.softmax(logits[j] / t, -1)
        assert torch.allclose(q[[4, 1, 5]], want)
        assert not probs[j, 0].any()
    # all greedy: no temperatures at all
    assert ctx.pick(logits, batch_rows, None, None, J, 0).tolist() == [1, 4, 5]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_row_with_non_finite_logits_drafts_nothing_and_is_counted(bad):
    """torch.multinomial raises on NaN and inf: a damaged head or an overflowing draft must not
    take the engine down. The row's token is NO_DRAFT (its round ends), the other rows draft
    as before, and the stats count it."""
    ctx = context(vocab_ids=torch.tensor([4, 1, 5]))
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, bad, 0.0], [0.0, 0.0, 9.0], [bad] * 3])
    temps = torch.tensor([0.0, 0.5, 1.0, 0.0, 2.0])
    batch_rows, J = torch.tensor([3, 1, 2, 4]), torch.arange(4)
    probs = torch.zeros(4, 1, 6)
    got = ctx.pick(logits, batch_rows, temps, probs, J, step=0).tolist()
    assert got[0] == 1 and got[2] in (4, 1, 5)
    assert got[1] == NO_DRAFT and got[3] == NO_DRAFT
    assert ctx.stats.invalid_draft_rows == 2
    assert torch.isfinite(probs).all()
    # all greedy: the argmax of a NaN row would be a token; it is NO_DRAFT too
    assert ctx.pick(logits, batch_rows, None, None, J, 0).tolist() == [1, NO_DRAFT, 5, NO_DRAFT]


def test_finite_rows_keeps_finite_rows_as_they_are():
    logits = torch.tensor([[1.0, -2.0], [float("nan"), 0.0]])
    valid, clean, invalid = finite_rows(logits)
    assert valid.tolist() == [True, False] and invalid == 1
    assert torch.equal(clean[0], logits[0]) and torch.equal(clean[1], torch.zeros(2))


def test_sampled_drafts_repeat_for_the_same_seed():
    logits = torch.randn(4, 6)
    temps = torch.ones(4)

    def draws(seed):
        probs = torch.zeros(4, 1, 6)
        return context(seed=seed).pick(logits, torch.arange(4), temps, probs, torch.arange(4), 0)

    assert torch.equal(draws(7), draws(7))


def test_count_rounds_counts_every_row_and_the_plans_that_drafted():
    ctx = context()
    plan = LayerPlan.prefix(4, 2)
    ctx.count_rounds([[5, 6], [], [7]], [0, 1, 2], [plan, plan, plan])
    st = ctx.stats
    assert st.draft_length_hist == {2: 1, 0: 1, 1: 1}
    assert st.draft_rounds == 2
    assert sum(st.plans.values()) == 2
    assert st.skipped_attn == 2 * (plan.num_layers - sum(plan.attn))


class Exits:
    """A Cascade policy stand-in: exits at layers 8 and 16 with fixed acceptance; the walk may go
    to the last exit while the prefix probability is at least 0.5, to the first down to 0.2."""

    cascade = (SimpleNamespace(layer=8), SimpleNamespace(layer=16))
    lossy = False

    def walk_cap(self, state, prefix: float) -> int:
        return 1 if prefix >= 0.5 else 0 if prefix >= 0.2 else -1

    def acceptance(self, state, e: int) -> float:
        return (0.6, 0.9)[e]


def test_walk_caps_follow_the_previous_exit_and_the_prefix_probability():
    walks = CascadeWalks(Exits(), [None, None])
    alive, caps = walks.caps([0, 1])
    assert (alive, caps) == ([0, 1], [1, 1])
    walks.record(alive, caps, [0, 1], EngineStats())  # row 0 exits at 8, row 1 at 16
    alive, caps = walks.caps([0, 1])
    # row 0: no deeper than its last exit (0), prefix 0.6; row 1: prefix 0.9, exit 1 allowed
    assert (alive, caps) == ([0, 1], [0, 1])
    walks.record(alive, caps, [0, -1], EngineStats())  # row 1 found no confident exit
    assert walks.prefix[0] == pytest.approx(0.36)
    for _ in range(2):  # 0.36, then 0.216: the first exit only
        alive, caps = walks.caps([0])
        assert (alive, caps) == ([0], [0])
        walks.record(alive, caps, [0], EngineStats())
    assert walks.caps([0]) == ([], [])  # 0.1296 < 0.2: the round ends
    assert walks.steps == [[(1, 0), (0, 0), (0, 0), (0, 0)], [(1, 1), (1, -1)]]


def test_cascade_feedback_carries_the_round_steps_and_counts_accepted_exits():
    ctx = context()
    ctx.policy = Exits()
    drafter = CascadeDrafter(ctx)
    drafter.round_exits["a"] = [(1, 0), (0, 0), (0, 0)]
    fb = Feedback(3, 2, 10)
    drafter.verified("a", 3, 2, [1, 2, 3], fb)
    assert fb.cascade_steps == [(1, 0), (0, 0), (0, 0)]
    assert ctx.stats.exit_accepted == {8: 2}
    fb = Feedback(0, 0, 11)  # no round of its own this step
    drafter.verified("a", 0, 0, [4], fb)
    assert fb.cascade_steps is None


def test_the_drafting_peak_is_allocated_for_the_start_up_profile():
    """vLLM runs no dummy step of a custom drafter: the proposer allocates its largest step
    (all sampled, max_num_seqs requests, k drafts each) while vLLM's profile measures."""
    from vllm_selfspec.engine.proposer import SelfSpecProposer

    fake = SimpleNamespace(
        executor=SimpleNamespace(vocab_ids=torch.arange(32)),
        info=SimpleNamespace(vocab_size=100, hidden_size=8),
        vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4)),
        k=3,
        capture_layers=[2, 5],
        capture_tokens=16,
        runner=SimpleNamespace(device=torch.device("cpu")),
    )
    got = SelfSpecProposer.reserve_peak_memory(fake)
    floats = 4 * 3 * 100 + 12 * 100 + 2 * 4 * 32 + 4 * 100 + 2 * 64 * 8 + 2 * 64 * 32
    assert got == 4 * floats

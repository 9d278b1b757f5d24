"""The goodput controller and context lookup in a real engine: greedy parity with vanilla vLLM
(prefix caching, chunked prefill, batch 1 and 8) while they draft, and what they report.

``auto`` (lookup + the self-drafter this model has what it needs for, under the controller)
drafts from the context where it repeats, which code does; the canary LayerSkip config under the
controller drafts only while the controller measures (its warm-up and probes) and is cut after.
"""

from __future__ import annotations

import pytest

import vllm_selfspec
from selfspec_testing import engine, greedy_one_by_one_and_together, rotate_layerskip_plans
from vllm_selfspec.config import auto_method
from vllm_selfspec.goodput import AcceptanceTracker
from vllm_selfspec.vocab import cached_generations

pytestmark = pytest.mark.engine

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'import numpy as np\n\ndef softmax(x):\n    """Numerically stable softmax."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "Summarise the following text.\n"
    + " ".join(
        f"Paragraph {i}: the river rises in the hills and flows to the sea." for i in range(20)
    ),
    "The capital of France is",
]
SETTINGS = dict(
    max_num_seqs=8,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
    max_num_batched_tokens=128,
)
MAX_TOKENS = 48


def _run(llm) -> dict[str, list[list[int]]]:
    return greedy_one_by_one_and_together(llm, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def vanilla(model_path):
    with engine(model_path, **SETTINGS) as llm:
        return _run(llm)


def _check_parity(vanilla, out, name):
    for bs in ("bs1", "bs8"):
        for i, (want, got) in enumerate(zip(vanilla[bs], out[bs])):
            assert got == want, f"{name} {bs} prompt {i}: tokens differ from vanilla vLLM"


def test_auto_keeps_parity_and_drafts_from_the_context(model_path, vanilla, monkeypatch):
    # each request's acceptance rates (its self-drafts', its lookup drafts') are made once and
    # kept: a policy without per-request state (feature, layerskip: None) once had them made
    # afresh every step, so the controller only ever saw batch-wide rates
    rates = []
    new_state = AcceptanceTracker.new_state
    monkeypatch.setattr(
        AcceptanceTracker, "new_state", lambda self: rates.append(1) or new_state(self)
    )
    with engine(model_path, speculative_config={"method": "auto"}, **SETTINGS) as llm:
        # the drafts ride with each step's output (plugin.py, patches 5 and 6): vLLM's
        # take_draft_token_ids RPC, one round trip to the worker per step, is never sent
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        rpcs = []
        take = executor.take_draft_token_ids
        executor.take_draft_token_ids = lambda: rpcs.append(1) or take()
        out = _run(llm)
        stats = vllm_selfspec.get_stats(llm)
    _check_parity(vanilla, out, "auto")
    requests = 2 * len(PROMPTS)  # one by one, then together
    assert 0 < len(rates) <= 2 * requests, f"{len(rates)} rate states for {requests} requests"
    assert not rpcs, f"{len(rpcs)} take_draft_token_ids RPCs"
    # the self-drafter auto chose for this model: LayerSkip unless trained heads are cached
    assert stats["policy"]["method"] == auto_method(model_path)[0]
    src = stats["token_sources"]
    assert stats["lookup_drafted_tokens"] > 0, src
    if stats["policy"]["method"] == "feature":
        # feature heads (cached here) draft with no decoder layer: they compete with lookup for
        # each step, and either may take the accepted tokens
        assert src["lookup"] + src["self_draft"] > 0, src
    else:  # a self-drafter that runs decoder layers rarely pays on a CPU: lookup does the work
        assert src["lookup"] > 0, src
    assert src["lookup"] + src["self_draft"] + src["target"] == stats["generated_tokens"]
    assert stats["costs"]["target_forward_s"] is not None


def test_lookup_drafts_from_the_models_own_generations(model_path, vanilla):
    """The datastore (the embedded model's corpus generations, which ``make model`` keeps with
    its draft-vocabulary map) drafts where a request's own context has only a shorter match;
    with other requests' outputs off, every shared-index token accepted came from it."""
    assert cached_generations(model_path) is not None, "run `make model` (build-vocab)"
    spec = {"method": "auto", "lookup": {"shared": False}}
    with engine(model_path, speculative_config=spec, **SETTINGS) as llm:
        out = _run(llm)
        stats = vllm_selfspec.get_stats(llm)
    _check_parity(vanilla, out, "auto with the datastore alone")
    assert stats["lookup_shared_accepted_tokens"] > 0, stats["token_sources"]
    assert stats["lookup_shared_accepted_tokens"] <= stats["lookup_accepted_tokens"]


def test_controller_cuts_self_drafts_and_keeps_parity(model_path, vanilla):
    """The full-model canary drafts at the cost of whole steps: the controller lets it draft
    while it measures, then cuts it; every draft it let through is accepted."""
    spec = {"method": "layerskip", "exit_layer": 30, "num_speculative_tokens": 3, "goodput": True}
    with engine(model_path, speculative_config=spec, **SETTINGS) as llm:
        out = _run(llm)
        stats = vllm_selfspec.get_stats(llm)
    _check_parity(vanilla, out, "canary under the controller")
    assert stats["drafted_tokens"] > 0, "the controller never let the drafter run"
    assert stats["accepted_tokens"] == stats["drafted_tokens"]
    assert stats["controller_cut_tokens"] > 0 and stats["controller_plain_steps"] > 0
    assert stats["time_s"]["controller"] > 0


def test_requests_with_different_plans_draft_in_one_forward(model_path, vanilla, monkeypatch):
    """Requests whose plans differ (a deep and a shallow exit, a skip set) share each draft
    step's forward (PlanExecutor.run_mixed): one forward per draft step, not one per plan."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the patches reach the worker
    plans = rotate_layerskip_plans(monkeypatch)
    spec = {"method": "layerskip", "exit_layer": 30, "num_speculative_tokens": 3}
    with engine(model_path, speculative_config=spec, **SETTINGS) as llm:
        out = _run(llm)
        stats = vllm_selfspec.get_stats(llm)
    _check_parity(vanilla, out, "mixed plans")
    assert len(stats["plan_hist"]) == len(plans), stats["plan_hist"]
    assert 0 < stats["accepted_tokens"] < stats["drafted_tokens"]
    # every round drafts 3 tokens: 3 forwards per engine step, whatever the plans in the batch
    assert stats["draft_forwards"] <= 3 * stats["steps"]


def test_a_tenant_never_drafts_from_another_tenants_outputs(model_path):
    """Context lookup's shared outputs are per tenant (``"shared": "tenant"``, the default): a
    request of tenant b repeating tenant a's request drafts nothing from a's output, while a
    second request of a drafts from it. Acceptance of a shared draft would otherwise tell b
    that a's output held those tokens. The datastore is off, so every shared draft is an
    output's."""
    from vllm import SamplingParams

    # every lookup draft verified (no controller): what is drafted does not depend on timing
    spec = {"method": "auto", "goodput": False, "lookup": {"datastore": None}}
    prompt = PROMPTS[0]

    def run(llm, tenant):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, extra_args=tenant)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        return list(out), vllm_selfspec.get_stats(llm, reset=True)

    with engine(model_path, speculative_config=spec, **SETTINGS) as llm:
        first, _ = run(llm, {"selfspec_tenant": "a"})
        other, b = run(llm, {"selfspec_tenant": "b"})
        untagged, none = run(llm, None)
        same, a = run(llm, {"selfspec_tenant": "a"})
    assert first == other == untagged == same
    assert a["lookup_shared_accepted_tokens"] > 0, "the same tenant drafts from its outputs"
    assert b["lookup_shared_accepted_tokens"] == 0
    assert none["lookup_shared_accepted_tokens"] == 0
    # the last request's index goes at the engine's next step (when vLLM removes the finished
    # request); the three before it left theirs and their outputs, one tenant each
    index = a["lookup_index"]
    assert index["requests"] == 1 and index["request_bytes"] > 0 and index["shared_bytes"] > 0
    assert index["shared_tenants"] == 3 and index["shared_output_tokens"] >= 3 * len(first)

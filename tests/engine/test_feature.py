"""Feature heads in the engine: greedy output equals vanilla vLLM's, token for token, with drafts
made and accepted.

The model is a tiny random-weight Llama whose every decoder layer passes the residual stream
through (attention output and MLP down projections zeroed): its next token is a function of the
current one alone, its LM head on the token's embedding (untied, so a random function: outputs
walk through varied tokens). A feature head at its initialisation (adapter zero: the raw LM head
on the embedding) then drafts exactly the model's next tokens, so nearly every draft is accepted
on any machine, while the test runs the real path: the feature rows out of vLLM's logits rows,
the head on the embedding and the final-layer output, the controller. A drafter that read the
wrong token (the one before the last sampled) loses that acceptance. Trained heads are measured
by the benchmarks."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

import vllm_selfspec
from selfspec_testing import engine, save_passthrough_top, save_tiny_model, token_ids
from vllm_selfspec.heads import HeadSet, identity_from_hf, make_head, save_heads

pytestmark = pytest.mark.engine
VOCAB = 512
KW = dict(
    skip_tokenizer_init=True,
    max_model_len=256,
    max_num_seqs=8,
    kv_cache_memory_bytes=1 << 27,
)
PROMPTS = [
    {"prompt_token_ids": [(7 * i + 3 * j) % VOCAB for j in range(3 + 5 * i)]} for i in range(6)
]


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    """Engine core and worker in the test process (a tiny model's engine starts in ~10 s)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("feature-model")
    return save_passthrough_top(save_tiny_model(tmp / "random", VOCAB), tmp / "bigram", keep=0)


@pytest.fixture(scope="module")
def feature_heads(model_path, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    identity = identity_from_hf(AutoModelForCausalLM.from_pretrained(model_path))
    heads = {0: make_head("feature", identity.hidden_size)}
    return save_heads(
        tmp_path_factory.mktemp("feature") / "heads",
        HeadSet("feature", heads, identity),
        training={"built": "test"},
    )


def _run(model_path, spec):
    sp = SamplingParams(temperature=0, max_tokens=24)
    with engine(model_path, speculative_config=spec, **KW) as llm:
        out = token_ids(llm.generate(PROMPTS, sp, use_tqdm=False))
        return out, None if spec is None else vllm_selfspec.get_stats(llm)


@pytest.mark.parametrize(
    "options",
    [{"goodput": False}, {"goodput": True, "num_speculative_tokens": 4}],
    ids=["own-lengths", "controller"],
)
def test_feature_heads_keep_parity_and_draft(model_path, feature_heads, options):
    vanilla, _ = _run(model_path, None)
    assert all(len(set(t)) > 3 for t in vanilla)  # outputs walk, they do not repeat one token
    spec = {"method": "feature", "heads": str(feature_heads), "draft_vocab_size": None, **options}
    got, stats = _run(model_path, spec)
    assert got == vanilla
    assert stats["drafted_tokens"] > 0 and stats["draft_forwards"] > 0, stats
    # the head drafts the model's own next tokens here: nearly all are accepted
    assert stats["accepted_tokens"] >= 0.9 * stats["drafted_tokens"], stats
    assert stats["draft_layers"] == 0  # no decoder layer ran for a draft

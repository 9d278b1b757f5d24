"""What vLLM's users send beside plain greedy requests: each gives vanilla vLLM's result.

A vanilla engine and a self-speculative one (LayerSkip, exit 24, 2 drafts every round: most of
them rejected, so every parameter meets accepted and rejected drafts) run the same requests,
with a KV cache too small for them, so that the scheduler preempts and recomputes requests:

* one mixed batch of every case of ``CASES`` (penalties, stop strings and tokens, logprobs,
  ``n > 1``, a seed, JSON-schema / regex / choice structured output, long requests that get
  preempted, ...): the same tokens, text, finish reasons and logprobs as vanilla's;
* the seeded request once more on its own: a seed reproduces its output whatever else runs
  (sampled requests with a seed draft nothing, ``engine/proposer.py``; with drafts it changed
  from run to run).

``min_p`` and ``logit_bias`` are refused by vLLM itself for every speculative method (a 400 from
the server: ``test_serve.py``); the test checks that they still are.

The suite runs the mixed batch with LayerSkip (the request handling is the method-agnostic
proposer's). ``SELFSPEC_ALL_METHODS=1`` runs it with the other methods too (``METHODS``: 1-4
minutes each; AdaDecode's and Cascade's heads built, not trained).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from scipy.stats import chi2_contingency
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams

import vllm_selfspec
from selfspec_testing import engine, save_built_heads

pytestmark = pytest.mark.engine

SPEC = {"method": "layerskip", "exit_layer": 24, "num_speculative_tokens": 2}
PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time", "Dear Sir,"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
}
#: long requests for a KV cache of 10 blocks of 32 tokens: the scheduler preempts them
LONG_PROMPTS = [
    "Once upon a time",
    "The history of Rome",
    "def quicksort(xs):",
    "List of fruits:",
    "Why is the sky blue?",
    "In a small village",
]
ENGINE = dict(  # 46080 bytes a token: 30 layers x K and V x 3 KV heads x 64 x 4 bytes
    max_num_seqs=8, max_model_len=256, block_size=32, kv_cache_memory_bytes=10 * 32 * 46080
)
JSON_PROMPT = "Give me a JSON record for Ada Lovelace:"
GREEDY = dict(temperature=0, max_tokens=24)
SEEDED = SamplingParams(temperature=0.8, max_tokens=24, seed=1234)
#: name -> (sampling parameters, prompts)
CASES = {
    "greedy": (SamplingParams(**GREEDY), PROMPTS),
    "repetition_penalty": (SamplingParams(**GREEDY, repetition_penalty=1.3), PROMPTS),
    "presence_frequency": (
        SamplingParams(**GREEDY, presence_penalty=1.0, frequency_penalty=0.7),
        PROMPTS,
    ),
    "top_k_top_p": (SamplingParams(**GREEDY, top_k=5, top_p=0.5), PROMPTS),
    "bad_words": (SamplingParams(**GREEDY, bad_words=[" the", " a"]), PROMPTS),
    "stop_strings": (SamplingParams(**GREEDY, stop=[".", "\n\n"]), PROMPTS),
    "stop_included": (
        SamplingParams(**GREEDY, stop=["."], include_stop_str_in_output=True),
        PROMPTS,
    ),
    "stop_token_ids": (SamplingParams(**GREEDY, stop_token_ids=[198]), PROMPTS),  # "\n"
    "max_tokens_1": (SamplingParams(temperature=0, max_tokens=1), PROMPTS),
    "ignore_eos": (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), PROMPTS),
    "min_tokens": (SamplingParams(temperature=0, max_tokens=32, min_tokens=28), PROMPTS),
    "logprobs": (SamplingParams(**GREEDY, logprobs=5, prompt_logprobs=3), PROMPTS),
    "seed": (SEEDED, PROMPTS[:1]),
    "seed_n3": (SamplingParams(temperature=0.8, max_tokens=16, n=3, seed=5), PROMPTS[:2]),
    "json_schema": (
        SamplingParams(
            temperature=0, max_tokens=96, structured_outputs=StructuredOutputsParams(json=SCHEMA)
        ),
        [JSON_PROMPT, "Describe a programmer as JSON:"],
    ),
    "regex": (
        SamplingParams(
            **GREEDY,
            structured_outputs=StructuredOutputsParams(
                regex=r"(Monday|Friday)( [0-9]{2}:[0-9]{2})?"
            ),
        ),
        ["The meeting is on", "Which day? Answer:"],
    ),
    "preempted": (SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), LONG_PROMPTS),
    "choice": (
        SamplingParams(
            **GREEDY, structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])
        ),
        ["Is the sky blue? Answer:", "Is water dry? Answer:"],
    ),
}
#: logprobs are the target's: equal up to float32 rounding of differently shaped forwards
LOGPROB_TOL = 1e-4


def _logprobs(entries) -> list:
    return [None if e is None else {t: v.logprob for t, v in e.items()} for e in entries or []]


def _outcome(req) -> dict:
    return {
        "outputs": [
            (list(c.token_ids), c.text, c.finish_reason, _logprobs(c.logprobs)) for c in req.outputs
        ],
        "prompt_logprobs": _logprobs(req.prompt_logprobs),
    }


def _run(llm) -> dict:
    prompts, params, names = [], [], []
    for name, (sp, ps) in CASES.items():
        prompts += ps
        params += [sp] * len(ps)
        names += [name] * len(ps)
    together: dict[str, list] = {name: [] for name in CASES}
    for name, req in zip(names, llm.generate(prompts, params, use_tqdm=False)):
        together[name].append(_outcome(req))
    alone = _outcome(llm.generate(PROMPTS[:1], SEEDED, use_tqdm=False)[0])
    preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    return {"together": together, "seed_alone": alone, "preemptions": preemptions}


def _assert_same(got, want, where: str) -> None:
    assert len(got["outputs"]) == len(want["outputs"]), where
    for (tok, text, fin, lps), (wtok, wtext, wfin, wlps) in zip(got["outputs"], want["outputs"]):
        assert (tok, text, fin) == (wtok, wtext, wfin), where
        _assert_logprobs_close(lps, wlps, where)
    _assert_logprobs_close(got["prompt_logprobs"], want["prompt_logprobs"], where + " (prompt)")


def _assert_logprobs_close(got, want, where: str) -> None:
    assert len(got) == len(want), where
    for g, w in zip(got, want):
        if w is None:
            assert g is None, where
            continue
        assert g.keys() == w.keys(), where
        assert all(abs(g[t] - w[t]) <= LOGPROB_TOL for t in w), where


@pytest.fixture(scope="module")
def vanilla(model_path):
    with engine(model_path, **ENGINE) as llm:
        return _run(llm)


#: method -> its config (``heads`` filled in with built heads where the method needs them).
#: DEL is not here: on this model's raw exits its policy drafted 22 tokens and had none accepted
#: in this batch (exits 8/16/24), or drafted none (24/28), so the comparison would prove nothing;
#: its parity with drafts accepted is tested on a model built for it (test_del_heads.py).
METHODS = {
    "layerskip": SPEC,
    "knapspec": {"method": "knapspec", "num_speculative_tokens": 3, "interval": 8},
    "adadecode": {"method": "adadecode", "threshold": 0.4, "num_speculative_tokens": 3},
    "cascade": {"method": "cascade", "num_speculative_tokens": 3, "goodput": False},
    "auto": {"method": "auto"},
}
RUN_METHODS = list(METHODS) if os.environ.get("SELFSPEC_ALL_METHODS") == "1" else ["layerskip"]


def _spec(method: str, model_path: str, tmp_path) -> dict:
    spec = dict(METHODS[method])
    if method in ("adadecode", "cascade"):
        spec["heads"] = save_built_heads(model_path, tmp_path / "heads", method, (8, 16, 24))
    return spec


@pytest.mark.parametrize("method", RUN_METHODS)
def test_request_parameters_give_vanillas_output(model_path, vanilla, method, tmp_path):
    spec = _spec(method, model_path, tmp_path)
    with engine(model_path, speculative_config=spec, **ENGINE) as llm:
        got = _run(llm)
        stats = vllm_selfspec.get_stats(llm)
        for refused in (SamplingParams(min_p=0.1), SamplingParams(logit_bias={11: 1.0})):
            with pytest.raises(VLLMValidationError, match="not yet supported with speculative"):
                llm.generate(PROMPTS[:1], refused, use_tqdm=False)
    assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] > 0, (
        "nothing drafted or accepted: the comparison proved nothing"
    )
    assert stats["accepted_tokens"] < stats["drafted_tokens"], "no draft was rejected"
    assert stats["seeded_rounds"] > 0
    assert got["preemptions"] > 0, "the KV cache held every request: nothing was preempted"
    for name in CASES:
        for i, (g, w) in enumerate(zip(got["together"][name], vanilla["together"][name])):
            _assert_same(g, w, f"{name}, prompt {i}")
    # a seed reproduces the request's output whatever runs beside it, as in vanilla vLLM
    _assert_same(got["seed_alone"], vanilla["seed_alone"], "seeded request alone")
    _assert_same(got["seed_alone"], got["together"]["seed"][0], "seeded request in the batch")
    # structured output is valid where it finished
    for out in got["together"]["json_schema"]:
        tok, text, fin, _ = out["outputs"][0]
        if fin == "stop":
            assert set(json.loads(text)) >= set(SCHEMA["required"])


#: sampled structured output (T = 1): N requests per grammar; the choice made, and the character
#: at each position of a phone number, must follow vanilla's distribution. vLLM's grammar cuts
#: drafts at the first token it refuses (this CPU build's synchronous scheduler drops the rest;
#: vLLM's asynchronous one pads them with -1, whose q rows ``verified_q`` zeroes: a unit test).
#: The phone number is where drafts are made and accepted (each digit a token the exit predicts
#: as a digit); most drafts after the colour prompt are refused by the grammar.
SAMPLED_N, ALPHA = 120, 1e-3
SAMPLED_SPEC = {**SPEC, "goodput": False}  # drafts every round
SAMPLED_ENGINE = dict(max_num_seqs=64, max_model_len=256)
COLOURS = ["red", "green", "blue", "yellow", "purple"]
SAMPLED_GRAMMARS = {
    "choice": (
        StructuredOutputsParams(choice=COLOURS),
        "My favourite colour is",
    ),
    "regex": (StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"), "Call me at 555-"),
}


def _sample_grammars(llm) -> dict[str, list[str]]:
    prompts, params = [], []
    for so, prompt in SAMPLED_GRAMMARS.values():
        sp = SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=so)
        prompts += [prompt] * SAMPLED_N
        params += [sp] * SAMPLED_N
    texts = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    return {
        name: texts[i * SAMPLED_N : (i + 1) * SAMPLED_N] for i, name in enumerate(SAMPLED_GRAMMARS)
    }


def _pvalue(a: list[str], b: list[str]) -> float:
    values = sorted(set(a) | set(b))
    table = np.array([[x.count(v) for v in values] for x in (a, b)])
    return chi2_contingency(table)[1] if len(values) > 1 else 1.0


def test_sampled_structured_output_keeps_the_distribution(model_path):
    with engine(model_path, **SAMPLED_ENGINE) as llm:
        want = _sample_grammars(llm)
    with engine(model_path, speculative_config=SAMPLED_SPEC, **SAMPLED_ENGINE) as llm:
        got = _sample_grammars(llm)
        stats = vllm_selfspec.get_stats(llm)
    assert stats["drafted_tokens"] > 100 and stats["accepted_tokens"] > 50, stats
    assert all(t in COLOURS for t in want["choice"] + got["choice"])
    assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) for t in want["regex"] + got["regex"])
    assert len(set(want["choice"])) > 1, "one choice only: the test could not tell"
    p = _pvalue(want["choice"], got["choice"])
    assert p > ALPHA, f"choice: sampled distribution differs from vanilla's (p={p:.2e})"
    for pos in range(8):
        p = _pvalue([t[pos] for t in want["regex"]], [t[pos] for t in got["regex"]])
        assert p > ALPHA, f"regex character {pos}: distribution differs from vanilla's (p={p:.2e})"

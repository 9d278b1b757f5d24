"""Session fixtures of the serving tests: one OpenAI server with a selfspec example config, and
vanilla vLLM's greedy references on the load-test prompts (offline, the same engine settings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_selfspec import config
from vllm_selfspec.tools.loadtest import cli_args, engine_kw
from vllm_selfspec.tools.serving import Server

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


#: the served engine's settings, eager as every engine test's (selfspec_testing.ENGINE_KW)
ENGINE_KW = engine_kw(eager=True)


@pytest.fixture(autouse=True)
def policies_draft_their_own_lengths(monkeypatch):
    """The engine tests check drafting mechanisms (parity, sampling, TP, ...). On this CPU the
    goodput controller rightly turns most self-drafting off, which would leave them nothing to
    check, so configs built in this process default to ``"goodput": false`` (each policy's own
    draft lengths). The controller's engine tests set ``"goodput": true`` explicitly; engines in
    other processes (the served example configs, Ray actors) use the product default unless
    their config says otherwise."""
    monkeypatch.setitem(config.COMMON_OPTIONS, "goodput", False)


@pytest.fixture(scope="session")
def served(model_path, tmp_path_factory):
    """`vllm serve` (vLLM's OpenAI server) on 127.0.0.1 with examples/selfspec-layerskip.json
    and ``"goodput": false``: the metrics and load tests need drafts in every round, which the
    controller would rightly stop on this CPU."""
    tmp = tmp_path_factory.mktemp("serve")
    log = tmp / "server.log"
    config = tmp / "selfspec.json"
    spec = json.loads((EXAMPLES / "selfspec-layerskip.json").read_text())
    config.write_text(json.dumps({**spec, "goodput": False}))
    args = [
        *cli_args(ENGINE_KW),
        "--served-model-name",
        "smollm2",
        "--speculative-config",
        str(config),
    ]
    with Server(model_path, args, log_path=log) as srv:
        yield srv


@pytest.fixture(scope="session")
def vanilla_refs(model_path):
    from selfspec_testing import engine
    from vllm_selfspec.tools.loadtest import greedy_references

    with engine(model_path, **ENGINE_KW) as llm:
        return greedy_references(llm)

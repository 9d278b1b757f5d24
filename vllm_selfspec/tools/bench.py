"""Benchmark harness: vanilla vs. speculative methods on the same prompts and engine settings.

    vllm-selfspec bench --methods vanilla,ngram,layerskip --prompts humaneval --num-prompts 16 \
        --max-tokens 128 --batch-size 8 --repeats 3 --out bench-out
    python -m vllm_selfspec.tools.bench ...   (same arguments)

Each method runs in its own subprocess and engine, with greedy sampling. The methods run in
groups of ``--group-size``, each group live at once beside its own vanilla engine, and their timed
repeats are *interleaved*: a repeat runs the prompts in slices of twice the batch size
(``--slice-size``), each slice by vanilla and each method of the group in turn (with a pause
between runs so an idle engine's polling has stopped; each repeat starts with the next engine of
the group, so none always runs first). Before its repeats, each engine runs the whole workload
once untimed (the warm-up; the engines of a group load together but warm up one at a time), and
each timed run starts from an empty prefix cache. A method's speedup is the median over repeats of its
tokens/s over vanilla's tokens/s of the same repeat, so a machine whose speed drifts within
seconds to minutes (docs/performance.md, "How a figure is made") moves both alike.
Each slice also gives a paired ratio of its own; their median and a 90% bootstrap interval of it
(``median_interval``) are the run's noise band beside the speedup.
Writes ``OUT/results.json``, ``OUT/results.md`` and ``OUT/speedup.png``; each worker's log goes
to ``OUT/logs/<method>.log`` (vanilla's per group: ``vanilla-g<i>.log``).
"""

from __future__ import annotations

# vLLM, torch, transformers, matplotlib, selfspec's config (its policies import torch) and compat
# (importlib.metadata) are imported inside functions: the CLI, the load test and the tests import
# this module for its arguments and engine settings, and only a method's worker process runs vLLM
import argparse
import contextlib
import json
import os
import random
import re
import select
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import forget_outputs, get_stats
from ..checkpoints import resolve_model
from . import quality
from .prompts import load_prompts

#: method name -> speculative config (None: no speculation).
#: Any other selfspec method (config.methods(): the policies and "auto") or vLLM method
#: (compat.vllm_spec_methods(): "suffix", "ngram", ...) gets {"method": name}.
METHOD_DEFAULTS: dict[str, dict | None] = {
    "vanilla": None,
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    },
    # vLLM's suffix decoding (ArcticInference's suffix trees) with vLLM's defaults: needs the
    # module arctic_inference.suffix_decoding (scripts/install_suffix_decoding.sh; make does it)
    "suffix": {"method": "suffix"},
    # LS(E-γ) two layers short of the full model: E = 28 of the embedded model's 30
    # (docs/methods.md, "layerskip"; method_configs)
    "layerskip": {"method": "layerskip", "num_speculative_tokens": 1},
}
#: a label's own engine settings, in its --method-config entry: {"vanilla-eager": {"method":
#: "vanilla", "engine": {"enforce_eager": true}}} runs an eager vanilla beside compiled engines
ENGINE_KEY = "engine"
#: the default LayerSkip exit: this many layers short of the model's last
LAYERSKIP_SHORT_OF_FULL = 2
#: engine settings shared by every method (the load test's and the engine tests' derive from them)
#: in vLLM's default mode, as people run it: compiled (torch.compile; on CUDA also CUDA graphs).
#: ``engine_args(eager=True)`` adds ``enforce_eager`` (the bench's ``--eager``).
#: the KV cache is sized in bytes (2 GiB: ~44k tokens of the embedded model), not as a share of
#: the free memory, so a group of engines fits in memory at once
ENGINE_ARGS = dict(
    dtype="float32",
    max_model_len=2048,
    kv_cache_memory_bytes=2 << 30,
    seed=0,
    disable_log_stats=False,
)


def engine_args(eager: bool = False) -> dict:
    """``ENGINE_ARGS`` in vLLM's default (compiled) mode, or eager with ``eager``."""
    return {**ENGINE_ARGS, "enforce_eager": bool(eager)}


def mode_name(eager: bool) -> str:
    """How results name the engines' mode."""
    return "eager" if eager else "compiled (vLLM's default)"


#: what a timed run reports, summed per repeat: its wall time and tokens, those of its decode
#: steps at a full batch (``full_batch_decode``), and its engine steps (those that emitted tokens:
#: a closed batch gains from drafts only where they remove steps, see ``summarize``)
RUN_FIELDS = ("wall_s", "tokens", "full_s", "full_tokens", "steps")
#: seconds between two timed runs: an idle vLLM worker polls its queue for 1 s after its last
#: step (shm_broadcast's busy loop) on the core the next engine's worker is pinned to
SETTLE_S = 1.2
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--methods",
        default="vanilla,ngram,layerskip",
        help="comma-separated methods; vanilla always runs, first, as the reference",
    )
    parser.add_argument(
        "--prompts",
        default="humaneval",
        help='"humaneval" (raw completion), "humaneval-chat" (chat-templated, '
        'asked to complete the function), "chat" (built-in chat set), '
        '"passages" (work on given texts, multi-turn dialogues), "edits" (edits, rewrites '
        'and reformatting of a given text or code) or a JSONL file of {"prompt": ...} / '
        '{"messages": [...]} lines',
    )
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="the engine's max_num_seqs")
    parser.add_argument("--repeats", type=int, default=3, help="timed generate() calls per method")
    parser.add_argument(
        "--group-size",
        type=int,
        default=3,
        help="methods live at once beside a vanilla engine, their repeats "
        "interleaved (each engine needs ~2.5 GB of memory)",
    )
    parser.add_argument(
        "--slice-size",
        type=int,
        default=None,
        help="prompts per timed slice, each a closed batch run by every engine in turn "
        "(default twice the batch size; several times it: a server with a standing queue)",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="run every engine eagerly (enforce_eager); default: vLLM's default mode, "
        "compiled (torch.compile, and CUDA graphs on CUDA), as people run vLLM",
    )
    parser.add_argument(
        "--engine-args",
        default=None,
        help="JSON engine settings for every engine, over the bench's own (ENGINE_ARGS), e.g. "
        '\'{"dtype": "bfloat16", "gpu_memory_utilization": 0.2}\' on a GPU (vLLM checks at '
        "start-up that each engine's share of the GPU is free)",
    )
    parser.add_argument(
        "--frame-stack-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="install a cache of freed frame-stack chunks in every engine's processes "
        "(vllm_selfspec/frame_stack.py: CPython 3.11-3.14 otherwise maps and unmaps a chunk on "
        "each call across a chunk's end, and whether an engine's steps do is an accident of its "
        "call depth); built with the system's C compiler, vanilla and every method alike",
    )
    parser.add_argument("--out", default="bench-out", help="output directory")
    parser.add_argument("--model", default=None, help="HF checkpoint (default: the embedded model)")
    parser.add_argument(
        "--quality",
        action="store_true",
        help="also score every method's output against vanilla's (token "
        "agreement, ROUGE-L; HumanEval pass@1 with --prompts humaneval[-chat]): "
        'for lossy methods such as cascade with "lossy": true',
    )
    parser.add_argument(
        "--method-config",
        default=None,
        help='JSON overrides per method, e.g. \'{"layerskip": {"exit_layer": '
        '20}}\'; a label with a "method" key defines a variant: --methods '
        'ls20 --method-config \'{"ls20": {"method": "layerskip", '
        '"exit_layer": 20}}\'',
    )


def method_configs(
    methods: str, overrides: str | None, num_layers: int = 30
) -> dict[str, dict | None]:
    """Ordered {method: speculative config} for a ``num_layers``-layer model, vanilla first,
    overrides merged in."""
    from ..config import methods as selfspec_methods

    names = ["vanilla"] + [m.strip() for m in methods.split(",") if m.strip()]
    extra = json_object(overrides, "--method-config", "{method: {option: value}}")
    configs: dict[str, dict | None] = {}
    for name in dict.fromkeys(names):
        # a label with its own "method" in --method-config is a variant: ls20 -> layerskip E=20
        base = (
            extra.get(name, {}).get("method", name) if isinstance(extra.get(name), dict) else name
        )
        if base in METHOD_DEFAULTS:
            configs[name] = None if METHOD_DEFAULTS[base] is None else dict(METHOD_DEFAULTS[base])
            if base == "layerskip":
                configs[name]["exit_layer"] = max(1, num_layers - LAYERSKIP_SHORT_OF_FULL)
        elif base in selfspec_methods() or base in _vllm_methods():
            configs[name] = {"method": base}
        else:
            known = sorted(set(METHOD_DEFAULTS) | set(selfspec_methods()) | set(_vllm_methods()))
            raise ValueError(
                f"unknown method {name!r}; known methods: {', '.join(known)} "
                f'(or a label defined in --method-config with a "method" key)'
            )
    for name, opts in extra.items():
        if name not in configs:
            raise ValueError(f"--method-config names {name!r}, which is not in --methods")
        if configs[name] is None and isinstance(opts, dict) and opts.get("method") == "vanilla":
            # a second vanilla engine: an A/A control of the bench itself, or (with engine
            # settings of its own) vanilla in another mode
            if set(opts) - {"method", ENGINE_KEY}:
                raise ValueError(f"--method-config[{name!r}]: vanilla takes only {ENGINE_KEY!r}")
            if ENGINE_KEY in opts:
                configs[name] = {"method": "vanilla", ENGINE_KEY: dict(opts[ENGINE_KEY])}
            continue
        if configs[name] is None or not isinstance(opts, dict):
            raise ValueError(
                f"--method-config[{name!r}]: expected a dict of options for a speculative method"
            )
        configs[name].update(opts)
    return configs


def parse_engine_args(text: str | None) -> dict:
    """``--engine-args``: a JSON object of engine settings (None: no settings).

    >>> parse_engine_args('{"dtype": "bfloat16"}')
    {'dtype': 'bfloat16'}
    """
    return json_object(text, "--engine-args", "{setting: value}")


def json_object(text: str | None, flag: str, shape: str) -> dict:
    """A command-line flag's JSON object (None or empty: {}), or a ValueError naming the flag."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object {shape}")
    return value


def split_engine(cfg: dict | None) -> tuple[dict | None, dict]:
    """A label's config -> (its speculative config, None for vanilla; its own engine settings).

    >>> split_engine({"method": "vanilla", "engine": {"enforce_eager": True}})
    (None, {'enforce_eager': True})
    >>> split_engine({"method": "auto"})
    ({'method': 'auto'}, {})
    """
    if cfg is None:
        return None, {}
    cfg = dict(cfg)
    engine = cfg.pop(ENGINE_KEY, {})
    return (None if cfg.get("method") == "vanilla" else cfg), engine


def _vllm_methods() -> list[str]:
    """vLLM's own speculative methods, its "custom_class" hook aside (the plugin's)."""
    from ..compat import vllm_spec_methods

    return [m for m in vllm_spec_methods() if m != "custom_class"]


def forget_cross_request_memory(llm, cfg: dict | None) -> None:
    """Empty what a method drafts from across requests, before a repeat of the same prompts
    (which no real workload offers): selfspec's shared lookup index, suffix decoding's global
    tree. Every method starts each repeat alike."""
    from ..config import methods as selfspec_methods

    method = (cfg or {}).get("method")
    if method in selfspec_methods():
        forget_outputs(llm)
    elif method == "suffix":
        llm.collective_rpc(_new_suffix_cache)


def _new_suffix_cache(worker) -> None:
    """In a worker of vLLM's suffix method: a new, empty suffix cache of the same limits (vLLM's
    ``SuffixDecodingProposer.suffix_cache``; the cache has no way to empty itself)."""
    drafter = worker.model_runner.drafter
    old = drafter.suffix_cache
    drafter.suffix_cache = type(old)(
        max_tree_depth=old.max_tree_depth, max_cached_requests=old.max_cached_requests
    )


def check_selfspec_configs(configs: dict[str, dict | None], hf_config) -> None:
    """Fail before any engine starts on a selfspec config the model cannot serve."""
    from ..config import SelfSpecConfig
    from ..config import methods as selfspec_methods
    from ..model_info import model_info_from_hf

    info = model_info_from_hf(hf_config)
    for cfg in configs.values():
        cfg = split_engine(cfg)[0]
        if cfg is not None and cfg["method"] in selfspec_methods():
            SelfSpecConfig.load(cfg).validate_for_model(info)


# ----------------------------------------------------------------------------- worker process
def _spec_counters(llm) -> dict[str, float]:
    totals = dict.fromkeys(SPEC_COUNTERS, 0)
    by_name = {v: k for k, v in SPEC_COUNTERS.items()}
    for m in llm.get_metrics():
        if m.name in by_name and hasattr(m, "value"):
            totals[by_name[m.name]] += m.value
    return totals


def _worker(spec_path: str) -> int:
    """Runs one method: load, warm up on the parent's "warm", then one timed generate() call per
    "run" line read from the parent's command pipe (answering each with its wall time and
    tokens); on "stop", writes the result JSON."""
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    from ..config import methods as selfspec_methods

    (cfg, engine), prompts = split_engine(spec["config"]), spec["prompts"]
    selfspec = cfg is not None and cfg.get("method") in selfspec_methods()
    if (cfg or {}).get("method") == "suffix":  # forget_cross_request_memory sends a function
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    t_start = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        max_num_seqs=spec["batch_size"],
        speculative_config=cfg,
        **{**engine_args(spec.get("eager", False)), **spec.get("engine_args", {}), **engine},
    )
    startup_s = time.perf_counter() - t_start  # compilation (or its cache) included
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"])
    token_ids: list = [None] * len(prompts)
    deterministic = True
    with os.fdopen(spec["cmd_fd"], "r") as cmds, os.fdopen(spec["res_fd"], "w") as res:
        res.write("loaded\n")
        res.flush()
        if cmds.readline().strip() != "warm":
            return 1
        # warm-up: the whole workload once, untimed, slice by slice as the timed runs go, so
        # one-time costs (the first forward of each token count, a cost model's first samples)
        # stay out of the timed runs, as they stay out of a server that has run for a minute.
        # The parent warms its engines one at a time: a cost model that learnt its prices while
        # other engines competed for the cores would carry them into the timed runs
        for start, stop in chunks(len(prompts), spec["batch_size"], spec.get("slice_size")):
            llm.generate(prompts[start:stop], params, use_tqdm=False)
        if selfspec:
            get_stats(llm, reset=True)
        before = _spec_counters(llm)
        res.write("ready\n")
        res.flush()
        for line in cmds:  # "run START STOP FRESH": prompts[START:STOP]; FRESH: a repeat begins
            words = line.split()
            if not words or words[0] != "run":
                break
            start, stop, fresh = int(words[1]), int(words[2]), words[3] == "1"
            if fresh:  # a repeat drafts only from its own requests' outputs
                forget_cross_request_memory(llm, cfg)
            # every timed run computes its prompts, as a server does for prompts it has not seen
            # (not the prefix cache's copies from the warm-up and the repeats before)
            llm.reset_prefix_cache()
            ids, wall, steps = _generate(llm, prompts[start:stop], params)
            full_s, full_tokens = full_batch_decode(steps, stop - start, spec["batch_size"])
            for i, x in enumerate(ids, start):
                if token_ids[i] is None:
                    token_ids[i] = x
                elif x != token_ids[i]:  # greedy decoding should repeat itself exactly
                    deterministic = False
            run = {
                "wall_s": wall,
                "tokens": sum(map(len, ids)),
                "full_s": full_s,
                "full_tokens": full_tokens,
                "steps": len(steps),
            }
            res.write(json.dumps(run) + "\n")
            res.flush()
        after = _spec_counters(llm)
        result = {
            "token_ids": token_ids,
            "deterministic": deterministic,
            "counters": {k: after[k] - before[k] for k in SPEC_COUNTERS},
            "selfspec_stats": get_stats(llm) if selfspec else None,
            "vllm_version": vllm.__version__,
            "torch_threads": torch.get_num_threads(),
            # in this process (the engine's front end; its engine core and model worker log
            # their own install): the plugin installs it wherever vLLM loads its plugins
            "frame_stack_cache_installed": _frame_stack_installed(),
            "startup_s": startup_s,
        }
        Path(spec["result_path"]).write_text(json.dumps(result), encoding="utf-8")
        res.write("done\n")
        res.flush()
    return 0


def _frame_stack_installed() -> bool:
    from .. import frame_stack

    path = os.environ.get(frame_stack.ENV)
    return bool(path) and frame_stack.installed(path)


def _generate(llm, prompts: list[str], params) -> tuple[list[list[int]], float, list[tuple]]:
    """``llm.generate`` step by step: each prompt's output token ids, the seconds it all took,
    and per engine step that emitted tokens (seconds since the first request was added, tokens
    emitted, requests that finished, requests that got their first token), for
    ``full_batch_decode``."""
    from vllm.sampling_params import RequestOutputKind

    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA  # each step's new tokens, as a stream gets them
    engine, tag = llm.llm_engine, f"bench-{time.monotonic_ns()}-"
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, params)
    ids: dict[str, list[int]] = {}
    steps = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        if not outs:
            continue
        first = sum(o.request_id not in ids for o in outs)
        for o in outs:
            ids.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        emitted = sum(len(o.outputs[0].token_ids) for o in outs)
        steps.append((time.perf_counter() - t0, emitted, sum(o.finished for o in outs), first))
    wall = time.perf_counter() - t0
    return [ids.get(f"{tag}{i}", []) for i in range(len(prompts))], wall, steps


def full_batch_decode(steps: list[tuple], num_requests: int, batch_size: int) -> tuple[float, int]:
    """(seconds, tokens) of a run's decode steps at a full batch: the steps before which at
    least ``batch_size`` requests were unfinished and in which no request got its first token
    (no prompt was prefilled). ``steps``: (seconds since start, tokens emitted, requests
    finished, requests that got their first token) per engine step.

    What a server with a standing queue decodes at, from a closed batch: its tail is left out
    (speculation ends some requests early, and the last ones decode in a thinning batch, which
    plain decoding, its requests in lockstep, never has), and so are the prefills, which fall
    differently (plain decoding admits a wave at once, speculation one request at a time).

    Six requests at batch 4: the first step prefills four, two finish at the third and the
    last two are prefilled at the fourth; after the fifth three are left::

    >>> steps = [(1.0, 4, 0, 4), (1.5, 4, 0, 0), (2.0, 4, 2, 0), (3.0, 4, 0, 2),
    ...          (3.5, 4, 1, 0), (4.0, 3, 3, 0)]
    >>> full_batch_decode(steps, 6, 4)
    (1.5, 12)
    """
    left, prev, seconds, tokens = num_requests, 0.0, 0.0, 0
    for t, emitted, finished, first in steps:
        if left >= batch_size and not first:
            seconds += t - prev
            tokens += emitted
        left -= finished
        prev = t
    return seconds, tokens


class _Engine:
    """The parent's handle on one method's worker process (see ``_worker``)."""

    def __init__(self, name: str, spec: dict, log_path: Path, tmp: Path) -> None:
        self.name, self.log_path = name, log_path
        self.result_path = tmp / f"{log_path.stem}.result.json"
        cmd_r, self._cmd_w = os.pipe()
        self._res_r, res_w = os.pipe()
        spec_path = tmp / f"{log_path.stem}.spec.json"
        spec_path.write_text(
            json.dumps(
                {**spec, "result_path": str(self.result_path), "cmd_fd": cmd_r, "res_fd": res_w}
            ),
            encoding="utf-8",
        )
        self._log = open(log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_selfspec.tools.bench", "--_worker", str(spec_path)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=(cmd_r, res_w),
            # its own process group: ``kill`` takes the engine processes it forked down with it
            start_new_session=True,
        )
        os.close(cmd_r)
        os.close(res_w)
        self._cmds = os.fdopen(self._cmd_w, "w")
        self._res = os.fdopen(self._res_r, "r")

    def _answer(self) -> str:
        # wait for a line while the worker lives: a worker that died can leave its pipe open in
        # an engine process it forked, so end-of-file alone would never come
        # (one answer per command: nothing waits in the reader's buffer while select waits)
        line = ""
        while True:
            if select.select([self._res], [], [], 5.0)[0]:
                line = self._res.readline()
                break
            if self.proc.poll() is not None:
                break
        if not line:  # the worker died
            self.proc.wait()
            tail = "".join(
                self.log_path.read_text(encoding="utf-8", errors="replace").splitlines(
                    keepends=True
                )[-30:]
            )
            raise RuntimeError(
                f"method {self.name!r} failed (exit code {self.proc.returncode});"
                f" full log: {self.log_path}\n--- last lines ---\n{tail}"
            )
        return line.strip()

    def ready(self) -> None:
        """Waits until the worker has loaded its engine."""
        self._answer()

    def warm_up(self) -> None:
        """The worker's untimed run of the whole workload; returns when it is done."""
        self._cmds.write("warm\n")
        self._cmds.flush()
        self._answer()

    def run(self, start: int, stop: int, fresh: bool) -> dict:
        """One timed generate() over prompts[start:stop] (``fresh``: a repeat begins)."""
        self._cmds.write(f"run {start} {stop} {int(fresh)}\n")
        self._cmds.flush()
        return json.loads(self._answer())

    def finish(self) -> dict:
        self._cmds.write("stop\n")
        self._cmds.flush()
        self._answer()
        self.proc.wait()
        self._cmds.close()
        self._res.close()
        self._log.close()
        result = json.loads(self.result_path.read_text(encoding="utf-8"))
        # vLLM's CPU backend pins the model worker's OpenMP threads; its log says to which cores
        log_text = self.log_path.read_text(encoding="utf-8", errors="replace")
        cores = re.search(r"core ids=\[([^\]]*)\]", log_text)
        result["engine_omp_cores"] = f"[{cores.group(1)}]" if cores else None
        return result

    def kill(self) -> None:
        """The worker and every process of its group (vLLM's engine core and model worker, which
        a dead worker would otherwise leave running, holding their memory)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone already
            pass
        self.proc.wait()
        self._log.close()


def code_version() -> str | None:
    """The commit of the checkout the package runs from ("+changes" when it has uncommitted
    changes), or None outside a git checkout: what code a result was measured with."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--", ".."],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if dirty else "")


def chunks(num_prompts: int, batch_size: int, size: int | None = None) -> list[tuple[int, int]]:
    """The prompt slices a repeat is timed in, each run by every method of a group in turn:
    ``size`` prompts, by default twice the batch size (a full batch most of the time), so the
    methods' runs alternate every few seconds and a machine whose speed drifts slows or speeds
    them alike. Each slice is a closed batch: its last ``batch_size`` requests decode with none
    waiting (a server with a standing queue: ``--slice-size`` several times the batch size)."""
    size = size or 2 * batch_size
    return [(i, min(i + size, num_prompts)) for i in range(0, num_prompts, size)]


def run_interleaved(
    configs: dict[str, dict | None],
    base: dict,
    repeats: int,
    group_size: int,
    logs: Path,
    tmp: Path,
) -> tuple[dict[str, dict], dict[str, list[float]]]:
    """Every method's raw result (``runs``: one per repeat, its chunks' seconds and tokens
    summed), and its per-repeat tokens/s ratios against the vanilla of its group (vanilla's raw
    result holds the runs of every group)."""
    others = [n for n in configs if n != "vanilla"]
    groups = [others[i : i + group_size] for i in range(0, len(others), group_size)] or [[]]
    raw: dict[str, dict] = {}
    ratios: dict[str, list[float]] = {n: [] for n in configs}
    vanilla_runs: list[dict] = []
    for g, group in enumerate(groups):
        names = ["vanilla", *group]
        print(
            f"[bench] group {g + 1}/{len(groups)}: "
            + ", ".join(f"{n} {json.dumps(configs[n])}" for n in names),
            flush=True,
        )
        t0 = time.perf_counter()
        engines: dict[str, _Engine] = {}
        try:
            for n in names:
                log = logs / (
                    f"vanilla-g{g + 1}.log" if n == "vanilla" and len(groups) > 1 else f"{n}.log"
                )
                engines[n] = _Engine(n, {**base, "config": configs[n]}, log, tmp)
            for e in engines.values():  # they load together,
                e.ready()
            for e in engines.values():  # and warm up alone (``_worker``)
                e.warm_up()
            runs: dict[str, list[dict]] = {n: [] for n in names}
            full: dict[str, list[float]] = {n: [] for n in names}
            per_slice: dict[str, list[float]] = {n: [] for n in names}
            for r in range(repeats):
                total = {n: dict.fromkeys(RUN_FIELDS, 0) for n in names}
                # each repeat starts with the next engine: no engine always runs first
                order = names[r % len(names) :] + names[: r % len(names)]
                slices = chunks(len(base["prompts"]), base["batch_size"], base.get("slice_size"))
                for c, (start, stop) in enumerate(slices):
                    slice_tps = {}
                    for n in order:
                        time.sleep(SETTLE_S)
                        run = engines[n].run(start, stop, fresh=c == 0)
                        for k in RUN_FIELDS:
                            total[n][k] += run[k]
                        slice_tps[n] = run["tokens"] / run["wall_s"]
                    for n in names:  # the same slice, run by each engine within seconds
                        per_slice[n].append(slice_tps[n] / slice_tps["vanilla"])
                tps = {n: t["tokens"] / t["wall_s"] for n, t in total.items()}
                # tokens/s of the decode steps at a full batch (full_batch_decode), if any
                full_tps = {
                    n: t["full_tokens"] / t["full_s"] if t["full_s"] else None
                    for n, t in total.items()
                }
                for n in names:
                    runs[n].append(total[n])
                    ratios[n].append(tps[n] / tps["vanilla"])
                    if full_tps[n] and full_tps["vanilla"]:
                        full[n].append(full_tps[n] / full_tps["vanilla"])
            results = {n: e.finish() for n, e in engines.items()}
            for n in names:
                results[n]["runs"] = runs[n]
                results[n]["full_batch_ratios"] = full[n]
                results[n]["slice_ratios"] = per_slice[n]
        finally:
            for e in engines.values():
                e.kill()
        vanilla_runs += results["vanilla"]["runs"]
        raw.update({n: r for n, r in results.items() if n != "vanilla"})
        raw.setdefault("vanilla", results["vanilla"])
        print(f"[bench] group {g + 1}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    raw["vanilla"]["runs"] = vanilla_runs
    ratios["vanilla"] = [1.0] * len(vanilla_runs)
    return raw, ratios


# ----------------------------------------------------------------------------- summaries
def median_interval(
    values: list[float], level: float = 0.9, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A percentile-bootstrap interval of the median of ``values`` (seeded: the same values give
    the same interval). Four slice ratios, for example::

        >>> median_interval([0.98, 1.02, 1.00, 1.04])
        (0.99, 1.03)

    One value gives the interval (it, it): nothing to say about its noise."""
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(
        statistics.median(rng.choices(values, k=n)) for _ in range(resamples if n > 1 else 1)
    )
    tail = (1 - level) / 2
    lo = medians[int(tail * (len(medians) - 1))]
    hi = medians[int(round((1 - tail) * (len(medians) - 1)))]
    return lo, hi


def summarize(
    cfg: dict | None, raw: dict, ref: dict, num_layers: int, ratios: list[float] | None = None
) -> dict:
    """One method's figures; ``ratios``: its tokens/s over vanilla's, per interleaved round (the
    speedup is their median; without them, the ratio of the two medians)."""
    from ..config import methods as selfspec_methods

    cfg, engine = split_engine(cfg)
    tps_runs = [r["tokens"] / r["wall_s"] for r in raw["runs"]]
    tps = statistics.median(tps_runs)
    tokens = sum(r["tokens"] for r in raw["runs"])
    c, stats = raw["counters"], raw["selfspec_stats"]
    spec = cfg is not None
    if not spec:
        tpl = tokens / (tokens * num_layers) if tokens else None
    elif cfg.get("method") in selfspec_methods():
        tpl = stats.get("tokens_per_layer") if stats else None
    else:  # a target forward emits 1 + accepted tokens; the draft costs no decoder layers
        forwards = tokens - c["accepted_tokens"]
        tpl = tokens / (forwards * num_layers) if forwards > 0 else None
    breakdown = None
    if stats and stats.get("time_s"):
        t = stats["time_s"]
        breakdown = {
            "seconds": t,
            "share": {
                k: (v / t["total"] if t["total"] else None) for k, v in t.items() if k != "total"
            },
        }
    ref_tps = statistics.median(r["tokens"] / r["wall_s"] for r in ref["runs"])
    speedup = statistics.median(ratios) if ratios else tps / ref_tps
    full = raw.get("full_batch_ratios") or []
    per_slice = raw.get("slice_ratios") or []
    same = [a == b for a, b in zip(raw["token_ids"], ref["token_ids"])]
    # engine steps per repeat: a closed batch ends with its last request, so drafts that do not
    # shorten the request that finishes last remove no step and only make steps dearer
    steps = [r["steps"] for r in raw["runs"] if "steps" in r]
    ref_steps = [r["steps"] for r in ref["runs"] if "steps" in r]
    return {
        "tokens_per_s": tps,
        "tokens_per_s_runs": tps_runs,
        "speedup": speedup,
        "speedup_runs": ratios,
        # the same ratio over decode steps at a full batch (a server's standing queue: no closed
        # batch's tail, no prefills)
        "full_batch_speedup": statistics.median(full) if full else None,
        "full_batch_speedup_runs": full,
        # each timed slice's ratio (the same prompts run by the method and vanilla seconds
        # apart): their median and a 90% bootstrap interval of it, the run's own noise band
        "slice_speedup": statistics.median(per_slice) if per_slice else None,
        "slice_speedup_interval": median_interval(per_slice)
        if raw is not ref and per_slice
        else None,
        "slice_speedup_runs": per_slice,
        "engine_steps": statistics.median(steps) if steps else None,
        "engine_steps_ratio": (
            statistics.median(steps) / statistics.median(ref_steps) if steps and ref_steps else None
        ),
        "acceptance_rate": c["accepted_tokens"] / c["draft_tokens"]
        if spec and c["draft_tokens"]
        else None,
        "mean_accepted_tokens": c["accepted_tokens"] / c["drafts"]
        if spec and c["drafts"]
        else None,
        "tokens_per_layer": tpl,
        "parity": sum(same) / len(same) if same else None,
        "time_breakdown": breakdown,
        "config": cfg,
        "engine_settings": engine,  # this label's own (split_engine)
        "selfspec_stats": stats,
        "deterministic": raw["deterministic"],
        "generated_tokens": tokens,
        "wall_s_runs": [r["wall_s"] for r in raw["runs"]],
        # seconds to build the engine (vllm.LLM), compilation or its cache included
        "startup_s": raw.get("startup_s"),
        "frame_stack_cache_installed": raw.get("frame_stack_cache_installed"),
        "spec_decode_counters": c if spec else None,
    }


def _fmt(x: Any, spec: str = ".3f", pct: bool = False) -> str:
    if x is None:
        return "–"
    return f"{100 * x:.0f}%" if pct else format(x, spec)


def _steps(m: dict) -> str:
    """Engine steps per repeat and their ratio to vanilla's, e.g. ``97 (1.00)``."""
    if m.get("engine_steps") is None:
        return "–"
    return f"{m['engine_steps']:.0f} ({_fmt(m.get('engine_steps_ratio'), '.2f')})"


def _per_slice(m: dict) -> str:
    """The slices' median ratio and its interval, e.g. ``0.99x [0.97, 1.01]``."""
    if m.get("slice_speedup_interval") is None:
        return "–"
    lo, hi = m["slice_speedup_interval"]
    return f"{m['slice_speedup']:.2f}x [{lo:.2f}, {hi:.2f}]"


def markdown_table(methods: dict[str, dict]) -> str:
    lines = [
        "| method | tok/s | speedup | per slice [90% interval] | full-batch speedup "
        "| engine steps (vs vanilla) | acceptance | mean accepted/round "
        "| tokens/layer | parity | draft/verify/policy/shadow/optimise share "
        "| skipped attn/MLP per round | start-up s |",
        "|" + "---|" * 13,
    ]
    for name, m in methods.items():
        share = (m["time_breakdown"] or {}).get("share")
        shares = (
            "/".join(
                _fmt(share.get(k), pct=True)
                for k in ("draft", "verify", "policy", "shadow", "optimise")
            )
            if share
            else "–"
        )
        st = m["selfspec_stats"] or {}
        skipped = (
            (
                f"{_fmt(st.get('skipped_attn_per_round'), '.1f')}/"
                f"{_fmt(st.get('skipped_mlp_per_round'), '.1f')}"
            )
            if st
            else "–"
        )
        lines.append(
            f"| {name} | {m['tokens_per_s']:.1f} | {m['speedup']:.2f}x | {_per_slice(m)} "
            f"| {_fmt(m.get('full_batch_speedup'), '.2f')}{'x' if m.get('full_batch_speedup') else ''} "
            f"| {_steps(m)} "
            f"| {_fmt(m['acceptance_rate'], pct=True)} "
            f"| {_fmt(m['mean_accepted_tokens'], '.2f')} "
            f"| {_fmt(m['tokens_per_layer'], '.4f')} | {_fmt(m['parity'], '.2f')} "
            f"| {shares} | {skipped} | {_fmt(m.get('startup_s'), '.0f')} |"
        )
    return "\n".join(lines)


def layer_table(methods: dict[str, dict]) -> str | None:
    """AdaDecode's figures (methods whose stats have ``layer_computations``): early predictions
    per emitted token, rejection rate, sequential layer passes per token (1 / tokens-per-layer;
    vanilla: L) and (token, layer) computations per token beside vanilla's and a
    draft-then-verify method's with the same drafts."""
    rows = []
    for name, m in methods.items():
        st = m.get("selfspec_stats") or {}
        lc = st.get("layer_computations")
        if not lc:
            continue
        gen, drafted = st.get("generated_tokens") or 0, st.get("drafted_tokens") or 0
        acc = st.get("acceptance_rate")
        tpl = m.get("tokens_per_layer")
        rows.append(
            f"| {name} | {_fmt(drafted / gen if gen else None, '.3f')} "
            f"| {_fmt(None if acc is None else 1 - acc, pct=True)} "
            f"| {_fmt(1 / tpl if tpl else None, '.1f')} "
            f"| {_fmt(lc['per_token'], '.1f')} | {_fmt(lc['draft_then_verify_per_token'], '.1f')} "
            f"| {_fmt(lc['vanilla_per_token'], '.0f')} "
            f"| {lc.get('rounds_resumed', '–')}/{lc.get('rounds_dropped', '–')} |"
        )
    if not rows:
        return None
    return "\n".join(
        [
            "| method | early predictions / token | rejection rate | layer passes / token "
            "| (token, layer) computations / token | draft-then-verify | vanilla "
            "| rounds resumed/dropped |",
            "|" + "---|" * 8,
        ]
        + rows
    )


def plot_speedup(methods: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(methods)
    values = [methods[n]["speedup"] for n in names]
    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2, 4))
    bars = ax.bar(names, values, color=["#999999"] + ["#4c72b0"] * (len(names) - 1))
    ax.bar_label(bars, labels=[f"{v:.2f}x" for v in values])
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_ylim(0, 1.15 * max(values + [1.0]))
    ax.set_ylabel("speedup over vanilla (tokens/s)")
    ax.set_title("Decoding speedup")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _command_line() -> str:
    argv0 = (
        "python -m vllm_selfspec.tools.bench"
        if sys.argv[0].endswith("bench.py")
        else Path(sys.argv[0]).name
    )
    return " ".join([argv0] + [shlex.quote(a) for a in sys.argv[1:]])


@contextlib.contextmanager
def frame_stack_cache(wanted: bool) -> Iterator[str]:
    """Builds the frame-stack chunk cache and names it in the environment that every engine
    process started inside inherits (``frame_stack.ENV``; ``plugin.register`` installs it), or
    makes sure none is named; yields what the results record ("on", or "off" with the reason)
    and restores the environment on exit."""
    from .. import frame_stack

    before = os.environ.pop(frame_stack.ENV, None)
    try:
        yield _name_frame_stack_cache(wanted)
    finally:
        os.environ.pop(frame_stack.ENV, None)
        if before is not None:
            os.environ[frame_stack.ENV] = before


def _name_frame_stack_cache(wanted: bool) -> str:
    from .. import frame_stack

    if not wanted:
        return "off (--no-frame-stack-cache)"
    reason = frame_stack.unsupported()
    if reason:
        return f"off ({reason})"
    try:
        path = frame_stack.build()
    except RuntimeError as e:
        print(f"warning: {e}; engines run without the frame-stack cache", file=sys.stderr)
        return "off (it did not compile)"
    os.environ[frame_stack.ENV] = str(path)
    return "on"


# ----------------------------------------------------------------------------- main
def main(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    try:
        for flag in ("num_prompts", "max_tokens", "batch_size", "repeats", "group_size"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
        if args.slice_size is not None and args.slice_size < 1:
            raise ValueError("--slice-size must be >= 1")
        model = resolve_model(args.model)
        hf_config = AutoConfig.from_pretrained(model)
        num_layers = hf_config.num_hidden_layers
        shared = parse_engine_args(getattr(args, "engine_args", None))
        configs = method_configs(args.methods, args.method_config, num_layers)
        check_selfspec_configs(configs, hf_config)
        prompts = load_prompts(args.prompts, args.num_prompts, model)
    except ValueError as e:  # includes SelfSpecConfigError
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    base = {
        "model": model,
        "prompts": prompts,
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "slice_size": args.slice_size,
        "eager": args.eager,
        "engine_args": shared,
    }
    wanted = getattr(args, "frame_stack_cache", True)
    with (
        frame_stack_cache(wanted) as stack_cache,
        tempfile.TemporaryDirectory(prefix="selfspec-bench-") as tmp,
    ):
        try:
            raw, ratios = run_interleaved(
                configs, base, args.repeats, args.group_size, out / "logs", Path(tmp)
            )
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    methods = {
        n: summarize(configs[n], raw[n], raw["vanilla"], num_layers, ratios[n]) for n in configs
    }
    settings = {
        k: v
        for k, v in vars(args).items()  # a CLI may add e.g. a handler function
        if not k.startswith("_") and isinstance(v, (str, int, float, bool, type(None)))
    }
    settings.update(
        model_path=model,
        num_layers=num_layers,
        num_prompts_loaded=len(prompts),
        vllm_version=raw["vanilla"]["vllm_version"],
        torch_threads=raw["vanilla"]["torch_threads"],
        engine_omp_cores=raw["vanilla"]["engine_omp_cores"],
        engine_args={**engine_args(args.eager), **shared},
        mode=mode_name(args.eager),
        frame_stack_cache=stack_cache,
        command_line=_command_line(),
        code=code_version(),
    )
    table = markdown_table(methods)
    layers = layer_table(methods)
    if layers:
        table += "\n\nAdaDecode (early predictions, deferred layers):\n\n" + layers
    scored = None
    if getattr(args, "quality", False):
        scored = _quality(args, model, raw, methods, out)
        table += "\n\nQuality against vanilla:\n\n" + scored.pop("table")
    (out / "results.json").write_text(
        json.dumps({"settings": settings, "methods": methods, "quality": scored}, indent=2),
        encoding="utf-8",
    )
    first, last = chunks(len(prompts), args.batch_size, args.slice_size)[0]
    settings_line = (
        f"model `{model}` ({num_layers} layers), prompts {args.prompts} x "
        f"{len(prompts)}, max_tokens {args.max_tokens}, batch {args.batch_size}, "
        f"repeats {args.repeats}, slices of {last - first} prompts, "
        f"engines {mode_name(args.eager)}, "
        f"vLLM {settings['vllm_version']}, "
        f"torch threads {settings['torch_threads']} (engine OMP cores "
        f"{settings['engine_omp_cores']}), greedy, frame-stack chunk cache {stack_cache}"
    )
    if any((c or {}).get("method") == "auto" for c in configs.values()):
        from ..config import auto_note

        settings_line += f"; {auto_note(model)}"
    (out / "results.md").write_text(
        f"# selfspec benchmark\n\n{settings_line}\n\n{table}\n\n"
        f"Command:\n\n```\n{settings['command_line']}\n```\n",
        encoding="utf-8",
    )
    plot_speedup(methods, out / "speedup.png")
    print(
        f"\n{settings_line}\n\n{table}\n\nwrote {out}/results.json, results.md, speedup.png"
        + (", quality.png" if scored is not None else "")
    )
    return 0


def _quality(args, model: str, raw: dict, methods: dict, out: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = {n: raw[n]["token_ids"] for n in methods}
    texts = {n: tok.batch_decode(v, skip_special_tokens=True) for n, v in ids.items()}
    he = args.prompts in ("humaneval", "humaneval-chat")
    problems = quality.humaneval_problems(len(ids["vanilla"])) if he else None
    scores = quality.quality(ids, texts, problems, chat=args.prompts == "humaneval-chat")
    quality.plot_quality(scores, methods, out / "quality.png")
    return {"scores": scores, "texts": texts, "table": quality.markdown_table(scores, methods)}


def _cli(argv: list[str]) -> int:
    if argv[:1] == ["--_worker"] and len(argv) == 2:
        try:
            return _worker(argv[1])
        except BaseException:
            # exit at once: a normal exit waits for the engine's processes, which can hang, and
            # the parent learns of the failure only when this process is gone
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    parser = argparse.ArgumentParser(
        prog="python -m vllm_selfspec.tools.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))

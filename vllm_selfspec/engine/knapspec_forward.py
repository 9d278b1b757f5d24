"""KnapSpec's search on the real model: the DP's sub-layers over the target's own paged KV cache,
and the start-up latency model (the algorithm is ``policies/knapspec_knapsack.py``).

``KnapsackForward(ctx, block_table_rows)`` serves one request's optimisation (``ctx``: the
engine's ``drafting.DraftContext``; its block-table row in each KV-cache group,
``kv_groups.KVGroups``):

* ``sublayer(s, states[B, r, d], positions[r])``: the residual stream after sub-layer ``s`` of B
  candidate state sets of the request's r recent rows (consecutive positions). MLP sub-layers are
  ``x + mlp(norm(x))`` on the B·r rows. Attention sub-layers run the layer's own vLLM attention
  with queries from the candidate states (norm → qkv → rope) and the context's K/V from the
  request's KV cache: under a forward context whose metadata repeats the request's block table
  once per candidate (B "requests" of r queries each, ``seq_len = last position + 1``, causal), so
  each row attends to the target's cached K/V at every earlier position and its own. **Nothing is
  written**: the forward context's ``slot_mapping`` dict leaves the layer out, so vLLM's
  ``unified_kv_cache_update`` skips the write (CPU, FlashAttention, FlashInfer and Triton backends
  all write there, ``forward_includes_kv_cache_update = False``), and the metadata's own
  ``slot_mapping`` is all ``-1`` (PAD_SLOT_ID), which every cache-write kernel skips (the CPU
  ``reshape_and_cache`` and CUDA ``reshape_and_cache[_flash]`` kernels test ``slot < 0``), for a
  backend that writes inside its forward.
* ``predict(states[N, d])``: the draft's greedy token of each row (final norm + LM head over the
  draft vocabulary, batched through the fused LM-head argmax like shadow tokens);
  ``predict_target`` the target's (full vocabulary).

``latency_model(ctx)``: t_MLP, t_Attn(n) = c2·n + c3 and the LM head's time of one row, from
timing every layer's sub-layers at a few context lengths (reading any KV blocks: nothing is
written) and the LM heads; about a second on the CPU, cached per model/device/dtype/TP size/draft
vocabulary under
``$VLLM_SELFSPEC_HOME/latency/``; rank 0's under TP.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from .. import compat
from ..cachedir import write_json
from ..checkpoints import home
from ..policies.knapspec_knapsack import LatencyModel
from . import draft_attention
from .draft_attention import DraftAttention

logger = logging.getLogger(compat.LOGGER_NAME)

#: context lengths at which attention is timed (capped by max_model_len)
LATENCY_CONTEXTS = (16, 256, 1024, 4096)
LATENCY_REPEATS = 7
#: the latency cache's layout; part of its key, so a file of another layout is never read
LATENCY_CACHE_VERSION = 2


class KnapsackForward:
    def __init__(self, ctx, block_table_rows: list[torch.Tensor]) -> None:
        self.ctx = ctx
        self.layout = ctx.executor.layout
        self.rows = block_table_rows
        self._md: dict[tuple, dict] = {}  # (B, first, r) -> attention metadata per layer name

    def sublayer(self, s: int, states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, r, d = states.shape
        lay = self.layout
        layer = lay.layers[s // 2]
        x = states.reshape(B * r, d)
        if s % 2 == 1:
            return (x + lay.mlp(layer, lay.mlp_norm(layer)(x))).view(B, r, d)
        first = int(positions[0])
        if positions.numel() != r or int(positions[-1]) != first + r - 1:
            raise ValueError("knapsack rows must sit at consecutive positions")
        attention, pos = self._attention(B, first, r, x.device)
        with attention.context():  # no KV write
            h = lay.attn(layer, pos, lay.attn_norm(layer)(x), draft_attention.active())
        return (x + h).view(B, r, d)

    def _attention(self, B: int, first: int, r: int, dev):
        return self.ctx.kv_groups().latest(
            self._md,
            (B, first, r),
            lambda: (
                read_only_attention(self.ctx, self.rows, B, first, r),
                torch.arange(first, first + r, device=dev).repeat(B),
            ),
        )

    def predict(self, states: torch.Tensor) -> torch.Tensor:
        """The draft's greedy tokens (its vocabulary: reduced when draft_vocab_size is set)."""
        tokens, _ = self.ctx.shadow.project(states.unsqueeze(0), ["lm_head"])
        return tokens[0]

    def predict_target(self, states: torch.Tensor) -> torch.Tensor:
        """The target's greedy tokens (full vocabulary)."""
        lay = self.layout
        return lay.compute_logits(lay.norm(states)).argmax(-1).cpu()


def read_only_attention(ctx, rows: list[torch.Tensor], B: int, first: int, r: int):
    """The attention (``draft_attention.DraftAttention``) of B copies of one request's r rows
    at positions first .. first+r-1, reading its KV cache up to there (``rows``: its
    block-table row in each KV-cache group) and writing nothing."""
    if ctx.paged:
        dev = rows[0].device
        none = torch.full((B * r,), -1, dtype=torch.int64, device=dev)  # no KV write
        return ctx.paged_rows(
            [row.unsqueeze(0) for row in rows],
            [none] * len(rows),
            torch.arange(first, first + r, device=dev).repeat(B),
            torch.zeros(B * r, dtype=torch.long, device=dev),  # every row reads the request's
            first + r,
        )
    md = read_only_metadata(ctx, rows, B, first, r)
    return DraftAttention.backend(ctx.forward_context, md, B * r, {})


def read_only_metadata(ctx, rows: list[torch.Tensor], B: int, first: int, r: int) -> dict:
    """vLLM's attention metadata of ``read_only_attention``'s rows, for every attention layer."""
    dev = rows[0].device
    qsl = torch.arange(B + 1, dtype=torch.int32) * r
    seq = torch.full((B,), first + r, dtype=torch.int32)
    pos = torch.arange(first, first + r, device=dev).repeat(B)
    cm = ctx.common_metadata(
        query_start_loc=qsl.to(dev),
        query_start_loc_cpu=qsl,
        seq_lens=seq.to(dev),
        seq_lens_cpu_upper_bound=seq,
        num_reqs=B,
        num_actual_tokens=B * r,
        max_query_len=r,
        max_seq_len=first + r,
        block_table_tensor=rows[0].unsqueeze(0).expand(B, -1).contiguous(),
        slot_mapping=torch.full((B * r,), -1, dtype=torch.int64, device=dev),  # PAD_SLOT_ID
        causal=True,
        positions=pos,
    )
    tables = [row.unsqueeze(0).expand(B, -1).contiguous() for row in rows]
    return ctx.kv_groups().metadata(cm, tables, [cm.slot_mapping] * len(rows))[0]


# ---- the latency model ------------------------------------------------------------------------
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return f"cpu {cpu} x{torch.get_num_threads()} threads"


def _cache_path(ctx, device: torch.device) -> Path:
    mc = ctx.vllm_config.model_config
    vocab = ctx.executor.vocab_ids
    key = json.dumps(
        [
            LATENCY_CACHE_VERSION,
            os.path.realpath(str(mc.model)),
            _device_name(device),
            str(mc.dtype),
            ctx.tp,
            compat.vllm_version(),
            None if vocab is None else int(vocab.numel()),
        ]
    )
    return home() / "latency" / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def _median_seconds(fn, sync) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(LATENCY_REPEATS):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_latency(ctx, device: torch.device) -> LatencyModel:
    """Time one row through every layer's attention at a few context lengths, every MLP and the
    LM head, per sub-layer (a pass over all layers, as a decode step streams them, so no layer's
    weights stay cache-hot). Every TP rank runs this together: the sub-layers all-reduce."""
    lay = ctx.executor.layout
    layers = lay.layers
    block_size = min(g.block_size for g in ctx.kv_groups().groups)
    max_len = ctx.max_model_len
    contexts = sorted({min(n, max_len) for n in LATENCY_CONTEXTS})
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = ctx.vllm_config.model_config.dtype
    x = torch.randn(1, lay.norm.weight.shape[0], device=device, dtype=dtype)
    attn = []
    for n in contexts:
        # any blocks will do for timing: they are only read (block 0, vLLM's null block, too)
        row = torch.arange((n + block_size - 1) // block_size, dtype=torch.int32, device=device)
        attention = read_only_attention(ctx, [row] * len(ctx.kv_groups().groups), 1, n - 1, 1)
        pos = torch.tensor([n - 1], device=device)

        def run_attn():
            with attention.context():
                for layer in layers:
                    lay.attn(layer, pos, lay.attn_norm(layer)(x), ctx.paged)

        attn.append((n, _median_seconds(run_attn, sync) / len(layers)))

    def run_mlp():
        for layer in layers:
            lay.mlp(layer, lay.mlp_norm(layer)(x))

    t_mlp = _median_seconds(run_mlp, sync) / len(layers)
    t_target_head = _median_seconds(lambda: lay.compute_logits(lay.norm(x)), sync)
    ex = ctx.executor
    t_head = (
        t_target_head
        if ex.vocab_ids is None
        else _median_seconds(lambda: ex.project(lay.norm(x)), sync)
    )
    return LatencyModel.fit(attn, t_mlp, t_head, t_target_head)


def latency_model(ctx) -> LatencyModel:
    """The cached latency model, or a fresh measurement; identical on every TP rank."""
    device = ctx.runner.device
    path = _cache_path(ctx, device)
    cached = None
    if compat.tp_rank() == 0 and path.is_file():
        try:  # a file of another layout, truncated or foreign: measured again, and rewritten
            d = json.loads(path.read_text(encoding="utf-8"))
            LatencyModel.from_dict(d)
            cached = d
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            logger.warning("knapspec: ignoring the latency cache %s (%s); measuring", path, e)
    cached = compat.broadcast_from_tp_rank0(cached)  # all ranks measure together, or none
    if cached is not None:
        return LatencyModel.from_dict(cached)
    t0 = time.perf_counter()
    with torch.inference_mode():
        lm = measure_latency(ctx, device)
    d = compat.broadcast_from_tp_rank0(lm.to_dict())
    logger.info("knapspec latency model measured in %.2f s: %s", time.perf_counter() - t0, d)
    if compat.tp_rank() == 0:
        try:
            write_json(
                path,
                {
                    **d,
                    "device": _device_name(device),
                    "seconds_to_measure": time.perf_counter() - t0,
                },
            )
        except OSError as e:
            logger.warning("knapspec: cannot cache the latency model in %s: %s", path, e)
    return LatencyModel.from_dict(d)

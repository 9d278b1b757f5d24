"""Load and fault test against an OpenAI-compatible vLLM server (tests/engine/test_serve.py and
benchmarks/load.py).

``concurrency`` clients each send streaming ``/v1/completions`` requests back to back until
``duration_s`` is over: a random prompt of the pool (a few tokens to a few hundred), greedy or
sampled (``temperature`` 0.8, ``top_p`` 0.95), a random ``max_tokens``, and with probability
``abort_prob`` the client drops the connection after a random number of chunks (vLLM then aborts
the request). Every completed greedy response is compared token by token with the vanilla
reference (``greedy_references``: vanilla vLLM, offline, on the same prompts); any HTTP error,
error chunk, truncated stream or malformed response counts as an error. The resident memory of
the server's process tree is sampled throughout.
"""

from __future__ import annotations

# vLLM is imported inside greedy_references only: the load clients and the engine settings (which
# the tests and benchmarks/load.py import) need none of it
import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from .bench import engine_args

_FILLER = (
    "The committee met on Tuesday to review the budget, the schedule and the open "
    "questions from the last meeting. "
)
#: prompt pool: short, medium and long (the longest, 345 tokens of the embedded model, takes two
#: prefill chunks at ENGINE_KW's 256-token budget)
PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "List three prime numbers:",
    "Once upon a time, in a small village by the sea,",
    'import numpy as np\n\ndef softmax(x):\n    """Numerically stable softmax."""\n',
    "Explain in one paragraph why the sky is blue, for a ten year old reader.",
    "Write a haiku about autumn leaves.",
    "Summarise the following minutes.\n" + _FILLER * 6,
    "Summarise the following minutes.\n" + _FILLER * 16,
    "Q: What is 12 times 12?\nA:",
    "Translate to French: Good morning, how are you today?",
]
MAX_TOKENS = 32  # greedy references are this long; requests ask for 1..MAX_TOKENS


def engine_kw(eager: bool = False) -> dict[str, Any]:
    """Engine settings the served engine and the vanilla references share (vllm.LLM keywords; the
    server gets the same as command-line flags, see ``cli_args``): the bench's, in vLLM's default
    (compiled) mode unless ``eager``, except:"""
    return {
        **engine_args(eager),
        # a fixed 1 GiB KV cache (~23k tokens of the embedded model): enough for 32 long
        # requests, and a small footprint for a server that the test session keeps up
        "kv_cache_memory_bytes": 1 << 30,
        # the clients' concurrency (the bench sets max_num_seqs per run, from --batch-size)
        "max_num_seqs": 32,
        # a small prefill budget, so that long prompts are chunked and share steps with decodes
        "max_num_batched_tokens": 256,
    }


#: the served engine's settings in vLLM's default mode (the tests serve with ``engine_kw(True)``)
ENGINE_KW = engine_kw()


def cli_args(kw: dict[str, Any]) -> list[str]:
    """vllm.LLM keywords -> `vllm serve` flags (True: the bare flag; False: left out, which is
    what `vllm serve` does without ``--disable-log-stats``, the one false setting)."""
    out: list[str] = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is not False:
            out += [flag] if v is True else [flag, str(v)]
    return out


def greedy_references(
    llm, prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS
) -> list[dict[str, list[int]]]:
    """[{"prompt": token ids, "output": vanilla greedy token ids}] from an offline vllm.LLM."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in prompts]
    outs = llm.generate(
        [{"prompt_token_ids": i} for i in ids],
        SamplingParams(temperature=0, max_tokens=max_tokens),
        use_tqdm=False,
    )
    return [{"prompt": i, "output": list(o.outputs[0].token_ids)} for i, o in zip(ids, outs)]


@dataclass
class LoadResult:
    requests: int = 0
    completed: int = 0
    aborted: int = 0  # dropped by the client on purpose
    greedy_checked: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes of all)
    #: the same by process (``Server.rss_by_process``'s names): where a step in ``rss`` comes from
    rss_by_process: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    duration_s: float = 0.0
    scrapes: int = 0  # /metrics scrapes answered (``run_load(scrapers=...)``)

    def summary(self) -> dict[str, Any]:
        rss = [b for _, b in self.rss]
        half = rss[len(rss) // 2 :] or rss
        return {
            "requests": self.requests,
            "completed": self.completed,
            "aborted": self.aborted,
            "greedy_checked": self.greedy_checked,
            "tokens": self.tokens,
            "errors": len(self.errors),
            "greedy_mismatches": len(self.mismatches),
            "duration_s": round(self.duration_s, 1),
            "tokens_per_s": round(self.tokens / self.duration_s, 1) if self.duration_s else 0,
            "metrics_scrapes": self.scrapes,
            "rss_mib_first_half_max": round(max(rss[: len(rss) // 2] or rss or [0]) / 2**20),
            "rss_mib_second_half_max": round(max(half or [0]) / 2**20),
            "rss_slope_mib_per_min_after_20pct": self.rss_slope(0.2 * self.duration_s),
        }

    def rss_slope(self, after_s: float) -> float | None:
        """Least-squares slope of the server's RSS (MiB per minute) over the samples taken
        after ``after_s`` seconds (None with fewer than 3)."""
        pts = [(t, b) for t, b in self.rss if t >= after_s]
        if len(pts) < 3:
            return None
        slope = np.polyfit([t for t, _ in pts], [b for _, b in pts], 1)[0]
        return round(float(slope) * 60 / 2**20, 2)


async def _one(
    session, url: str, model: str, rng: random.Random, refs, res: LoadResult, abort_prob: float
) -> None:
    i = rng.randrange(len(refs))
    greedy = rng.random() < 0.5
    max_tokens = rng.randint(1, MAX_TOKENS)
    body = {
        "model": model,
        "prompt": refs[i]["prompt"],
        "max_tokens": max_tokens,
        "stream": True,
        "return_token_ids": True,
        "temperature": 0.0 if greedy else 0.8,
        **({} if greedy else {"top_p": 0.95}),
    }
    abort_after = rng.randint(1, max(1, max_tokens // 2)) if rng.random() < abort_prob else None
    res.requests += 1
    tokens: list[int] = []
    finish, chunks, done = None, 0, False
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            res.errors.append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            return
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk or not chunk.get("choices"):
                res.errors.append(f"error chunk: {str(chunk)[:200]}")
                return
            choice = chunk["choices"][0]
            tokens += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
            chunks += 1
            if abort_after is not None and chunks >= abort_after:
                resp.close()  # drop the connection mid-stream: the server aborts the request
                res.aborted += 1
                return
    if not done or finish is None:
        res.errors.append(f"stream ended without [DONE]/finish_reason (prompt {i})")
        return
    res.completed += 1
    res.tokens += len(tokens)
    if not 1 <= len(tokens) <= max_tokens:
        res.errors.append(f"{len(tokens)} tokens for max_tokens={max_tokens}")
    if greedy:
        res.greedy_checked += 1
        expect = refs[i]["output"][:max_tokens]
        if tokens != expect:
            res.mismatches.append(
                {"prompt": i, "max_tokens": max_tokens, "got": tokens, "expected": expect}
            )


async def _client(url, model, seed, deadline, duration_s, refs, res, abort_prob) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=600)
    # one connection per request: a pooled keep-alive connection can be closed by the server's
    # idle timeout just as the client reuses it, which would read as a server fault here
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        while time.monotonic() < deadline:
            try:
                await _one(session, url, model, rng, refs, res, abort_prob)
            except Exception as e:  # connection errors, timeouts, bad JSON
                t = time.monotonic() - (deadline - duration_s)
                res.errors.append(f"{type(e).__name__} at {t:.1f}s: {e}"[:300])


async def _scraper(url: str, deadline: float, res: LoadResult) -> None:
    """Scrape ``/metrics`` back to back until ``deadline`` (a Prometheus flood)."""
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url + "/metrics") as resp:
                    await resp.read()
                    if resp.status != 200:
                        res.errors.append(f"/metrics: HTTP {resp.status}")
                        continue
                res.scrapes += 1
            except Exception as e:
                res.errors.append(f"/metrics: {type(e).__name__}: {e}"[:300])


async def _sample_rss(
    rss_fn: Callable[[], dict[str, int]], res: LoadResult, t0: float, stop, every_s: float = 2.0
) -> None:
    while not stop.is_set():
        t, parts = time.monotonic() - t0, rss_fn()
        res.rss.append((t, sum(parts.values())))
        for name, b in parts.items():
            res.rss_by_process.setdefault(name, []).append((t, b))
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


async def run_load(
    url: str,
    model: str,
    refs: list[dict[str, list[int]]],
    duration_s: float,
    concurrency: int = 32,
    abort_prob: float = 0.2,
    seed: int = 0,
    rss_fn: Callable[[], dict[str, int]] | None = None,
    scrapers: int = 0,
) -> LoadResult:
    """Clients start requests until ``duration_s`` is over, then finish the ones in flight;
    ``scrapers`` more clients scrape ``/metrics`` back to back meanwhile; ``rss_fn`` (resident
    bytes by process, ``Server.rss_by_process``) is sampled every 2 s."""
    res = LoadResult()
    t0 = time.monotonic()
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_rss(rss_fn, res, t0, stop)) if rss_fn else None
    await asyncio.gather(
        *(
            _client(url, model, seed * 1000 + c, t0 + duration_s, duration_s, refs, res, abort_prob)
            for c in range(concurrency)
        ),
        *(_scraper(url, t0 + duration_s, res) for _ in range(scrapers)),
    )
    res.duration_s = time.monotonic() - t0
    stop.set()
    if sampler:
        await sampler
    return res

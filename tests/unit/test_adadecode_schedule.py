"""AdaDecode's deferred-layer schedule (vllm_selfspec/policies/adadecode_schedule.py) on a toy
causal model with a per-layer KV cache: decoding with early predictions, deferred layers and
greedy verification gives exactly the sequential decode, no row ever reads a KV entry that is
missing or stale, and no (token, layer) of a verified round is computed twice."""

from __future__ import annotations

import pytest
import torch

from vllm_selfspec.policies.adadecode_schedule import (
    Round,
    draft_round,
    finish_plan,
    usable_prefix,
    walk,
)

L, D, V = 6, 16, 11
EXITS = (2, 4)


class Toy:
    """A tiny causal transformer-like model: layer l reads the mean of its KV entries at
    positions <= p (written by the rows that ran layer l there) and mixes it in."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(V, D, generator=g, dtype=torch.float64)
        self.wq = [torch.randn(D, D, generator=g, dtype=torch.float64) * 0.4 for _ in range(L)]
        self.wk = [torch.randn(D, D, generator=g, dtype=torch.float64) * 0.4 for _ in range(L)]
        self.out = torch.randn(D, V, generator=g, dtype=torch.float64) * 1.5

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) @ self.out


class Cache:
    """One sequence's KV cache: kv[l][pos] = (token at pos when written, key)."""

    def __init__(self) -> None:
        self.kv: list[dict[int, tuple[int, torch.Tensor]]] = [dict() for _ in range(L)]
        self.computed: list[tuple[int, int, int]] = []  # (pos, token, layer) per computation

    def layer(
        self,
        toy: Toy,
        l: int,
        xs: list[torch.Tensor],
        pos: list[int],
        tok: list[int],
        seq: list[int],
    ) -> list[torch.Tensor]:
        """Layer l on consecutive rows (causal among them); ``seq`` is the token at every
        position as the current computation sees it (committed + this round's)."""
        for x, p, t in zip(xs, pos, tok):
            self.kv[l][p] = (t, torch.tanh(x @ self.wk(toy, l)))
            self.computed.append((p, t, l))
        out = []
        for x, p in zip(xs, pos):
            keys = []
            for q in range(p + 1):
                assert q in self.kv[l], f"layer {l}: position {q} has no KV (row at {p})"
                written_for, k = self.kv[l][q]
                assert written_for == seq[q], f"layer {l}: stale KV at {q} read by row at {p}"
                keys.append(k)
            out.append(x + torch.tanh(x @ toy.wq[l] + torch.stack(keys).mean(0)))
        return out

    @staticmethod
    def wk(toy: Toy, l: int) -> torch.Tensor:
        return toy.wk[l]


def sequential(toy: Toy, prompt: list[int], n_new: int) -> list[int]:
    cache, seq = Cache(), list(prompt)
    xs = [toy.emb[t] for t in seq]
    for l in range(L):
        xs = cache.layer(toy, l, xs, list(range(len(seq))), seq, seq)
    out = []
    for _ in range(n_new):
        t = int(toy.logits(xs[-1]).argmax())
        out.append(t)
        seq.append(t)
        x = [toy.emb[t]]
        for l in range(L):
            x = cache.layer(toy, l, x, [len(seq) - 1], [t], seq)
        xs = x
    return out


class ToyBackend:
    """adadecode_schedule.Backend over several sequences: round r's token i sits at position base[r] + i."""

    def __init__(self, toy: Toy, caches: list[Cache], seqs: list[list[int]], threshold: float):
        self.toy, self.caches, self.seqs, self.threshold = toy, caches, seqs, threshold
        self.rounds: list[Round] = []
        self.state: dict[tuple[int, int], torch.Tensor] = {}
        self.joins = 0

    def begin(self, rounds: list[Round]) -> None:
        self.rounds, self.state = rounds, {}

    def _seq(self, r: int) -> list[int]:
        return self.seqs[r][:-1] + self.rounds[r].tokens  # seqs[r][-1] is rounds[r].tokens[0]

    def run(self, rows, start, stop):
        by_req: dict[int, list[int]] = {}
        for r, i in rows:
            by_req.setdefault(r, []).append(i)
        for r, idx in by_req.items():
            rnd = self.rounds[r]
            assert idx == list(range(idx[0], len(rnd.tokens))), "rows must be a suffix"
            if len(idx) > 1:
                self.joins += 1
            base = len(self.seqs[r]) - 1
            xs = [
                self.state.get((r, i), self.toy.emb[rnd.tokens[i]])
                if start
                else self.toy.emb[rnd.tokens[i]]
                for i in idx
            ]
            for l in range(start, stop):
                xs = self.caches[r].layer(
                    self.toy,
                    l,
                    xs,
                    [base + i for i in idx],
                    [rnd.tokens[i] for i in idx],
                    self._seq(r),
                )
            for i, x in zip(idx, xs):
                self.state[(r, i)] = x

    def predict(self, requests, layer):
        toks, ok = [], []
        for r in requests:
            x = self.state[(r, len(self.rounds[r].tokens) - 1)]
            p = torch.softmax(self.toy.logits(x), -1)
            toks.append(int(p.argmax()))
            ok.append(bool(p.max() > self.threshold))
        return toks, ok


def adadecode(toy: Toy, prompts: list[list[int]], n_new: int, threshold: float, max_drafts: int):
    caches = [Cache() for _ in prompts]
    seqs = [list(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    for c, s in zip(caches, seqs):  # prefill, then the first token from the full model
        xs = [toy.emb[t] for t in s]
        for l in range(L):
            xs = c.layer(toy, l, xs, list(range(len(s))), s, s)
        first = int(toy.logits(xs[-1]).argmax())
        s.append(first)
    for o, s in zip(outs, seqs):
        o.append(s[-1])
    backend = ToyBackend(toy, caches, seqs, threshold)
    stats = {"drafted": 0, "accepted": 0, "rounds": 0, "once": True}
    while min(len(o) for o in outs) < n_new:
        rounds = [Round([s[-1]]) for s in seqs]
        backend.begin(rounds)
        marks = [len(c.computed) for c in caches]
        draft_round(backend, rounds, [max_drafts] * len(rounds), EXITS)
        rows = [(r, i) for r, rnd in enumerate(rounds) for i in range(len(rnd.tokens))]
        depth = [rounds[r].depth[i] for r, i in rows]
        for start, stop, idx in finish_plan(depth, L):
            backend.run([rows[j] for j in idx], start, stop)
        for r, (c, m) in enumerate(zip(caches, marks)):  # every (token, layer) exactly once
            base = len(seqs[r]) - 1
            want = sorted(
                (base + i, t, l) for i, t in enumerate(rounds[r].tokens) for l in range(L)
            )
            stats["once"] &= sorted(c.computed[m:]) == want
        for r, rnd in enumerate(rounds):  # greedy verification
            stats["rounds"] += 1
            stats["drafted"] += len(rnd.drafts)
            for i in range(len(rnd.tokens)):
                target = int(toy.logits(backend.state[(r, i)]).argmax())
                if i + 1 < len(rnd.tokens) and rnd.tokens[i + 1] == target:
                    stats["accepted"] += 1
                    seqs[r].append(target)
                    outs[r].append(target)
                    continue
                seqs[r].append(target)
                outs[r].append(target)
                break
    return [o[:n_new] for o in outs], stats, backend, caches


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


@pytest.mark.parametrize("threshold,max_drafts", [(0.2, 4), (0.35, 2), (0.5, 6), (1.0, 3)])
def test_adadecode_equals_sequential_decoding(threshold, max_drafts):
    toy = Toy()
    want = [sequential(toy, p, 24) for p in PROMPTS]
    got, stats, backend, _ = adadecode(toy, PROMPTS, 24, threshold, max_drafts)
    assert got == want
    if threshold < 1:  # the schedule was exercised: early tokens, joins and rejections
        assert stats["drafted"] > 0 and backend.joins > 0
        assert stats["accepted"] < stats["drafted"]
    else:
        assert stats["drafted"] == 0


def test_every_token_of_a_round_runs_every_layer_exactly_once():
    # draft steps and the finishing pass together: no layer of a token twice, none missing
    _, stats, _, _ = adadecode(Toy(), PROMPTS, 24, 0.2, 4)
    assert stats["accepted"] > 0 and stats["once"]


class _Recorder:
    def __init__(self, confident_at: dict[int, int]) -> None:
        self.calls, self.confident_at = [], confident_at

    def run(self, rows, start, stop):
        self.calls.append((list(rows), start, stop))

    def predict(self, requests, layer):
        return [7] * len(requests), [self.confident_at.get(r) == layer for r in requests]


def test_walk_joins_earlier_tokens_past_their_depth_and_stops_at_confidence():
    # round 0: b exited at 2, d1 walks; round 1: a fresh token that is confident at 4
    rounds = [Round([5, 6], depth=[2, 0]), Round([9])]
    rec = _Recorder({0: 6, 1: 4})
    got = walk(rec, rounds, [0, 1], exits=(2, 4, 6))
    assert got == {0: 7, 1: 7}
    assert rec.calls == [
        ([(0, 1), (1, 0)], 0, 2),  # only the walking tokens below depth 2
        ([(0, 0), (0, 1), (1, 0)], 2, 4),  # b joins at its depth
        ([(0, 0), (0, 1)], 4, 6),
    ]  # round 1 stopped at 4
    assert rounds[0].depth == [6, 6] and rounds[1].depth == [4]
    assert rounds[0].exits == [6] and rounds[1].exits == [4]


def test_walk_without_confidence_ends_at_the_deepest_head():
    rounds = [Round([1])]
    assert walk(_Recorder({}), rounds, [0], exits=(3, 5)) == {}
    assert rounds[0].depth == [5] and rounds[0].exits == []


def test_draft_round_caps_early_predictions_and_leaves_the_last_unrun():
    rounds = [Round([1]), Round([2])]
    rec = _Recorder({0: 2, 1: 2})
    draft_round(rec, rounds, [2, 0], exits=(2, 4))
    assert rounds[0].tokens == [1, 7, 7] and rounds[0].depth == [2, 2, 0]
    assert rounds[1].tokens == [2] and rounds[1].depth == [0]  # max_drafts 0: no walk at all


def test_finish_plan_runs_rows_from_their_depth():
    assert finish_plan([0, 0, 8, 8, 0], 10) == [(0, 8, [0, 1, 4]), (8, 10, [0, 1, 2, 3, 4])]
    assert finish_plan([24, 24, 12], 30) == [(12, 24, [2]), (24, 30, [0, 1, 2])]
    assert finish_plan([30, 5], 30) == [(5, 30, [1])]  # a row at depth L (padding) never runs


def test_usable_prefix():
    assert usable_prefix([5, 6, 7], 10, [5, 6, 7], 10) == 3
    assert usable_prefix([5, 6, 7], 10, [5, 6], 10) == 2  # fewer drafts verified
    assert usable_prefix([5, 6, 7], 10, [5, 6], 11) == 0  # other positions
    assert usable_prefix([5, 6, 7], 10, [5, 9], 10) == 0  # other tokens
    assert usable_prefix([5], 10, [5, 6], 10) == 0  # more rows than the round


# ---- the policy: options and clear errors ------------------------------------------------------
def _policy(tmp_path, kind="adadecode", ident=None, **opts):
    from vllm_selfspec.config import SelfSpecConfig
    from vllm_selfspec.heads import HeadSet, ModelIdentity, make_head, save_heads
    from vllm_selfspec.policies import ModelInfo

    model = ModelInfo(num_layers=8, hidden_size=16, vocab_size=32, architecture="LlamaForCausalLM")
    ident = ident or ModelIdentity("LlamaForCausalLM", 8, 16, 32, "0123456789abcdef")
    heads = {
        layer: make_head(kind, ident.hidden_size, 8 if kind == "cascade" else None)
        for layer in (2, 4, 6)
    }
    path = save_heads(tmp_path / f"heads-{kind}-{ident.hidden_size}", HeadSet(kind, heads, ident))
    cfg = SelfSpecConfig.load({"method": "adadecode", "heads": str(path), **opts})
    cfg.validate_for_model(model)
    return cfg.make_policy(model)


def test_policy_defaults_and_options(tmp_path):
    p = _policy(tmp_path)
    assert p.exit_layers == (2, 4, 6) and p.threshold == 0.85 and p.max_draft_tokens == 5
    assert p.deferred and p.head_for_layer(4) == "heads@4"
    p = _policy(tmp_path, threshold=0.7, exit_layers=[6, 2], num_speculative_tokens=3)
    assert p.exit_layers == (2, 6) and p.threshold == 0.7 and p.max_draft_tokens == 3


@pytest.mark.parametrize(
    "opts,match",
    [
        ({"threshold": 0}, r"threshold \(γ\) must be in \(0, 1\]"),
        ({"threshold": "high"}, "threshold"),
        ({"exit_layers": [3]}, r"subset of the trained heads' layers \[2, 4, 6\]"),
        ({"exit_layers": []}, "exit_layers"),
        ({"exit_layer": 4}, "unknown option"),
    ],
)
def test_bad_options_are_config_errors(tmp_path, opts, match):
    from vllm_selfspec.config import SelfSpecConfigError

    with pytest.raises(SelfSpecConfigError, match=match):
        _policy(tmp_path, **opts)


def test_wrong_or_missing_heads_say_how_to_train(tmp_path):
    from vllm_selfspec.config import SelfSpecConfig, SelfSpecConfigError
    from vllm_selfspec.heads import ModelIdentity

    with pytest.raises(SelfSpecConfigError, match="kind 'cascade'.*train-heads --kind adadecode"):
        _policy(tmp_path, kind="cascade")
    other = ModelIdentity("LlamaForCausalLM", 8, 32, 32, "0123456789abcdef")
    with pytest.raises(SelfSpecConfigError, match="hidden_size=32, this model has 16"):
        _policy(tmp_path, ident=other)
    cfg = SelfSpecConfig.load({"method": "adadecode"})
    with pytest.raises(
        SelfSpecConfigError,
        match="no trained AdaDecode heads.*train-heads --kind adadecode --model",
    ):
        cfg.resolved(str(tmp_path / "some-model"))

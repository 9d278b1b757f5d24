"""Exit heads (vllm_selfspec.heads) on a tiny random Llama: format, identity, losses, threshold
selection, data capture, training, resume and the CLI. Never the real model; CPU only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_selfspec.cachedir import file_sha256
from vllm_selfspec.heads import (
    HeadSet,
    HeadsFormatError,
    HeadsMismatchError,
    Readout,
    identity_from_hf,
    identity_from_tensors,
    load_heads,
    make_head,
    reference_logits,
    save_heads,
)
from vllm_selfspec.heads.data import capture
from vllm_selfspec.heads.evaluate import agreement, head_input, select_threshold
from vllm_selfspec.heads.losses import adadecode_loss, cascade_loss, kl_topk
from vllm_selfspec.heads.train import TrainConfig, batch_indices, fit_transforms

LAYERS = (1, 2, 3)
EOS = 1


def tiny_model(seed: int = 0, layers: int = 4):
    """4 layers, hidden 64, vocab 128, tied embeddings. initializer_range 0.2 (not 0.02) so the
    layers change the prediction: raw early exits then disagree with the final layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.2,
        eos_token_id=EOS,
        pad_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def save_tiny(d: Path, seed: int = 0) -> Path:
    """The tiny model + a character-level tokenizer (ASCII -> one id each), as an HF dir."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": EOS, "<pad>": 2}
    for c in "\n\t" + "".join(chr(i) for i in range(32, 127)):
        vocab[c] = len(vocab)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")),
        unk_token="<unk>",
        eos_token="<eos>",
        pad_token="<pad>",
    )
    tok.save_pretrained(d)
    tiny_model(seed).save_pretrained(d)
    return d


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one thread is fastest, and immune to a busy machine's other load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def data(model):
    """Greedy generations of the tiny model on 64 random prompts: (train, held-out)."""
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, 128, (int(n),), generator=g).tolist()
        for n in torch.randint(8, 24, (64,), generator=g)
    ]
    d = capture(model, prompts, list(LAYERS), 12, 16, {EOS})
    return d.select((d.prompt < 48).nonzero()[:, 0]), d.select((d.prompt >= 48).nonzero()[:, 0])


def trained_like(kind: str, seed: int = 0) -> dict[int, torch.nn.Module]:
    """Heads with random (non-initial) parameters, to make round trips meaningful."""
    torch.manual_seed(seed)
    heads = {l: make_head(kind, 64) for l in LAYERS}
    for l, h in heads.items():
        with torch.no_grad():
            for p in h.parameters():
                p.add_(0.05 * torch.randn_like(p))
        if kind == "cascade":
            h.threshold = 0.25 + 0.1 * l
    return heads


# ---- identity -------------------------------------------------------------------------------
def test_identity_is_stable_across_dtype_and_tp_shard(model):
    ident = identity_from_hf(model)
    assert (ident.architecture, ident.num_layers, ident.hidden_size, ident.vocab_size) == (
        "LlamaForCausalLM",
        4,
        64,
        128,
    )
    emb, norm = model.model.embed_tokens.weight, model.model.norm.weight
    kw = dict(architecture="LlamaForCausalLM", num_layers=4, hidden_size=64, vocab_size=128)
    # a bf16-loaded copy, and TP rank 0's vocab shard, give the same identity
    assert (
        identity_from_tensors(embed_weight=emb.bfloat16(), norm_weight=norm.bfloat16(), **kw)
        == ident
    )
    assert identity_from_tensors(embed_weight=emb[:64], norm_weight=norm, **kw) == ident
    changed = emb.clone()
    changed[3, 7] += 0.5  # inside the hashed slice (every 7th column of the first 64 rows)
    assert identity_from_tensors(embed_weight=changed, norm_weight=norm, **kw) != ident
    assert identity_from_hf(tiny_model(seed=1)).fingerprint != ident.fingerprint


# ---- modules --------------------------------------------------------------------------------
def test_untrained_heads_are_the_raw_lm_head(model):
    x = torch.randn(5, 64) * 3
    readout = Readout(model)
    for kind in ("adadecode", "cascade"):
        head = make_head(kind, 64)
        torch.testing.assert_close(head.transform(x), x)
        torch.testing.assert_close(
            reference_logits(head, x, readout), model.lm_head(model.model.norm(x))
        )
    # a feature head also reads the final layer's output; untrained it ignores it
    f, offsets = torch.randn(5, 64), torch.tensor([1, 2, 3, 4, 1])
    torch.testing.assert_close(make_head("feature", 64).transform(x, f, offsets), x)
    assert make_head("feature", 64).max_offset == 4
    assert make_head("feature", 64, max_offset=2).offset.weight.shape == (3, 128)
    conf = make_head("cascade", 64).confidence(x)
    assert conf.shape == (5,) and bool(((conf >= 0) & (conf <= 1)).all())
    assert make_head("cascade", 64).up.weight.shape == (64, 64)  # bottleneck min(512, d)
    assert make_head("cascade", 64, bottleneck=16).up.weight.shape == (64, 16)


# ---- format ---------------------------------------------------------------------------------
def apply(head, x: torch.Tensor) -> torch.Tensor:
    """``head.transform(x)``; a feature head reads a fixed random final-layer output too."""
    if head.kind != "feature":
        return head.transform(x)
    g = torch.Generator().manual_seed(3)
    f = torch.randn(x.shape, generator=g)
    return head.transform(x, f, torch.arange(len(x)) % head.max_offset + 1)


@pytest.mark.parametrize("kind", ["adadecode", "cascade", "feature"])
def test_save_load_round_trip(tmp_path, model, kind):
    ident = identity_from_hf(model)
    heads = trained_like(kind)
    out = save_heads(tmp_path / "h", HeadSet(kind, heads, ident), {"note": "test"}, ["abc"])
    # no temp dir left behind, only the cache's lock file
    assert sorted(p.name for p in tmp_path.iterdir()) == [".h.lock", "h"]
    config = json.loads((out / "config.json").read_text())
    assert config["kind"] == kind and config["layers"] == list(LAYERS)
    assert config["base_model"] == ident.to_dict() and config["training"] == {"note": "test"}
    loaded = load_heads(out, expect=ident)
    assert loaded.kind == kind and loaded.layers == list(LAYERS) and loaded.identity == ident
    x = torch.randn(7, 64)
    for l in LAYERS:
        torch.testing.assert_close(apply(loaded[l], x), apply(heads[l], x).detach(), rtol=0, atol=0)
        if kind == "cascade":
            torch.testing.assert_close(
                loaded[l].confidence(x), heads[l].confidence(x).detach(), rtol=0, atol=0
            )
            assert loaded[l].threshold == pytest.approx(0.25 + 0.1 * l)
    assert loaded.thresholds == (
        {l: pytest.approx(0.25 + 0.1 * l) for l in LAYERS} if kind == "cascade" else None
    )
    # heads never carry the model's norm / LM head
    from safetensors import safe_open

    with safe_open(str(out / "heads.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert (128, 64) not in shapes.values(), shapes  # the LM head's [vocab, d]
    assert "1.T" in shapes if kind == "adadecode" else "1.gate.weight" in shapes
    if kind == "feature":
        assert shapes["1.offset.weight"] == (5, 128) and config["head"]["max_offset"] == 4


def test_feature_heads_may_exit_at_the_embeddings_and_the_others_may_not(tmp_path, model):
    ident = identity_from_hf(model)
    for kind, ok in (("feature", True), ("cascade", False)):
        out = save_heads(tmp_path / kind, HeadSet(kind, {0: make_head(kind, 64)}, ident))
        if ok:
            assert load_heads(out, expect=ident).layers == [0]
        else:
            with pytest.raises(HeadsFormatError, match=r"exit layers must be in \[1, 3\]"):
                load_heads(out, expect=ident)


def test_loading_for_another_model_is_a_clear_error(tmp_path, model):
    out = save_heads(
        tmp_path / "h", HeadSet("adadecode", trained_like("adadecode"), identity_from_hf(model))
    )
    with pytest.raises(HeadsMismatchError, match="fingerprint: trained for"):
        load_heads(out, expect=identity_from_hf(tiny_model(seed=1)))
    with pytest.raises(HeadsMismatchError, match="num_layers: trained for 4, model has 6"):
        load_heads(out, expect=identity_from_hf(tiny_model(layers=6)))


def test_format_errors(tmp_path, model):
    with pytest.raises(HeadsFormatError, match="no config.json"):
        load_heads(tmp_path, expect=None)
    out = save_heads(
        tmp_path / "h", HeadSet("cascade", trained_like("cascade"), identity_from_hf(model))
    )
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "heads.safetensors"))
    del tensors["2.up.weight"]
    save_file(tensors, str(out / "heads.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["weights_sha256"] = file_sha256(out / "heads.safetensors")  # consistent, but incomplete
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadsFormatError, match="layer 2: missing up.weight"):
        load_heads(out, expect=None)


# ---- losses and threshold -------------------------------------------------------------------
def test_kl_topk_is_exact_with_a_one_token_tail_and_a_lower_bound_otherwise():
    torch.manual_seed(0)
    final, head = torch.randn(6, 50) * 2, torch.randn(6, 50) * 2
    for T in (1.0, 2.0):
        lse = torch.logsumexp(final / T, -1)
        ref = torch.nn.functional.kl_div(
            (head / T).log_softmax(-1),
            (final / T).log_softmax(-1),
            reduction="none",
            log_target=True,
        ).sum(-1)
        assert ref.min() > 0.1
        vals, ids = final.topk(49, -1)  # the tail bucket is one token: nothing is coarsened
        torch.testing.assert_close(kl_topk(head, ids, vals, lse, T), ref, rtol=1e-4, atol=1e-5)
        vals, ids = final.topk(5, -1)
        part = kl_topk(head, ids, vals, lse, T)
        assert bool((part <= ref + 1e-5).all()) and bool((part > 0).all())
        assert kl_topk(final, ids, vals, lse, T).abs().max() < 1e-5  # head == final


def test_threshold_selection_maximises_f1():
    g = torch.Generator().manual_seed(0)
    labels = torch.rand(400, generator=g) < 0.6
    scores = torch.where(labels, 0.65, 0.35) + 0.25 * torch.randn(400, generator=g)
    scores = (scores * 20).round() / 20  # many ties
    best = select_threshold(scores, labels)

    def f1(t):
        pred = scores >= t
        tp = int((pred & labels).sum())
        return 2 * tp / (int(pred.sum()) + int(labels.sum()))

    brute = max(f1(float(t)) for t in scores.unique())
    assert best["f1"] == pytest.approx(brute) == pytest.approx(f1(best["threshold"]))
    pred = scores >= best["threshold"]
    assert best["precision"] == pytest.approx(float(labels[pred].float().mean()))
    assert best["recall"] == pytest.approx(float(pred[labels].float().mean()))
    assert 0.3 < best["threshold"] < 0.7
    assert select_threshold(scores, torch.zeros(400, dtype=torch.bool))["threshold"] > 1


# ---- data -----------------------------------------------------------------------------------
def test_capture_matches_an_unbatched_forward(model):
    """Batched, left-padded, KV-cached capture == one plain forward per finished sequence."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 42))]
    d = capture(model, prompts, list(LAYERS), 10, 8, {EOS})
    for r, p in enumerate(prompts):
        rows = (d.prompt == r).nonzero()[:, 0]
        gen = d.topk_ids[rows][d.generated[rows], 0].tolist()  # the greedy continuation
        assert len(rows) == len(p) - 1 + len(gen) - 1  # first token and last generated dropped
        with torch.no_grad():
            out = model(torch.tensor([p + gen]), output_hidden_states=True)
        for l in LAYERS:
            torch.testing.assert_close(
                d.hidden[l][rows], out.hidden_states[l][0, 1 : len(rows) + 1], rtol=1e-4, atol=1e-4
            )
        logits = out.logits[0, 1 : len(rows) + 1]
        assert torch.equal(d.topk_ids[rows, 0], logits.argmax(-1))
        torch.testing.assert_close(
            d.lse[rows, 0], torch.logsumexp(logits, -1), rtol=1e-4, atol=1e-4
        )
        assert int(d.generated[rows].sum()) == len(gen) and bool(d.generated[rows][-1])


def test_earlier_rows_are_the_same_sequence_positions_back(model):
    """``TokenData.earlier``: the final layer's output ``o`` positions back in the same prompt
    (a plain forward's), zeros before the prompt's first kept position."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 42))]
    d = capture(model, prompts, [0, 4], 10, 8, {EOS})
    idx = torch.arange(len(d))
    for o in (1, 2, 3):
        got = d.earlier(4, idx, torch.full_like(idx, o))
        for r, p in enumerate(prompts):
            rows = (d.prompt == r).nonzero()[:, 0]
            gen = d.topk_ids[rows][d.generated[rows], 0].tolist()
            with torch.no_grad():
                out = model(torch.tensor([p + gen]), output_hidden_states=True)
            final = out.hidden_states[4][0]  # HF's last hidden state: after the final norm
            for k, i in enumerate(rows.tolist()):  # row k of prompt r is position k + 1
                t = k + 1
                want = final[t - o] if t - o >= 1 else torch.zeros(64)
                torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)


# ---- training -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["adadecode", "cascade"])
def test_training_reduces_the_loss(model, data, kind):
    train, held_out = data
    readout = Readout(model)
    loss_fn = adadecode_loss if kind == "adadecode" else cascade_loss

    def losses(heads, d):
        with torch.no_grad():
            return [
                float(
                    loss_fn(
                        reference_logits(heads[l], d.hidden[l], readout),
                        d.topk_ids,
                        d.topk_logits,
                        d.lse,
                    )
                )
                for l in LAYERS
            ]

    torch.manual_seed(0)
    heads = {l: make_head(kind, 64) for l in LAYERS}
    before, before_held_out = losses(heads, train), losses(heads, held_out)
    cfg = TrainConfig(kind=kind, layers=LAYERS, steps=60, batch_size=64, lr=3e-3)
    fit_transforms(heads, readout, train, cfg, progress=False)
    after = losses(heads, train)
    assert all(a < 0.9 * b for a, b in zip(after, before)), (before, after)
    if kind == "adadecode":  # d² parameters generalise on this data; the adapter overfits it
        after_held_out = losses(heads, held_out)
        assert all(a < b for a, b in zip(after_held_out, before_held_out)), (
            before_held_out,
            after_held_out,
        )
    table = agreement(heads, readout, train, generated_only=False)
    assert sum(r["head_top1"] - r["raw_top1"] for r in table.values()) > 0.05, table


def test_feature_heads_train_and_are_scored_per_offset(model):
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, 128, (int(n),), generator=g).tolist()
        for n in torch.randint(8, 24, (48,), generator=g)
    ]
    train = capture(model, prompts, [0, 1, 4], 12, 16, {EOS})
    readout = Readout(model)
    torch.manual_seed(0)
    heads = {l: make_head("feature", 64, max_offset=3) for l in (0, 1)}
    rows = torch.arange(len(train))

    def losses():  # on every row, each reading the final layer one position back
        with torch.no_grad():
            return [
                float(
                    cascade_loss(
                        readout.logits(head_input(heads[l], train, l, rows, torch.ones_like(rows))),
                        train.topk_ids,
                        train.topk_logits,
                        train.lse,
                    )
                )
                for l in (0, 1)
            ]

    before_loss, before = losses(), agreement(heads, readout, train, generated_only=False)
    cfg = TrainConfig(kind="feature", layers=(0, 1), steps=60, batch_size=64, lr=3e-3, max_offset=3)
    fit_transforms(heads, readout, train, cfg, progress=False)
    after_loss, after = losses(), agreement(heads, readout, train, generated_only=False)
    assert after_loss[0] < 0.5 * before_loss[0] and after_loss[1] < before_loss[1], (
        before_loss,
        after_loss,
    )
    assert sum(after[l]["head_top1"] - before[l]["head_top1"] for l in ("0", "1")) > 0.03
    for l in ("0", "1"):
        row = after[l]
        assert len(row["head_top1_by_offset"]) == 3
        assert row["head_top1"] == row["head_top1_by_offset"][0]
        # by the first draft's confidence: a higher floor keeps fewer positions
        gates = row["gated"]
        assert gates[0]["min_confidence"] < gates[-1]["min_confidence"]
        assert [g["coverage"] for g in gates] == sorted(
            (g["coverage"] for g in gates), reverse=True
        )


def test_resumed_training_equals_an_uninterrupted_run(tmp_path, model, data, monkeypatch):
    train, _ = data
    cfg = TrainConfig(kind="cascade", layers=LAYERS, steps=8, batch_size=32, checkpoint_every=3)

    def run(state):
        torch.manual_seed(0)
        heads = {l: make_head("cascade", 64) for l in LAYERS}
        fit_transforms(heads, Readout(model), train, cfg, state, progress=False)
        return heads

    reference = run(None)
    import vllm_selfspec.heads.train as train_mod

    def interrupted(n, bs, step, seed):
        if step == 7:
            raise KeyboardInterrupt
        return batch_indices(n, bs, step, seed)

    monkeypatch.setattr(train_mod, "batch_indices", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "state.pt")
    assert torch.load(tmp_path / "state.pt", weights_only=False)["step"] == 6
    monkeypatch.setattr(train_mod, "batch_indices", batch_indices)
    resumed = run(tmp_path / "state.pt")
    for l in LAYERS:
        for (n, a), b in zip(reference[l].state_dict().items(), resumed[l].state_dict().values()):
            assert torch.equal(a, b), (l, n)


# ---- CLI and the embedded-model cache -------------------------------------------------------
def test_cli_smoke_train_and_eval(tmp_path, monkeypatch):
    from vllm_selfspec.cli import main

    monkeypatch.setenv("VLLM_SELFSPEC_HOME", str(tmp_path / "home"))
    model_dir = save_tiny(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"def f{i}(x):\n    return x * {i} + "}) + "\n" for i in range(40)
        )
    )
    common = [
        "--model",
        str(model_dir),
        "--layers",
        "1,3",
        "--sources",
        str(prompts),
        "--max-new-tokens",
        "8",
        "--steps",
        "6",
        "--batch-size",
        "32",
    ]
    for kind in ("cascade", "adadecode"):
        assert (
            main(
                [
                    "train-heads",
                    "--kind",
                    kind,
                    "--out",
                    str(tmp_path / kind),
                    "--est-steps",
                    "5",
                    *common,
                ]
            )
            == 0
        )
    config = json.loads((tmp_path / "cascade" / "config.json").read_text())
    meta = config["training"]
    assert config["layers"] == [1, 3] and set(config["thresholds"]) == {"1", "3"}
    assert meta["tokens"]["train"]["positions"] > 0 and meta["train_seconds"] >= 0
    # both kinds share one data cache, and no work dir is left behind
    assert len(list((tmp_path / "home" / "heads" / "data").iterdir())) == 1
    assert not list(tmp_path.glob(".*.work"))
    used = json.loads((tmp_path / "cascade" / "train_prompts.json").read_text())["prompts"]
    for kind in ("cascade", "adadecode"):
        out = tmp_path / f"eval-{kind}.json"
        assert (
            main(
                [
                    "eval-heads",
                    "--heads",
                    str(tmp_path / kind),
                    "--prompts",
                    str(prompts),
                    "--out",
                    str(out),
                    "--max-new-tokens",
                    "8",
                ]
            )
            == 0
        )
        result = json.loads(out.read_text())
        assert result["skipped_training_prompts"] == len(used) > 0
        assert result["num_prompts"] == 40 - len(used)
        assert set(result["layers"]) == {"1", "3"}
        for row in result["layers"].values():
            assert 0 <= row["raw_top1"] <= 1 and 0 <= row["head_top1"] <= 1
            assert (row["precision"] is None) == (row["recall"] is None) == (kind == "adadecode")
    # feature heads: an exit at the embeddings, scored per offset (the final layer collected too)
    args = ["train-heads", "--kind", "feature", "--out", str(tmp_path / "feature"), *common]
    args[args.index("1,3")] = "0,2"
    assert main([*args, "--max-offset", "2"]) == 0
    out = tmp_path / "eval-feature.json"
    assert (
        main(
            [
                "eval-heads",
                "--heads",
                str(tmp_path / "feature"),
                "--prompts",
                str(prompts),
                "--out",
                str(out),
                "--max-new-tokens",
                "8",
            ]
        )
        == 0
    )
    layers = json.loads(out.read_text())["layers"]
    assert set(layers) == {"0", "2"}
    assert all(len(row["head_top1_by_offset"]) == 2 for row in layers.values())


def test_gated_precision_and_coverage_by_confidence():
    from vllm_selfspec.heads.evaluate import GATES, gated

    correct = torch.tensor([True, True, False, False])
    conf = torch.tensor([0.9, 0.15, 0.35, 0.05])
    rows = {g["min_confidence"]: g for g in gated(correct, conf)}
    assert set(rows) == set(GATES)
    assert rows[0.1] == {
        "min_confidence": 0.1,
        "coverage": 0.75,
        "precision": pytest.approx(2 / 3),
        "kept_agreement": 1.0,
    }
    assert rows[0.3]["precision"] == 0.5 and rows[0.3]["kept_agreement"] == 0.5
    assert rows[0.7] == {
        "min_confidence": 0.7,
        "coverage": 0.25,
        "precision": 1.0,
        "kept_agreement": 0.5,
    }


class _RunsCode:
    """Unpickled by a full ``torch.load``, it runs ``touch <path>``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.path}",))


def test_a_checkpoint_that_runs_code_is_refused_unrun(tmp_path, model, data):
    """A resume checkpoint in a shared cache that someone else can write: loading it must not
    run what it holds (``weights_only``), and the error names the file."""
    train, _ = data
    cfg = TrainConfig(kind="cascade", layers=LAYERS, steps=2, batch_size=32, checkpoint_every=1)
    ran = tmp_path / "the-checkpoint-ran-code"
    state = tmp_path / "state.pt"
    torch.save({"step": 1, "payload": _RunsCode(ran)}, state)
    heads = {l: make_head("cascade", 64) for l in LAYERS}
    with pytest.raises(RuntimeError, match="refusing to resume from .*state.pt"):
        fit_transforms(heads, Readout(model), train, cfg, state, progress=False)
    assert not ran.exists(), "the checkpoint's code ran"
    torch.load(state, weights_only=False)  # the planted payload does run when loaded fully
    assert ran.exists()


def test_two_concurrent_train_heads_runs_of_one_output(tmp_path):
    """Two ``train-heads`` processes of the same output and data cache, with different settings:
    the run's work dir (its checkpoints) is taken under a lock, so a second run waits while
    another holds it, rather than find the first's checkpoint, take it for another run's and
    delete it under the first. First, deterministically, a run while the lock is held (as by a
    run in progress): it says it waits, and goes on once the lock is free. Then two at once: both
    succeed, and what is left is one whole, loadable set of heads, one data cache and no work or
    temporary directory. (Planted bug, no lock on the work dir: the first part never sees the
    run wait.)"""
    import os
    import subprocess
    import sys

    from vllm_selfspec.cachedir import locked
    from vllm_selfspec.heads import load_heads

    model_dir = save_tiny(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"def f{i}(x):\n    return x * {i} + "}) + "\n" for i in range(40)
        )
    )
    out = tmp_path / "heads"
    work = out.parent / f".{out.name}.work"
    args = ["train-heads", "--kind", "cascade", "--model", str(model_dir), "--out", str(out)]
    args += ["--layers", "1,3", "--sources", str(prompts), "--max-new-tokens", "8"]
    args += ["--batch-size", "32", "--est-steps", "5"]
    env = {**os.environ, "VLLM_SELFSPEC_HOME": str(tmp_path / "home")}

    def start(steps: str):
        return subprocess.Popen(
            [sys.executable, "-m", "vllm_selfspec.cli", *args, "--steps", steps],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    with locked(work):  # another run holds the work dir
        run = start("20")
        seen = []
        for line in run.stdout:  # (it collects the data first, then comes to the work dir)
            seen.append(line)
            if f"waiting for {work}" in line:
                break
        assert run.poll() is None and f"waiting for {work}" in seen[-1], "".join(seen[-20:])
    log = run.communicate(timeout=600)[0]
    assert run.returncode == 0, log

    runs = [start(steps) for steps in ("300", "301")]  # long enough to overlap
    logs = [r.communicate(timeout=600)[0] for r in runs]
    assert [r.returncode for r in runs] == [0, 0], logs
    heads = load_heads(out, expect=None)  # checks the weights against their content hash
    assert sorted(heads.heads) == [1, 3]
    assert heads.metadata["config"]["steps"] in (300, 301)
    assert len(list((tmp_path / "home" / "heads" / "data").iterdir())) == 1
    leftovers = [
        p.name for p in tmp_path.iterdir() if p.name.startswith(".") and "lock" not in p.name
    ]
    assert leftovers == [], leftovers

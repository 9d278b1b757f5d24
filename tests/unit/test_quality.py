"""The quality scores of `bench --quality` (token agreement, ROUGE-L, HumanEval pass@1)."""

from __future__ import annotations

import pytest

from vllm_selfspec.tools import quality as q


def test_token_agreement_counts_reference_positions():
    assert q.token_agreement([[1, 2, 3]], [[1, 2, 3]]) == 1.0
    assert q.token_agreement([[1, 9, 3], [4]], [[1, 2, 3], [4, 5]]) == pytest.approx(3 / 5)


def test_rouge_l_of_identical_and_different_texts():
    assert q.rouge_l(["a b c d"], ["a b c d"]) == pytest.approx(1.0)
    assert q.rouge_l(["a b x d"], ["a b c d"]) == pytest.approx(0.75)


def test_truncate_at_codex_stops():
    assert q.truncate_completion("    return x\n\ndef g():\n    pass") == "    return x\n"
    assert q.truncate_completion("    return x\n") == "    return x\n"


def test_humaneval_pass_at_1_runs_the_tests():
    problems = q.humaneval_problems(2)
    right = [p["canonical_solution"] for p in problems]
    wrong = ["    return None\n", "    while True:\n        pass\n"]  # a wrong answer, a hang
    assert q.humaneval_pass_at_1(problems, right, timeout_s=5.0) == (1.0, [True, True])
    assert q.humaneval_pass_at_1(problems, wrong, timeout_s=1.0) == (0.0, [False, False])


def test_code_block_of_a_chat_reply():
    reply = "Sure:\n```python\ndef f(x):\n    return x\n```\nThat is it."
    assert q.code_block(reply) == "def f(x):\n    return x\n"
    assert q.code_block("```\ndef f(): pass") == "def f(): pass"  # unclosed block
    assert q.code_block("def f(): pass") == "def f(): pass"


def test_pass_at_1_of_chat_replies_runs_their_code_block():
    problems = q.humaneval_problems(1)
    whole = problems[0]["prompt"] + problems[0]["canonical_solution"]
    right = f"Here you go:\n```python\n{whole}```\n"
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return None\n```"
    assert q.humaneval_pass_at_1(problems * 2, [right, wrong], chat=True) == (0.5, [True, False])

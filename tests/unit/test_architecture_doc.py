"""docs/architecture.md's module tree lists exactly the package's modules.

The tree is the fenced block that starts with ``vllm_selfspec/``: one entry per line, two spaces
of indentation per level, a module (``name.py``) or a package (``name/``) first, then its
description; a deeper-indented line that does not start with an entry continues the description
above. A package's line stands for its ``__init__.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = "vllm_selfspec"
ENTRY = re.compile(r"^( *)([A-Za-z_][A-Za-z0-9_]*(?:\.py|/))(?:  |$)")


def tree_block(text: str) -> list[str]:
    lines = text.splitlines()
    for i, line in enumerate(lines[1:], 1):
        if line.startswith(f"{PACKAGE}/") and lines[i - 1] == "```":
            return lines[i : lines.index("```", i)]
    raise AssertionError(f"{DOC} has no code block starting with {PACKAGE}/")


def listed_modules(block: list[str]) -> set[str]:
    """Paths relative to the repository root (``vllm_selfspec/x.py``; a package's line gives its
    ``__init__.py``) of the entries under ``vllm_selfspec/``."""
    stack: list[str] = []  # the open packages, one per level
    found: set[str] = set()
    for line in block:
        m = ENTRY.match(line)
        if m is None or len(m.group(1)) % 2 or len(m.group(1)) // 2 > len(stack):
            continue  # a continuation line
        depth, name = len(m.group(1)) // 2, m.group(2)
        del stack[depth:]
        if name.endswith("/"):
            stack.append(name[:-1])
            path = "/".join(stack) + "/__init__.py"
        else:
            path = "/".join([*stack, name])
        if path.startswith(f"{PACKAGE}/"):
            assert path not in found, f"{path} is listed twice"
            found.add(path)
    return found


def package_modules() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / PACKAGE).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def test_parser_reads_nesting_and_continuations():
    block = [
        "vllm_selfspec/       the API",
        "  a.py               one",
        "                     more about a.py",
        "  sub/               a package",
        "    b.py             two",
        "    long_name.py  three",
        "  c.py",
        "other/               not the package",
        "  d.py               not listed",
    ]
    assert listed_modules(block) == {
        "vllm_selfspec/__init__.py",
        "vllm_selfspec/a.py",
        "vllm_selfspec/sub/__init__.py",
        "vllm_selfspec/sub/b.py",
        "vllm_selfspec/sub/long_name.py",
        "vllm_selfspec/c.py",
    }


def test_architecture_tree_lists_every_module():
    listed = listed_modules(tree_block(DOC.read_text(encoding="utf-8")))
    actual = package_modules()
    assert not actual - listed, (
        f"modules missing from docs/architecture.md: {sorted(actual - listed)}"
    )
    assert not listed - actual, (
        f"docs/architecture.md lists modules that do not exist: {sorted(listed - actual)}"
    )

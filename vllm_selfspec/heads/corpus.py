"""The default training corpus for exit heads: general requests and code, disjoint from every
benchmark prompt set (HumanEval, the built-in chat set, the passages set).

Two parts, both offline and deterministic:

* ``general_requests(n)``: chat requests built from task templates x subjects ("Give three tips
  for keeping houseplants alive.", "Write a short story about a lighthouse keeper.", ...). The model
  answers them in its own words; the heads learn from those answers (self-distillation), so what
  matters is that the requests are varied and unlike the benchmarks', not that they are elegant.
* ``stdlib_functions(n)``: the head of a top-level function of Python's own standard library
  (signature and docstring) to continue as raw code, the shape of a code-completion request.

Neither reuses a benchmark prompt: ``tests/unit/test_corpus.py`` checks that no request equals,
contains or is contained in a chat or passages request, and that no code prompt shares a line of
24 characters or more with a HumanEval prompt (a few function names, such as ``median``, occur in
both; their prompts do not).

>>> general_requests(2)
['Write a four-line poem about honeybees.', 'How does a solar panel work? Keep it short.']
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

#: (template, subject list) pairs: each request is one template filled with one subject
TEMPLATES: dict[str, tuple[str, ...]] = {
    "how": (
        "Explain how {} works to a ten-year-old.",
        "How does {} work? Keep it short.",
        "Describe, step by step, how {} works.",
    ),
    "topic": (
        "Write a short paragraph about {}.",
        "What are three common misconceptions about {}?",
        "List five interesting facts about {}.",
        "What are the pros and cons of {}?",
        "Give a brief history of {}.",
        "Why is {} important? Answer in a few sentences.",
        "Write a limerick about {}.",
        "Write a four-line poem about {}.",
        "Explain {} as if you were a pirate.",
        "What would a beginner need to know about {}?",
    ),
    "activity": (
        "Give three tips for {}.",
        "What is the most common mistake people make when {}?",
        "Write a short checklist for {}.",
        "How can I get better at {}?",
        "Write a friendly email inviting a colleague to try {}.",
    ),
    "character": (
        "Write a short story about {}.",
        "Write a diary entry from the point of view of {}.",
        "Describe a typical day for {}.",
        "Write a short dialogue between {} and a curious child.",
    ),
    "code": (
        "Write a Python function that {}.",
        "Show how to {} in Python, with a short explanation.",
        "Write a JavaScript function that {}.",
        "What is a clean way to {} in Python?",
    ),
}

SUBJECTS: dict[str, tuple[str, ...]] = {
    "how": (
        "a compass",
        "a bicycle gear",
        "a microwave oven",
        "a solar panel",
        "a vaccine",
        "a credit card payment",
        "an elevator",
        "a search engine",
        "a thermostat",
        "a camera lens",
        "the stock market",
        "a hot air balloon",
        "a lock and key",
        "a touchscreen",
        "rain",
        "a heat pump",
        "a GPS receiver",
        "an electric guitar",
        "a washing machine",
        "a battery",
        "photosynthesis",
        "a submarine",
        "a wind turbine",
        "the immune system",
        "a 3D printer",
    ),
    "topic": (
        "a grumpy cat",
        "the Roman aqueducts",
        "coral reefs",
        "the printing press",
        "volcanoes",
        "honeybees",
        "jazz music",
        "the Moon landing",
        "chess openings",
        "public libraries",
        "tea ceremonies",
        "the Great Wall of China",
        "octopuses",
        "board games",
        "glaciers",
        "the human heart",
        "origami",
        "desert plants",
        "lighthouses",
        "the Silk Road",
        "electric cars",
        "sourdough bread",
        "remote work",
        "national parks",
        "the piano",
        "migrating birds",
        "recycling",
        "ancient Egypt",
        "black holes",
        "the Olympic Games",
        "open-source software",
        "urban gardens",
        "the violin",
        "penguins",
        "trains",
    ),
    "activity": (
        "keeping houseplants alive",
        "learning a new language",
        "running a first marathon",
        "saving money on groceries",
        "writing a cover letter",
        "taking better photos",
        "studying for an exam",
        "packing for a long trip",
        "cooking rice",
        "training a puppy",
        "giving a short speech",
        "planning a birthday party",
        "sleeping better",
        "organising a small kitchen",
        "learning to juggle",
        "reviewing someone's code",
        "starting a vegetable garden",
        "writing unit tests",
        "negotiating a salary",
        "painting a room",
        "camping in the rain",
        "reading more books",
    ),
    "character": (
        "a lighthouse keeper",
        "a robot who learns to paint",
        "a lost umbrella",
        "a baker in a small village",
        "an astronaut on Mars",
        "a detective who hates coffee",
        "a dragon afraid of heights",
        "a librarian with a secret",
        "a time-travelling mail carrier",
        "a street musician",
        "a shy ghost",
        "a retired pirate",
        "a squirrel planning a heist",
        "a chef on a train",
        "a lonely satellite",
    ),
    "code": (
        "reverses the words in a sentence",
        "counts the vowels in a string",
        "merges two sorted lists",
        "checks whether a year is a leap year",
        "flattens a nested list",
        "removes duplicates while keeping order",
        "converts Celsius to Fahrenheit",
        "finds the longest word in a text",
        "reads a CSV file into a list of dictionaries",
        "computes a moving average",
        "validates an email address with a regular expression",
        "groups words by their length",
        "returns the n most common words in a text",
        "transposes a matrix",
        "formats a number of seconds as hours, minutes and seconds",
        "chunks a list into pieces",
        "parses a query string into a dictionary",
        "computes the factorial iteratively",
        "finds all files with a given extension in a directory",
        "rotates a list by k steps",
    ),
}

#: standard-library modules whose top-level functions give code prompts (pure Python, documented)
STDLIB_MODULES = (
    "textwrap",
    "shlex",
    "fnmatch",
    "glob",
    "posixpath",
    "colorsys",
    "calendar",
    "statistics",
    "string",
    "bisect",
    "heapq",
    "random",
    "fractions",
    "difflib",
    "csv",
    "json/__init__",
    "base64",
    "quopri",
    "uu",
    "html/__init__",
    "urllib/parse",
    "email/utils",
    "shutil",
    "tempfile",
    "filecmp",
    "gettext",
    "locale",
    "inspect",
    "dis",
    "tokenize",
    "ast",
    "copy",
    "pprint",
    "reprlib",
    "functools",
    "operator",
    "ipaddress",
    "mimetypes",
    "platform",
    "sysconfig",
    "zipfile",
    "tarfile",
    "gzip",
    "configparser",
    "argparse",
    "optparse",
    "getopt",
    "pathlib",
    "os",
    "subprocess",
    "threading",
    "queue",
    "sched",
    "timeit",
    "cProfile",
    "pdb",
    "doctest",
    "unittest/util",
    "wave",
    "imghdr",
    "sndhdr",
    "keyword",
    "linecache",
    "codecs",
)


def general_requests(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct requests (fewer if the templates run out), a seeded sample of every
    template x subject pair of ``TEMPLATES`` and ``SUBJECTS``."""
    pairs = [(t, s) for kind, ts in TEMPLATES.items() for t in ts for s in SUBJECTS[kind]]
    random.Random(seed).shuffle(pairs)
    return [t.format(s) for t, s in pairs[:n]]


def stdlib_functions(n: int, seed: int = 0, max_chars: int = 1200) -> list[str]:
    """Up to ``n`` code prompts: the source of a documented top-level function of a module in
    ``STDLIB_MODULES``, from its ``def`` to the end of its docstring, plus a newline. Modules
    missing from this Python are skipped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for name in STDLIB_MODULES:
        path = root / f"{name}.py"
        if not path.is_file():
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = node.body[0] if node.body else None
            if not (
                isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
                and len(node.body) > 1
            ):
                continue
            head = "\n".join(lines[node.lineno - 1 : doc.end_lineno]) + "\n"
            if len(head) <= max_chars:
                found.append(head)
    random.Random(seed).shuffle(found)
    return found[:n]

"""Helpers shared by the kernel tests (importable thanks to pytest.ini's pythonpath)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).parent / "kernels" / "triton_interpreter_worker.py"


class InterpreterProcess:
    """Calls functions of ``kernels/triton_interpreter_worker.py`` in a TRITON_INTERPRET=1 child
    process (the worker's docstring says why the interpreter needs a process of its own)."""

    def __init__(self):
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )

    def __call__(self, name, *args, **kwargs):
        pickle.dump((name, args, kwargs), self.proc.stdin)
        self.proc.stdin.flush()
        try:
            status, value = pickle.load(self.proc.stdout)
        except EOFError as e:
            raise AssertionError(
                f"interpreter worker exited with {self.proc.wait()} (see its stderr)"
            ) from e
        if status == "error":
            exc, child_traceback = value
            exc.add_note(f"raised in the interpreter worker:\n{child_traceback}")
            raise exc
        return value

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)

"""Child process of the kernel tests: runs the Triton kernels in Triton's interpreter on CPU tensors.

Why a separate process: triton 3.9 chooses interpreter or compiler when a function is decorated with
``@triton.jit`` (``knobs.runtime.interpret``), and triton.language's own helpers (``tl.zeros``,
``tl.sum``, ``tl.max``, ...) are decorated when triton is first imported. So ``TRITON_INTERPRET=1``
must be in the environment before the process imports triton at all. A pytest run that also collects
the engine tests has imported triton already (through vLLM), and setting the variable there would
leak into every later test and the vLLM processes they start. The tests therefore start this script
with the variable set and talk to it over stdin/stdout: each request is a pickled
``(name in kernels_testing.KERNEL_CALLS, args, kwargs)``, each reply a pickled ``("ok", result)`` or
``("error", (exception, traceback text))``.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("start this worker with TRITON_INTERPRET=1 in its environment")

# the calls the tests may make live beside the tests' helpers, one folder up
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels_testing import KERNEL_CALLS  # noqa: E402


def main() -> None:
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the reply stream
    while True:
        try:
            name, args, kwargs = pickle.load(requests)
        except EOFError:
            return
        try:
            reply = ("ok", KERNEL_CALLS[name](*args, **kwargs))
        except Exception as exc:  # re-raised in the test, with the child's traceback
            reply = ("error", (exc, traceback.format_exc()))
        try:
            data = pickle.dumps(reply)
        except Exception:  # an exception that does not pickle
            data = pickle.dumps(("error", (RuntimeError(repr(reply[1][0])), reply[1][1])))
        replies.write(data)
        replies.flush()


if __name__ == "__main__":
    main()

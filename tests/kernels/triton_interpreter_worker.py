"""Child process of the kernel tests: runs the Triton kernels in Triton's interpreter on CPU tensors.

Why a separate process: triton 3.9 chooses interpreter or compiler when a function is decorated with
``@triton.jit`` (``knobs.runtime.interpret``), and triton.language's own helpers (``tl.zeros``,
``tl.sum``, ``tl.max``, ...) are decorated when triton is first imported. So ``TRITON_INTERPRET=1``
must be in the environment before the process imports triton at all. A pytest run that also collects
the engine tests has imported triton already (through vLLM), and setting the variable there would
leak into every later test and the vLLM processes they start. The tests therefore start this script
with the variable set and talk to it over stdin/stdout: each request is a pickled
``(function name, args, kwargs)``, each reply a pickled ``("ok", result)`` or
``("error", (exception, traceback text))``.
"""
from __future__ import annotations

import os
import pickle
import sys
import traceback

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("start this worker with TRITON_INTERPRET=1 in its environment")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_selfspec.kernels import lm_head_argmax as lm  # noqa: E402


def forced_dispatch(*args, **kwargs):
    """``lm_head_argmax`` with VLLM_SELFSPEC_FORCE_TRITON=1; returns (its result, kernel launches)."""
    kernel = lm._lm_head_argmax_partial_kernel
    launches = []

    class CountingKernel:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    os.environ[lm.FORCE_TRITON_ENV] = "1"
    lm._lm_head_argmax_partial_kernel = CountingKernel()
    try:
        return lm.lm_head_argmax(*args, **kwargs), len(launches)
    finally:
        lm._lm_head_argmax_partial_kernel = kernel
        del os.environ[lm.FORCE_TRITON_ENV]


FUNCTIONS = {
    "lm_head_argmax_triton": lm.lm_head_argmax_triton,
    "forced_dispatch": forced_dispatch,
    "kernel_is_interpreted": lambda: isinstance(lm._lm_head_argmax_partial_kernel, InterpretedFunction),
}


def main() -> None:
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the reply stream
    while True:
        try:
            name, args, kwargs = pickle.load(requests)
        except EOFError:
            return
        try:
            reply = ("ok", FUNCTIONS[name](*args, **kwargs))
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

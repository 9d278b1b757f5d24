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
from vllm_selfspec.kernels import paged_attention as pa  # noqa: E402


def _forced(module, kernel_names, dispatcher, *args, **kwargs):
    """``dispatcher(*args, **kwargs)`` with VLLM_SELFSPEC_FORCE_TRITON=1; returns (its result, the
    number of launches of each of ``module``'s kernels named in ``kernel_names``)."""
    kernels = {name: getattr(module, name) for name in kernel_names}
    launches = dict.fromkeys(kernel_names, 0)

    class CountingKernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            launches[self.name] += 1
            return kernels[self.name][grid]

    os.environ[module.FORCE_TRITON_ENV] = "1"
    for name in kernel_names:
        setattr(module, name, CountingKernel(name))
    try:
        return dispatcher(*args, **kwargs), launches
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
        del os.environ[module.FORCE_TRITON_ENV]


def forced_dispatch(*args, **kwargs):
    """``lm_head_argmax`` with VLLM_SELFSPEC_FORCE_TRITON=1; returns (its result, kernel launches)."""
    result, launches = _forced(
        lm, ["_lm_head_argmax_partial_kernel"], lm.lm_head_argmax, *args, **kwargs
    )
    return result, launches["_lm_head_argmax_partial_kernel"]


def forced_paged_attention(query, key, value, kv_cache, **kwargs):
    """``paged_attention`` with VLLM_SELFSPEC_FORCE_TRITON=1; returns (output, the cache as written,
    launches per kernel). The cache comes back because the parent's copy is not the one written."""
    out, launches = _forced(
        pa,
        ["_write_kv_kernel", "_paged_attention_partial_kernel"],
        pa.paged_attention,
        query,
        key,
        value,
        kv_cache,
        **kwargs,
    )
    return out, kv_cache, launches


def paged_attention_triton(query, key, value, kv_cache, **kwargs):
    """``paged_attention_triton``; returns (output, the cache as written)."""
    return pa.paged_attention_triton(query, key, value, kv_cache, **kwargs), kv_cache


def write_kv_triton(key, value, kv_cache, slot_mapping):
    """``write_kv_triton``; returns the cache as written."""
    pa.write_kv_triton(key, value, kv_cache, slot_mapping)
    return kv_cache


FUNCTIONS = {
    "lm_head_argmax_triton": lm.lm_head_argmax_triton,
    "forced_dispatch": forced_dispatch,
    "kernel_is_interpreted": lambda: isinstance(
        lm._lm_head_argmax_partial_kernel, InterpretedFunction
    ),
    "paged_attention_triton": paged_attention_triton,
    "forced_paged_attention": forced_paged_attention,
    "write_kv_triton": write_kv_triton,
    "paged_kernels_are_interpreted": lambda: all(
        isinstance(k, InterpretedFunction)
        for k in (pa._write_kv_kernel, pa._paged_attention_partial_kernel)
    ),
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

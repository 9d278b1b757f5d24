"""Helpers shared by the kernel tests (importable thanks to pytest.ini's pythonpath).

Each kernel test runs twice, through the module fixture ``kernel`` its file builds with
``kernel_runner``: once in Triton's interpreter on CPU tensors (``InterpreterProcess``, every
machine) and once compiled on a CUDA GPU (``CompiledKernels``, skipped without one). Both take
the same calls, ``name, *args, **kwargs`` with CPU tensors, run ``KERNEL_CALLS[name]`` and return
CPU tensors, so a test compares either with the PyTorch reference it computes on the CPU.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "kernels" / "triton_interpreter_worker.py"
#: the two ways a kernel test runs the kernels (``kernel_runner``)
RUNNERS = ["interpreter", "cuda"]


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


def _lm():
    from vllm_selfspec.kernels import lm_head_argmax

    return lm_head_argmax


def _pa():
    from vllm_selfspec.kernels import paged_attention

    return paged_attention


def _interpreted(*kernels) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return all(isinstance(k, InterpretedFunction) for k in kernels)


def forced_dispatch(*args, **kwargs):
    """``lm_head_argmax`` with VLLM_SELFSPEC_FORCE_TRITON=1; returns (its result, kernel launches)."""
    name = "_lm_head_argmax_partial_kernel"
    result, launches = _forced(_lm(), [name], _lm().lm_head_argmax, *args, **kwargs)
    return result, launches[name]


# The paged-attention kernels take two views (key_cache, value_cache) of one cache buffer. A
# runner moves each tensor argument with its own copy of its storage (pickling for the
# interpreter process, ``_moved`` for the GPU), so two views sent separately would no longer share
# one buffer: these calls get the buffer once, with each view's (shape, stride, storage offset)
# (``view_specs``), rebuild the views on it where the kernels run, and return the buffer as written.
def view_specs(*views: torch.Tensor) -> tuple:
    """Each view's (shape, stride, storage offset), to rebuild it on its buffer: ``on_views``."""
    return tuple((tuple(v.shape), v.stride(), v.storage_offset()) for v in views)


def on_views(buffer: torch.Tensor, specs) -> list[torch.Tensor]:
    return [buffer.as_strided(shape, stride, offset) for shape, stride, offset in specs]


def paged_attention_triton_on_views(query, key, value, buffer, specs, **kwargs):
    """``paged_attention_triton`` on the views ``specs`` of ``buffer``; returns (output, buffer)."""
    out = _pa().paged_attention_triton(query, key, value, *on_views(buffer, specs), **kwargs)
    return out, buffer


def forced_paged_attention_on_views(query, key, value, buffer, specs, **kwargs):
    """``paged_attention`` with VLLM_SELFSPEC_FORCE_TRITON=1 on the views ``specs`` of ``buffer``;
    returns (output, buffer, launches per kernel)."""
    names = ["_write_kv_kernel", "_paged_attention_partial_kernel"]
    caches = on_views(buffer, specs)
    out, launches = _forced(
        _pa(), names, _pa().paged_attention, query, key, value, *caches, **kwargs
    )
    return out, buffer, launches


def write_kv_triton_on_views(key, value, buffer, specs, slot_mapping):
    """``write_kv_triton`` on the views ``specs`` of ``buffer``; returns the buffer."""
    _pa().write_kv_triton(key, value, *on_views(buffer, specs), slot_mapping)
    return buffer


#: what a test may ask a runner to call
KERNEL_CALLS = {
    "lm_head_argmax_triton": lambda *a, **k: _lm().lm_head_argmax_triton(*a, **k),
    "forced_dispatch": forced_dispatch,
    "kernel_is_interpreted": lambda: _interpreted(_lm()._lm_head_argmax_partial_kernel),
    "paged_attention_triton_on_views": paged_attention_triton_on_views,
    "forced_paged_attention_on_views": forced_paged_attention_on_views,
    "write_kv_triton_on_views": write_kv_triton_on_views,
    "paged_kernels_are_interpreted": lambda: _interpreted(
        _pa()._write_kv_kernel, _pa()._paged_attention_partial_kernel
    ),
}


class InterpreterProcess:
    """Calls ``KERNEL_CALLS`` in a TRITON_INTERPRET=1 child process,
    ``kernels/triton_interpreter_worker.py`` (its docstring says why the interpreter needs a
    process of its own)."""

    compiled = False

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


def _moved(obj, device: str):
    """``obj`` with every tensor in it copied to ``device`` whole: its storage, offset, shape and
    strides, so a strided view (a cache view into a larger buffer) stays one, as pickling keeps it
    for the interpreter process."""
    if torch.is_tensor(obj):
        storage = obj.untyped_storage()
        storage = storage.cuda() if device == "cuda" else storage.cpu()
        return torch.empty(0, dtype=obj.dtype, device=device).set_(
            storage, obj.storage_offset(), obj.shape, obj.stride()
        )
    if isinstance(obj, tuple | list):
        return type(obj)(_moved(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _moved(v, device) for k, v in obj.items()}
    return obj


class CompiledKernels:
    """Calls ``KERNEL_CALLS`` in this process on CUDA copies of the arguments (the kernels compiled
    by Triton) and hands the results back on the CPU."""

    compiled = True

    def __call__(self, name, *args, **kwargs):
        result = KERNEL_CALLS[name](*_moved(args, "cuda"), **_moved(kwargs, "cuda"))
        torch.cuda.synchronize()
        return _moved(result, "cpu")

    def close(self):
        pass


def kernel_runner(kind: str, interpreted_check: str):
    """The runner of ``kind`` (one of ``RUNNERS``), after checking with the call
    ``interpreted_check`` that its kernels are interpreted (interpreter) or compiled (cuda)."""
    if kind == "cuda":
        if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU (compiled Triton)")
        run = CompiledKernels()
    else:
        run = InterpreterProcess()
    assert run(interpreted_check) == (kind == "interpreter")
    return run

"""A cache of freed frame-stack chunks for CPython 3.11 to 3.14, installed in every vLLM process of
a benchmark, so that no engine's speed depends on where its calls fall in Python's frame stack.

CPython keeps a thread's Python frames in chunks of 16 KiB. A call whose frame does not fit in
the current chunk gets a new chunk, mapped from the OS (``mmap``), and the chunk is unmapped
(``munmap``) as soon as that call returns. A loop whose calls sit just at a chunk's end maps and
unmaps a chunk on every call, and pays two system calls and up to four page faults for it each
time (CPython issue gh-142183). CPython's own fix, in recent 3.13 and later releases, keeps one
freed chunk for reuse; 3.11 and 3.12 do not have it.

Where the calls fall is an accident of every frame below them. On this project's CPU machine,
vanilla vLLM's model worker is such a loop: its decode steps map and unmap a chunk over a
thousand times a second. A selfspec worker has a few more frames below the model (the runner's
hooks), so its steps do not cross a chunk's end, and neither do those of a vanilla worker given
one pass-through frame. That accident made selfspec's engines read faster than vanilla in the
benchmarks, drafting or not (docs/performance.md, "A method that drafts nothing", has the
figures).

``build()`` compiles a small allocator with the system's C compiler. It sits in front of
CPython's arena allocator (``PyObject_SetArenaAllocator``): a freed block of one chunk's size is
kept (up to ``SLOTS`` of them) and handed out again, and every other block goes to CPython's own
allocator. Blocks allocated before it was installed are kept or freed alike, since each one, in
the end, goes back to the allocator that made it. ``vllm-selfspec bench`` builds it and names it
in ``ENV`` for its engines; ``plugin.register()`` (every vLLM process) installs it from there
(``install_from_env``), in vanilla's processes and selfspec's alike.

Example (tests/unit/test_frame_stack.py does the same in a child process): a loop of calls
that each cross a chunk's end takes a page fault per crossing, then none once the cache is
installed::

    path = build()            # ~/.cache/vllm_selfspec/build/frame_stack_cache-<hash>.so
    install(path)             # this process, from now on
    chunks_reused(path)       # crossings served from the cache so far
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

logger = logging.getLogger("vllm.selfspec")  # compat.LOGGER_NAME (this module imports no vLLM)

#: the environment variable naming the built library; ``install_from_env`` installs it
ENV = "VLLM_SELFSPEC_FRAME_STACK_CACHE"
#: CPython's frame-stack chunk (``_PY_DATA_STACK_CHUNK_SIZE``, 16 KiB in 3.11 to 3.14)
CHUNK_BYTES = 16 * 1024
#: freed chunks kept for reuse: CPython's own fix keeps one; a few cover nested crossings
SLOTS = 4

SOURCE = r"""
#include <Python.h>

/* CHUNK_BYTES and SLOTS come from the compiler's command line (build) */

static PyObjectArenaAllocator inner;  /* CPython's allocator, which every other block goes to */
static void *kept[SLOTS];
static int n_kept = 0;
static int installed = 0;
static unsigned long long reused = 0;

/* Called with the GIL held, as CPython calls its arena allocator. */
static void *chunk_alloc(void *ctx, size_t size) {
    if (size == CHUNK_BYTES && n_kept > 0) {
        reused++;
        return kept[--n_kept];
    }
    return inner.alloc(inner.ctx, size);
}

static void chunk_free(void *ctx, void *ptr, size_t size) {
    if (size == CHUNK_BYTES && n_kept < SLOTS) {
        kept[n_kept++] = ptr;
        return;
    }
    inner.free(inner.ctx, ptr, size);
}

/* 1 if installed now, 0 if it was already. */
int selfspec_install_frame_stack_cache(void) {
    if (installed)
        return 0;
    PyObjectArenaAllocator mine = {NULL, chunk_alloc, chunk_free};
    PyObject_GetArenaAllocator(&inner);
    PyObject_SetArenaAllocator(&mine);
    installed = 1;
    return 1;
}

/* 1 once installed in this process. */
int selfspec_frame_stack_cache_installed(void) {
    return installed;
}

/* Chunks handed out again instead of mapped anew. */
unsigned long long selfspec_frame_stack_chunks_reused(void) {
    return reused;
}
"""


def unsupported() -> str | None:
    """Why the cache does not apply to this interpreter (None: it does): it is for CPython 3.11
    to 3.14 with the GIL, whose frame stacks are chunked and whose arena allocator runs under
    the GIL."""
    if sys.implementation.name != "cpython":
        return f"not CPython ({sys.implementation.name})"
    if not (3, 11) <= sys.version_info[:2] <= (3, 14):
        return f"CPython {sys.version_info[0]}.{sys.version_info[1]}: not 3.11 to 3.14"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return "a free-threaded CPython build"
    return None


def default_dir() -> Path:
    from .checkpoints import home

    return home() / "build"


def build(out_dir: str | Path | None = None) -> Path:
    """Compiles the cache for this interpreter once (the file name carries a hash of the source
    and the interpreter) and returns the library's path. Raises RuntimeError where it does not
    apply or the compiler fails."""
    reason = unsupported()
    if reason:
        raise RuntimeError(f"the frame-stack cache does not apply here: {reason}")
    defines = [f"-DCHUNK_BYTES={CHUNK_BYTES}", f"-DSLOTS={SLOTS}"]
    key = hashlib.sha256(f"{SOURCE}{defines}{sys.version}{sys.executable}".encode()).hexdigest()
    key = key[:16]
    out = Path(out_dir) if out_dir is not None else default_dir()
    path = out / f"frame_stack_cache-{key}.so"
    if path.exists():
        return path
    out.mkdir(parents=True, exist_ok=True)
    compiler = (sysconfig.get_config_var("CC") or "cc").split()
    include = sysconfig.get_paths()["include"]
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        src, lib = Path(tmp) / "frame_stack_cache.c", Path(tmp) / path.name
        src.write_text(SOURCE, encoding="utf-8")
        cmd = [*compiler, "-shared", "-fPIC", "-O2", *defines, f"-I{include}", str(src)]
        cmd += ["-o", str(lib)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(
                f"the frame-stack cache did not compile ({' '.join(cmd)}): {e}"
            ) from e
        if done.returncode != 0:
            raise RuntimeError(
                f"the frame-stack cache did not compile ({' '.join(cmd)}):\n{done.stderr[-2000:]}"
            )
        os.replace(lib, path)  # whole or not at all, for a concurrent build of the same key
    return path


def install(path: str | Path) -> bool:
    """Installs the cache built at ``path`` in this process; False if it was installed already.
    ``PyDLL``: the calls keep the GIL, as CPython's allocator needs."""
    return bool(ctypes.PyDLL(str(path)).selfspec_install_frame_stack_cache())


def installed(path: str | Path) -> bool:
    """Whether the cache built at ``path`` is installed in this process."""
    return bool(ctypes.PyDLL(str(path)).selfspec_frame_stack_cache_installed())


def chunks_reused(path: str | Path) -> int:
    """Chunks this process's cache handed out again (0 before it is installed)."""
    lib = ctypes.PyDLL(str(path))
    lib.selfspec_frame_stack_chunks_reused.restype = ctypes.c_ulonglong
    return int(lib.selfspec_frame_stack_chunks_reused())


def install_from_env() -> bool:
    """Installs the cache that ``ENV`` names, if any and if it applies here (logged once per
    process); a path that cannot be loaded is logged and left alone."""
    path = os.environ.get(ENV)
    if not path or unsupported():
        return False
    try:
        if install(path):
            logger.info("vllm-selfspec: frame-stack chunk cache installed from %s", path)
            return True
    except (OSError, AttributeError) as e:
        logger.warning("vllm-selfspec: %s=%s could not be installed: %s", ENV, path, e)
    return False

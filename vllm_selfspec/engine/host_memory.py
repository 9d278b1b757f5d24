"""Giving the process allocator's free memory back to the OS, on the CPU build.

A speculative step's CPU tensors come in many sizes: the verification's logits and probabilities
are ``[verified rows, vocabulary]`` float32, about 190 KiB a row for a 49k vocabulary, and the
verified rows change every step (1 to ``1 + k`` per request), where a vanilla step's are its
request count. The allocator keeps what such a step frees for reuse: tcmalloc in its page heap
(returned later, in steps of a hundred MiB or more under a 64-client load), glibc's malloc in
fragmented arenas. Resident memory then climbs with the largest steps seen,
though what the worker holds live does not (docs/user-guide.md, "Load and fault testing").

``FreeMemoryRelease`` hands the free pages back every ``every_s`` seconds, between steps:
tcmalloc's ``MallocExtension_ReleaseFreeMemory`` where tcmalloc is loaded (``LD_PRELOAD``, as
vLLM's CPU guide asks), else glibc's ``malloc_trim(0)``. Neither frees memory in use; a page
given back costs a page fault when it is used again.

    >>> calls = []
    >>> release = FreeMemoryRelease(every_s=30.0, fn=lambda: calls.append(1), clock=iter(
    ...     [0.0, 10.0, 31.0, 40.0, 62.0]).__next__)
    >>> [release.maybe_release() for _ in range(4)]  # at 10, 31, 40 and 62 s (started at 0)
    [False, True, False, True]
    >>> release.releases
    2
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable


def allocator_release() -> tuple[str, Callable[[], object]] | None:
    """The loaded allocator's call that returns its free memory to the OS: ("tcmalloc", ...) or
    ("glibc", ...), or None where neither is found (jemalloc, musl)."""
    try:
        process = ctypes.CDLL(None)
    except OSError:
        return None
    tcmalloc = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if tcmalloc is not None:
        tcmalloc.restype, tcmalloc.argtypes = None, []
        return "tcmalloc", tcmalloc
    if getattr(process, "mallctl", None) is not None:  # jemalloc preloaded: its own purging
        return None
    trim = getattr(process, "malloc_trim", None)
    if trim is None:
        return None
    trim.restype, trim.argtypes = ctypes.c_int, [ctypes.c_size_t]
    return "glibc", lambda: trim(0)


class FreeMemoryRelease:
    """Calls ``fn`` (the allocator's release) at most once every ``every_s`` seconds."""

    #: how often the worker gives its allocator's free memory back: often enough that resident
    #: memory follows what the worker holds within a minute. Each call, and the page faults when
    #: the pages are used again, cost the step they fall in (``seconds`` sums the calls)
    EVERY_S = 30.0

    def __init__(
        self,
        every_s: float = EVERY_S,
        fn: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_s = every_s
        self.fn = fn
        self.clock = clock
        self.last = clock()
        self.releases = 0  # calls made
        self.seconds = 0.0  # their wall time, summed

    def maybe_release(self) -> bool:
        """Release if ``every_s`` passed since the last release (or the start); whether it did."""
        now = self.clock()
        if self.fn is None or now - self.last < self.every_s:
            return False
        t = time.perf_counter()
        self.fn()
        self.seconds += time.perf_counter() - t
        self.releases += 1
        self.last = now
        return True

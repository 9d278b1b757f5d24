"""engine/host_memory.py: the worker's periodic release of its allocator's free memory."""

import ctypes

from vllm_selfspec.engine import host_memory
from vllm_selfspec.engine.host_memory import FreeMemoryRelease, allocator_release


def test_releases_at_most_once_per_interval_counting_from_the_start():
    now = [100.0]
    calls = []
    release = FreeMemoryRelease(every_s=30.0, fn=lambda: calls.append(now[0]), clock=lambda: now[0])
    for t in (110.0, 129.9, 130.0, 131.0, 159.9, 160.0):
        now[0] = t
        release.maybe_release()
    assert calls == [130.0, 160.0]
    assert release.releases == 2 and release.seconds >= 0.0


def test_without_an_allocator_call_nothing_is_released():
    release = FreeMemoryRelease(every_s=0.0, fn=None)
    assert not release.maybe_release()
    assert release.releases == 0


def test_this_process_allocator_is_found_and_its_release_runs():
    """glibc's malloc_trim here (tcmalloc's call where it is preloaded): resolved from the
    process's own symbols, and callable between steps."""
    found = allocator_release()
    assert found is not None
    kind, fn = found
    assert kind in ("tcmalloc", "glibc")
    fn()


def test_tcmalloc_is_preferred_and_jemalloc_left_alone(monkeypatch):
    class Process:
        def __init__(self, **symbols):
            self.__dict__.update(symbols)

    def tcmalloc_release():
        return None

    def trim(pad):
        return 1

    monkeypatch.setattr(
        ctypes,
        "CDLL",
        lambda name: Process(MallocExtension_ReleaseFreeMemory=tcmalloc_release, malloc_trim=trim),
    )
    assert host_memory.allocator_release()[0] == "tcmalloc"
    monkeypatch.setattr(ctypes, "CDLL", lambda name: Process(mallctl=object(), malloc_trim=trim))
    assert host_memory.allocator_release() is None
    monkeypatch.setattr(ctypes, "CDLL", lambda name: Process(malloc_trim=trim))
    kind, fn = host_memory.allocator_release()
    assert kind == "glibc" and fn() == 1

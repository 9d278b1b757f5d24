"""Cache directories replaced atomically, under a lock: trained heads, the vocabulary map with its
datastore, prepared checkpoints.

A writer builds the new version in a temporary directory of its own beside the cache
(``.<name>.tmp-<pid>-<random>``), then publishes it::

    with staged(out) as tmp:        # a fresh, empty directory beside ``out``
        write_everything_into(tmp)
    # here ``out`` is the new version, complete; the old one is gone

Publishing takes ``.<name>.lock`` (``fcntl.flock``, exclusive; readers of several files hold it
shared: ``reading``) and swaps the two directories in one
``renameat2(RENAME_EXCHANGE)`` call, so a reader sees the old version or the new one, whole,
never neither or a half-written one, and a crash at any point leaves one of them in place. Two
writers of the same cache never share a temporary name; the later publish wins. Under the lock,
temporaries left by writers that died (their pid no longer alive) are removed.

Where the filesystem cannot exchange (not Linux, or a filesystem without RENAME_EXCHANGE) the
old version is renamed aside and the new one renamed in, two renames under the lock; a crash
between them leaves the old version under ``.<name>.old-<pid>-<random>``, which the next
``staged`` of that cache puts back before it writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: renameat2's flag: swap the two paths atomically (both must exist)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = None


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one system call; False where the platform or filesystem can't."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _libc.renameat2  # noqa: B018 (glibc >= 2.28)
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    rc = _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _owner(path: Path) -> int | None:
    """The pid in a temporary's name (``.<name>.tmp-<pid>-<random>``), None if it has none."""
    parts = path.name.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


@contextlib.contextmanager
def locked(out: Path, shared: bool = False) -> Iterator[None]:
    """``out``'s lock (``.<name>.lock`` beside it), held for the block: exclusive for a writer
    publishing, shared (``shared=True``) for a reader of several files of one version. A reader
    that may not create the lock file (a read-only cache) reads without it."""
    try:
        if not shared:
            out.parent.mkdir(parents=True, exist_ok=True)
        f = open(out.parent / f".{out.name}.lock", "a+")
    except OSError:
        if not shared:
            raise
        yield
        return
    with f:
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
        except BlockingIOError:  # another process holds it: say why this one stops here
            print(
                f"vllm-selfspec: waiting for {out} (another process holds its lock)",
                file=sys.stderr,
            )
            fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def reading(out: str | Path) -> contextlib.AbstractContextManager[None]:
    """Read a cache's files under its shared lock: all of them from one version, none removed
    while read (a writer publishes under the exclusive lock)."""
    return locked(Path(out), shared=True)


def _clean(out: Path) -> None:
    """Under the lock: put back an old version a crashed fallback publish left aside (if ``out``
    is gone), and remove the temporaries of writers that are no longer running."""
    mine = os.getpid()
    old = sorted(out.parent.glob(f".{out.name}.old-*"), key=lambda p: p.stat().st_mtime)
    for p in old + sorted(out.parent.glob(f".{out.name}.tmp-*")):
        pid = _owner(p)
        if pid is None or pid == mine or _alive(pid):
            continue
        if ".old-" in p.name and not out.exists() and (p / "v").is_dir():
            os.rename(p / "v", out)
        shutil.rmtree(p, ignore_errors=True)


def publish(tmp: Path, out: Path) -> None:
    """Replace ``out`` with the directory ``tmp`` (beside it) atomically, under the lock; the
    old version is removed."""
    with locked(out):
        _clean(out)
        if not out.exists():
            os.rename(tmp, out)
        elif _exchange(tmp, out):
            shutil.rmtree(tmp)  # now the old version
        else:
            aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
            os.rename(out, aside / "v")
            os.rename(tmp, out)
            shutil.rmtree(aside)


@contextlib.contextmanager
def staged(out: str | Path) -> Iterator[Path]:
    """A fresh, empty directory beside ``out`` to write the new version into; published over
    ``out`` (``publish``) when the block ends without an exception, removed if it raises."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(out):
        _clean(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        yield tmp
        publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def staged_file(path: str | Path) -> Iterator[Path]:
    """A unique temporary file name beside ``path`` to write; ``os.replace``d onto ``path`` when
    the block ends without an exception (a reader sees the old file or the new one, whole)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: str | Path, obj) -> None:
    """Write a small JSON file atomically (``staged_file``)."""
    with staged_file(path) as tmp:
        tmp.write_text(json.dumps(obj), encoding="utf-8")


def file_sha256(path: str | Path) -> str:
    """A file's SHA-256 (hex), read in 1 MiB blocks: the content hash caches record."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

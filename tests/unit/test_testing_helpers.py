"""The test helpers that touch the machine outside the test's own files."""

from __future__ import annotations

import mmap

from selfspec_testing import remove_leaked_cpu_shm


def test_leaked_cpu_shm_is_removed_unless_a_process_maps_it(tmp_path):
    leaked = tmp_path / "40881-tp:0-[0-1]-cpushm_0"
    live = tmp_path / "40883-tp:0-[0-1]-cpushm_1"
    other = tmp_path / "psm_0cfaace0"
    for p in (leaked, live, other):
        p.write_bytes(b"\0" * 4096)
    with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096):
        removed = remove_leaked_cpu_shm(str(tmp_path))
    assert removed == [str(leaked)]
    assert not leaked.exists() and live.exists() and other.exists()

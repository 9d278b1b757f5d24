"""``benchmarks/gpu_check.sh --cpu`` on the embedded model: every step of the GPU check runs here,
small (parity, the bench against a peer, the kernel tests, the report), so that the script works
when a GPU first runs it. Parity of a plan drafter and of ``auto`` (every method's parity on the
CPU is in tests/engine/test_parity.py and its siblings), of Cascade where its heads are cached
(else its skip), and the bench against suffix decoding: each engine costs half a minute here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]
#: a parity row of the report: method, batch, parity, drafted, accepted, result
PARITY_ROW = re.compile(r"^\| (\w+) \| (\d+) \| ([\d.]+) \| (\d+) \| (\d+) \| (\w+) \|$", re.M)
#: a speed row: batch, method
SPEED_ROW = re.compile(r"^\| (\d+) \| (\w+) \| [\d.]+ \| [\d.]+x \|", re.M)


def test_gpu_check_runs_on_the_cpu(model_path, tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run(
        [
            "bash",
            "benchmarks/gpu_check.sh",
            model_path,
            "--cpu",
            "--out",
            str(out),
            "--methods",
            "layerskip,cascade,auto",
            "--peers",
            "suffix",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
    )
    report = (out / "report.md").read_text()
    assert proc.returncode == 0, report + proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "**PASS**" in report
    rows = PARITY_ROW.findall(report)
    ran = {r[0] for r in rows}
    assert {"layerskip", "auto"} <= ran <= {"layerskip", "cascade", "auto"}, rows
    for method, batch, parity, drafted, _accepted, result in rows:
        assert (parity, result) == ("1.00", "pass") and int(drafted) > 0, (method, batch)
    if "cascade" not in ran:  # no heads cached for the model
        assert "* cascade: skipped, no trained cascade heads" in report
    assert "* del:" not in report and "* feature:" not in report  # not asked for
    speed = set(SPEED_ROW.findall(report))
    assert speed == {("2", m) for m in ("vanilla", "suffix", "auto")}
    assert re.search(r"kernels_gpu\.sh .*: \d+ skipped", report), "the kernel tests did not run"

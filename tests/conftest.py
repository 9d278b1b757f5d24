"""Shared fixtures, and how the suite runs on two cores.

``make test`` runs two pytest-xdist workers (pytest.ini: ``-n 2 --dist loadfile``): each test file
runs whole on one worker, so that its module fixtures (a vanilla engine's references, built heads)
are made once, and what must not run beside itself shares a file (the tensor-parallel engines,
which take both cores and clean up each other's shared memory, are all in test_tp.py; every test
of the `vllm serve` server is in test_serve.py, which starts it once). An engine in a worker
computes on one thread, so that two workers share the two cores rather than oversubscribe them.
``pytest -n 0`` runs the suite in one process, in file order.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # before torch is imported: its thread pool's size
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def model_path() -> str:
    from vllm_selfspec.checkpoints import prepare_embedded_model

    return str(prepare_embedded_model(progress=False))

"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_path() -> str:
    from vllm_selfspec.checkpoints import prepare_embedded_model

    return str(prepare_embedded_model(progress=False))

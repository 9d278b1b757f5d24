"""What every engine test shares: the selfspec policies' own draft lengths by default."""

from __future__ import annotations

import pytest

from vllm_selfspec import config


@pytest.fixture(autouse=True)
def policies_draft_their_own_lengths(monkeypatch):
    """The engine tests check drafting mechanisms (parity, sampling, TP, ...). On this CPU the
    goodput controller rightly turns most self-drafting off, which would leave them nothing to
    check, so configs built in this process default to ``"goodput": false`` (each policy's own
    draft lengths). The controller's engine tests set ``"goodput": true`` explicitly; engines in
    other processes (the served example configs, Ray actors) use the product default unless
    their config says otherwise."""
    monkeypatch.setitem(config.COMMON_OPTIONS, "goodput", False)

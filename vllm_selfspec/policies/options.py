"""Checks of option values that the policies and the config share. JSON's true and false are
Python bools, and a bool is an int to ``isinstance``: an option that wants a number must refuse
them explicitly, or ``"omega": true`` would read as 1."""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """An integer option value (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An integer or float option value (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)

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


def is_int_list(value: Any) -> bool:
    """A list of integer option values (not bools, not floats such as ``12.0``)."""
    return isinstance(value, list) and all(is_int(x) for x in value)

"""Small helpers shared by the leader and the workers."""

from __future__ import annotations

from typing import Any


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (how many blocks of b hold a tokens)."""
    return -(-a // b)


INT64_MAX = 2**63 - 1


def is_int(v: Any) -> bool:
    """An int that is not a bool (msgpack and JSON both hand bools over as ints' kin)."""
    return isinstance(v, int) and not isinstance(v, bool)


def shown(v: Any) -> str:
    """A client's value in an error message: a number (or bool, or None) as it is,
    anything else by its type and length. Messages go back to clients and into logs, so
    they never echo what a client sent."""
    if v is None or isinstance(v, (bool, float)) or (isinstance(v, int) and abs(v) < 2**64):
        return repr(v)
    return f"a {type(v).__name__}" + (f" of length {len(v)}" if hasattr(v, "__len__") else "")

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

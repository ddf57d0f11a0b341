"""Small helpers shared by the leader and the workers."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (how many blocks of b hold a tokens)."""
    return -(-a // b)

"""The rule both sides of the plan follow for "does this sequence sample this step".

The leader predicts which sequences a plan makes sample (it counts their tokens as
pending before the result arrives, for async scheduling); the workers decide which rows
to sample. Both must agree exactly, so the rule lives here once, torch-free (the leader
cannot import the worker package) and shape-agnostic (ints or numpy arrays alike).
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def samples_after_step(num_computed_tokens: T, num_known_tokens: T) -> T:
    """True where a sequence samples a token in a step: once the step has computed every
    token it knows (num_computed_tokens counted after the step; num_known_tokens: prompt +
    generated, and on the leader the tokens still in flight), the last hidden state
    predicts a token nobody has yet. A prefill chunk that stops short samples nothing."""
    return num_computed_tokens == num_known_tokens

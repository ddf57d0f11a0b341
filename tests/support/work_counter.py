"""Work counted without a clock, for scaling tests: the Python lines a block executes in
chosen source trees (``sys.settrace``, this thread only), in all and per function.

A per-request cost that grows with the number of live requests (a scan over every
request per step or per message) shows as more lines for the same work when more
requests are live, on any machine and under any load; a wall-clock assertion would not.
Work done inside C (``list.remove``, ``in list``, ``sorted``) is not counted: it is cheap
per item, and the Python loops around such calls are.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from types import FrameType
from typing import Any

import nvllm

NVLLM = os.path.dirname(nvllm.__file__)


class LineCounter:
    """``with LineCounter(root, ...) as c:`` counts lines run in files under the roots
    (default: the nvllm package) into ``c.lines`` and ``c.by_function``."""

    def __init__(self, *roots: str) -> None:
        self.roots = tuple(os.path.join(os.path.abspath(r), "") for r in roots or (NVLLM,))
        self.lines = 0
        self.by_function: Counter[str] = Counter()

    def _call(self, frame: FrameType, event: str, arg: Any):
        code = frame.f_code
        if code.co_filename.startswith(self.roots):
            name = f"{os.path.basename(code.co_filename)}:{code.co_qualname}"

            def line(f: FrameType, e: str, a: Any):
                if e == "line":
                    self.lines += 1
                    self.by_function[name] += 1
                return line
            return line
        return None  # other code runs untraced

    def __enter__(self) -> LineCounter:
        self._previous = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.settrace(self._previous)

    def grown(self, smaller: LineCounter, factor: float) -> dict[str, tuple[int, int]]:
        """Functions that ran more than `factor` times the lines they ran in `smaller`
        (plus a few, for functions that barely ran): name -> (smaller's, this one's)."""
        return {k: (smaller.by_function[k], n) for k, n in self.by_function.items()
                if n > factor * smaller.by_function[k] + 20}

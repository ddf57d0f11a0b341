"""EngineOutput: which step produced each delta, kept right through extend()."""

from __future__ import annotations

from nvllm.common.outputs import CompletionDelta
from nvllm.leader.output_processor import EngineOutput


def _d(rid: str) -> CompletionDelta:
    return CompletionDelta(rid, 0, [1], "x")


def test_step_of_each_delta_through_extend():
    out = EngineOutput([_d("expired")])  # an abort's delta: no step
    out.deltas += [_d("a"), _d("b")]
    out.steps.append((1, 3, 7))
    out.deltas.append(_d("c"))
    out.steps.append((3, 4, 8))
    other = EngineOutput([_d("aborted"), _d("d")], steps=[(1, 2, 9)])
    out.extend(other)
    assert [out.step_of(k) for k in range(len(out.deltas))] == [None, 7, 7, 8, None, 9]
    assert [d.request_id for d in out.deltas] == ["expired", "a", "b", "c", "aborted", "d"]

"""cpu_ops.argmax_rows: torch.argmax(dim=-1)'s indices exactly, on the rows greedy
sampling sees (random, tied, masked to -inf, +-0, infinite, NaN, strided, one column)."""

from __future__ import annotations

import pytest
import torch

from nvllm.kernels import cpu_ops
from nvllm.worker.sampler import argmax_rows

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="nvllm's CPU ops are not built")

INF, NAN = float("inf"), float("nan")


def rows_like_logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 1000, generator=g)
    x[1, [7, 300, 999]] = 50.0  # a tie: the first wins
    x[2] = -INF  # a row masked whole: index 0
    x[3, :] = -INF
    x[3, 640] = -3.0  # a grammar allowing one token (in the last partial block of 64)
    x[4] = 0.0
    x[4, 5] = -0.0
    x[4, 2] = -0.0  # -0.0 and +0.0 are equal: the first of them
    x[5, 17] = INF
    x[5, 900] = INF
    x[6, 40] = NAN  # NaN counts as the maximum, the first one wins
    x[6, 41] = INF
    x[6, 800] = NAN
    x[7, 999] = 1e30  # the maximum in the very last element
    x[8] = -torch.arange(1000, dtype=torch.float32)  # all negative, the first largest
    x[9, 0] = 1e30
    x[10] = torch.finfo(torch.float32).min
    x[11, 123] = -NAN  # a negative NaN is a NaN too
    return x


def test_same_indices_as_torch():
    x = rows_like_logits()
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 16000, 49152])
def test_every_width_and_strided_rows(vocab):
    g = torch.Generator().manual_seed(vocab)
    base = torch.randn(37, vocab + 5, generator=g)
    x = base[:, 2:2 + vocab]  # rows not adjacent: stride(0) > vocab
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_the_sampler_falls_back_where_the_op_does_not_apply():
    x = torch.randn(4, 100, dtype=torch.float64)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    y = torch.randn(100, 4).t()  # columns contiguous, rows not
    assert torch.equal(argmax_rows(y), y.argmax(dim=-1))


def test_bad_arguments_are_refused():
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="V > 0"):
        cpu_ops.argmax_rows(torch.zeros(2, 0))

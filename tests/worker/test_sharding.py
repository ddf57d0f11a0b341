"""The one sharding rule (nvllm/worker/sharding.py) and the layers that use it: shares
cover every unit once, heads are cut by KV group with a uniform local grouping, each
rank loads exactly its slice (reading only it), and the row-parallel partial sums over
the ranks add up to the whole layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_ranks import run_ranks, uneven_vocab

from nvllm.worker.layers.embed_head import VocabParallelEmbedding
from nvllm.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nvllm.worker.layers.moe import SparseMoE
from nvllm.worker.parallel import TPContext
from nvllm.worker.sharding import HeadShard, head_partition, shard_sizes, shard_span

F32 = torch.float32


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class LazySrc:
    """A lazy checkpoint slice as the loaders see one (safetensors, GGUF): get_shape()
    and indexing by a tuple of slices; it records what was read and refuses whole reads."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.reads = t, []

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        assert all(isinstance(i, slice) for i in index), index
        self.reads.append(index)
        return self.t[index]


# ---- shard_sizes ---------------------------------------------------------------------


@pytest.mark.parametrize("total,world,granule", [
    (9, 2, 1), (1536, 2, 1), (1031, 3, 1), (131, 3, 1), (3, 4, 1), (0, 3, 1),
    (256 * 7, 3, 256), (32 * 5, 2, 32), (49152, 3, 32), (5, 1, 1)])
def test_shard_sizes_cover_everything_evenly_first_ranks_first(total, world, granule):
    sizes = shard_sizes(total, world, granule)
    assert len(sizes) == world and sum(sizes) == total
    assert all(n % granule == 0 for n in sizes)
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= granule
    spans = [shard_span(total, world, r, granule) for r in range(world)]
    assert [e - s for s, e in spans] == sizes
    assert [x for s, e in spans for x in range(s, e)] == list(range(total))


def test_shard_sizes_examples_and_errors():
    assert shard_sizes(9, 2) == [5, 4]
    assert shard_sizes(1031, 2) == [516, 515]
    assert shard_sizes(256 * 5, 2, 256) == [768, 512]
    with pytest.raises(ValueError, match="cannot shard 100 in granules of 32: 100 is not a "
                                         "multiple of 32"):
        shard_sizes(100, 2, 32)
    with pytest.raises(ValueError, match="over 0 ranks"):
        shard_sizes(4, 0)


# ---- head_partition --------------------------------------------------------------------

CASES = [(9, 3, 2), (9, 3, 3), (14, 2, 2), (14, 2, 3), (28, 4, 2), (28, 4, 3), (4, 1, 2),
         (4, 2, 4), (8, 2, 8), (32, 8, 3), (32, 8, 5), (12, 3, 8), (9, 9, 4), (2, 1, 2)]


@pytest.mark.parametrize("heads,kv,world", CASES)
def test_head_partition_covers_every_query_head_once_with_its_kv_head(heads, kv, world):
    parts = head_partition(heads, kv, world)
    assert len(parts) == world
    group = heads // kv
    q_held = [q for p in parts for q in range(p.q_head_start, p.q_head_start + p.num_q_heads)]
    assert q_held == list(range(heads))  # contiguous, in rank order, each once
    kv_held = {h for p in parts for h in range(p.kv_head_start,
                                               p.kv_head_start + p.num_kv_heads)}
    assert kv_held == set(range(kv))
    for p in parts:
        assert p.num_q_heads >= 1 and p.num_kv_heads >= 1
        # Uniform local grouping: local query head j reads local KV head j // p.group,
        # which is its own global KV head.
        assert p.num_q_heads % p.num_kv_heads == 0
        for j in range(p.num_q_heads):
            assert p.kv_head_start + j // p.group == (p.q_head_start + j) // group
    if kv >= world:  # whole KV heads: none held twice
        assert sum(p.num_kv_heads for p in parts) == kv


def test_head_partition_examples():
    assert head_partition(9, 3, 2) == [HeadShard(0, 6, 0, 2), HeadShard(6, 3, 2, 1)]
    assert head_partition(14, 2, 3) == [HeadShard(0, 4, 0, 1), HeadShard(4, 3, 0, 1),
                                        HeadShard(7, 7, 1, 1)]
    assert [p.num_q_heads for p in head_partition(28, 4, 3)] == [14, 7, 7]
    # Even cases are what they always were.
    assert head_partition(8, 2, 4) == [HeadShard(2 * r, 2, r // 2, 1) for r in range(4)]
    with pytest.raises(ValueError, match="tensor_parallel_size=5 is larger than "
                                         "num_attention_heads=4"):
        head_partition(4, 2, 5)
    with pytest.raises(ValueError, match="not a multiple"):
        head_partition(6, 4, 2)


# ---- layers ----------------------------------------------------------------------------


@pytest.mark.parametrize("heads,kv,world", [(9, 3, 2), (14, 2, 3), (28, 4, 3), (4, 1, 3)])
def test_attention_shards_load_their_slices_and_o_proj_sums_to_the_whole(heads, kv, world):
    """qkv_proj loads each rank's query heads and their KV heads (reading only those
    rows); o_proj's uneven column slices give partial sums that add up to the full
    projection of the full attention output."""
    d, hidden = 4, 16
    wq = torch.randn(heads * d, hidden, generator=gen(1))
    wk = torch.randn(kv * d, hidden, generator=gen(2))
    wv = torch.randn(kv * d, hidden, generator=gen(3))
    wo = torch.randn(hidden, heads * d, generator=gen(4))
    bq = torch.randn(heads * d, generator=gen(5))
    x = torch.randn(3, hidden, generator=gen(6))
    attn_out = torch.randn(3, heads * d, generator=gen(7))  # stands in for attention
    total = torch.zeros(3, hidden)
    for rank in range(world):
        tp = TPContext(rank=rank, world_size=world)
        qkv = QKVParallelLinear(hidden, d, heads, kv, True, tp, F32)
        srcs = {"q": LazySrc(wq), "k": LazySrc(wk), "v": LazySrc(wv)}
        for sid, src in srcs.items():
            qkv.weight.weight_loader(qkv.weight, src, sid)
            assert src.reads and all(r[0].stop - r[0].start < src.t.shape[0] or world == 1
                                     or kv == 1 for r in src.reads)
        qkv.bias.weight_loader(qkv.bias, LazySrc(bq), "q")
        h = head_partition(heads, kv, world)[rank]
        assert (qkv.num_heads, qkv.num_kv_heads) == (h.num_q_heads, h.num_kv_heads)
        q_rows = slice(h.q_head_start * d, (h.q_head_start + h.num_q_heads) * d)
        kv_rows = slice(h.kv_head_start * d, (h.kv_head_start + h.num_kv_heads) * d)
        nq = h.num_q_heads * d
        torch.testing.assert_close(qkv.weight[:nq], wq[q_rows], rtol=0, atol=0)
        torch.testing.assert_close(qkv.weight[nq:nq + h.num_kv_heads * d], wk[kv_rows],
                                   rtol=0, atol=0)
        torch.testing.assert_close(qkv.weight[nq + h.num_kv_heads * d:], wv[kv_rows],
                                   rtol=0, atol=0)
        torch.testing.assert_close(qkv.bias[:nq], bq[q_rows], rtol=0, atol=0)
        torch.testing.assert_close(qkv(x)[:, :nq], x @ wq[q_rows].T + bq[q_rows])
        o = RowParallelLinear(heads * d, hidden, False, tp, F32,
                              input_span=(q_rows.start, q_rows.stop))
        src = LazySrc(wo)
        o.weight.weight_loader(o.weight, src)
        torch.testing.assert_close(o.weight, wo[:, q_rows], rtol=0, atol=0)
        total += o.partial(attn_out[:, q_rows])
    torch.testing.assert_close(total, attn_out @ wo.T)
    assert QKVParallelLinear(hidden, d, heads, kv, False, TPContext(), F32).num_heads == heads


@pytest.mark.parametrize("inter,world,granule", [(131, 2, 1), (131, 3, 1), (96, 2, 32),
                                                 (160, 3, 32)])
def test_mlp_shards_sum_to_the_whole(inter, world, granule):
    hidden = 8
    wg = torch.randn(inter, hidden, generator=gen(8))
    wu = torch.randn(inter, hidden, generator=gen(9))
    wd = torch.randn(hidden, inter, generator=gen(10))
    x = torch.randn(5, hidden, generator=gen(11))
    want = (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
    total, sizes = torch.zeros(5, hidden), []
    for rank in range(world):
        tp = TPContext(rank=rank, world_size=world)
        gu = MergedColumnParallelLinear(hidden, [inter] * 2, False, tp, F32, granule)
        gu.weight.weight_loader(gu.weight, LazySrc(wg), 0)
        gu.weight.weight_loader(gu.weight, LazySrc(wu), 1)
        down = RowParallelLinear(inter, hidden, False, tp, F32, granule)
        down.weight.weight_loader(down.weight, LazySrc(wd))
        g, u = gu(x).chunk(2, dim=-1)
        total += down.partial(F.silu(g) * u)
        sizes.append(down.input_size_per_partition)
    assert sizes == shard_sizes(inter, world, granule)
    torch.testing.assert_close(total, want)


def test_moe_tensor_parallel_experts_split_an_uneven_intermediate():
    """Experts' intermediate 50 on 3 ranks (17 + 17 + 16): partial sums add up to tp=1."""
    e, hidden, inter = 4, 8, 50
    gate_up = torch.randn(e, 2 * inter, hidden, generator=gen(12)) / 3
    down = torch.randn(e, hidden, inter, generator=gen(13)) / 7
    router = torch.randn(e, hidden, generator=gen(14))
    x = torch.randn(6, hidden, generator=gen(15))

    def partial(rank, world):
        moe = SparseMoE(hidden, e, inter, 2, True, TPContext(rank, world), False, F32, "torch")
        moe.gate.weight.data.copy_(router)
        moe.load_gate_up(moe.experts.gate_up_proj, LazySrc(gate_up), None)
        moe.load_down(moe.experts.down_proj, LazySrc(down), None)
        return moe.partial(x)

    torch.testing.assert_close(sum(partial(r, 3) for r in range(3)), partial(0, 1))


def test_vocab_shards_read_only_their_rows():
    w = torch.randn(1031, 4, generator=gen(16))
    got = []
    for rank in range(3):
        emb = VocabParallelEmbedding(1031, 4, TPContext(rank, 3), F32)
        src = LazySrc(w)
        emb.weight.weight_loader(emb.weight, src)
        assert [r[0] for r in src.reads] == [slice(emb.vocab_start, emb.vocab_end)]
        got.append(emb.weight.data)
    assert [t.shape[0] for t in got] == [344, 344, 343]
    assert torch.equal(torch.cat(got), w)


def test_uneven_vocab_on_gloo(tmp_path):
    assert run_ranks(uneven_vocab, 2, str(tmp_path)) == [True] * 2

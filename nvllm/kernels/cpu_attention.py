"""CPU attention backend: each running sequence's K/V also kept contiguous.

The paged cache scatters a sequence's K/V over blocks, so the reference reads them by
gathering the blocks into a fresh copy in every layer of every step. On CPU that gather
costs about as much as the attention itself. Here each running sequence keeps its own
copy, ``[layers, 2, kv_heads, capacity, head_dim]`` (head-major: each head's keys are one
contiguous run, which SDPA reads fastest); a step appends its K/V to the copy and SDPA
reads it in place. The paged cache is still written: it is what prefix hits share and
what a copy is rebuilt from.

The copies are a second home for what running sequences hold, so ``CpuKVStore`` keeps
them within their own byte budget. A sequence that does not fit reads its pages (the
reference path) until the budget has room for a copy again; both paths give the same
values bit for bit, as ``attention`` runs the reference's own SDPA calls.

Sequences with a copy and a few new tokens (1..``cpu_ops.MAX_QUERIES``: decodes,
speculative verify rows of the last token and k drafts, short prompt chunks) go to the
native kernel (``cpu_ops``, ``csrc/cpu_decode_attention.cpp``) when it is built: one call
per layer appends every such sequence's K/V to its copy and attends over it, each query
over the keys up to its own position, where the SDPA path makes one call per sequence.
Longer prompt runs, and sequences without a copy, stay on SDPA.

The model runner owns one ``CpuKVStore``: ``views_for_step`` before each (micro-)batch,
whose result it puts in ``AttentionMetadata.cpu_kv``, and ``drop`` when a sequence ends or
is preempted. ``ops.attention`` sends a layer here when the metadata carries those views.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nvllm.kernels import cpu_ops, reference
from nvllm.kernels.metadata import AttentionMetadata, cdiv

logger = logging.getLogger(__name__)

MIN_CAPACITY = 64  # tokens: a new copy's smallest size (short prompts still decode a while)


@dataclass(slots=True)
class DecodeRows:
    """The step's sequences that the native kernel serves (those with a copy and
    1..cpu_ops.MAX_QUERIES new tokens: decodes, verify rows, short prompt chunks), as the
    int64 vectors it reads: each one's first row in the step's tokens, its copy's address
    and capacity, and its context length after this step. ``query_lens``: each one's new
    tokens (rows[i] onwards), None when every one has a single token. ``seqs`` are their
    indices in the step. The kernel also writes their K/V into the paged cache, at
    ``slot_mapping[token_rows]`` (``slots``: taken by the step's first layer, which every
    other layer reuses)."""

    seqs: list[int]
    rows: torch.Tensor
    bases: torch.Tensor
    caps: torch.Tensor
    lens: torch.Tensor
    query_lens: torch.Tensor | None
    token_rows: torch.Tensor  # every row of the kernel's runs, in order
    slots: torch.Tensor | None = None
    # Whether the kernel's rows are the step's every row: set by the step's first layer
    # (attention or decode_qkv), which every other layer reuses.
    all_rows: bool | None = None


@dataclass(slots=True)
class StepViews:
    """One step's views into the copies, per sequence and layer: ``dst[i][l]`` is where
    this step's K/V go (``[2, kv_heads, n, d]``), ``keys[i][l]``/``values[i][l]`` what
    attention reads (``[1, kv_heads, ctx, d]``). Sequences without a copy, and those in
    ``decode`` (the kernel's), have None; ``with_copy`` lists the ones with views. Made
    once per step: slicing each copy again in every layer cost a third of decode
    attention's time."""

    dst: list[tuple[torch.Tensor, ...] | None]
    keys: list[tuple[torch.Tensor, ...] | None]
    values: list[tuple[torch.Tensor, ...] | None]
    with_copy: list[int]
    decode: DecodeRows | None = None
    # Each sequence's copy starts at this position (> 0 only with a window: the store
    # keeps the window's tail); keys[i][l] holds positions firsts[i]..ctx - 1.
    firsts: list[int] | None = None


class CpuKVStore:
    """The contiguous K/V copies of running sequences, by sequence id, within a budget.

    A copy grows by doubling (capped at the model's length), and one that starts
    mid-sequence (after a prefix hit, or recomputation after preemption) is built from the
    paged cache. When growing would overrun the budget the sequence loses its copy
    entirely, so it stays on one path (the pages) rather than splitting across two.

    With a ``window`` (every layer sliding; None otherwise) a copy holds only the tail
    the next queries can see: when full it shifts its last window - 1 tokens to the front
    instead of growing, so it stays within window + the step's tokens + a window of
    slack, and it is built from the pages of that tail only (the leader may have given
    the older blocks back).
    """

    def __init__(self, kv_cache: torch.Tensor, budget_bytes: int, max_model_len: int,
                 native_decode: bool = True, window: int | None = None) -> None:
        """kv_cache: the paged cache, ``[2, layers, num_blocks, block_size, kv_heads, d]``.
        native_decode: send decoding sequences to the native kernel where it loads and
        supports the shapes (float32 or bfloat16, <= 16 query heads per KV head,
        head_dim <= 256)."""
        self.kv_cache = kv_cache
        self.budget_bytes = budget_bytes
        self.max_model_len = max_model_len
        self.window = window
        self.nbytes = 0
        self.copies: dict[int, torch.Tensor] = {}
        self.offsets: dict[int, int] = {}  # position of each copy's first token
        self.native_decode = (native_decode
                              and kv_cache.dtype in (torch.float32, torch.bfloat16)
                              and kv_cache.shape[-1] <= 256 and cpu_ops.load())

    def drop(self, seq_id: int) -> None:
        """Free a sequence's copy (it finished, was preempted, or lost its place)."""
        kv = self.copies.pop(seq_id, None)
        self.offsets.pop(seq_id, None)
        if kv is not None:
            self.nbytes -= kv.nbytes

    def views_for_step(self, seq_ids: list[int], block_tables: Sequence[Sequence[int]],
                       query_lens: list[int], context_lens: list[int]) -> StepViews:
        """Make room in each sequence's copy for this step's tokens (sequence i computes
        its last query_lens[i] of context_lens[i] tokens) and return the step's views."""
        dst: list[tuple[torch.Tensor, ...] | None] = []
        keys: list[tuple[torch.Tensor, ...] | None] = []
        values: list[tuple[torch.Tensor, ...] | None] = []
        with_copy: list[int] = []
        firsts: list[int] = []
        dec: list[list[int]] = [[], [], [], [], [], []]  # seqs, rows, bases, caps, lens, n
        token_rows: list[int] = []
        row = 0
        for i, (sid, table, n, ctx) in enumerate(zip(seq_ids, block_tables, query_lens,
                                                     context_lens)):
            buf = self._copy_for(sid, table, ctx - n, ctx)
            off = self.offsets.get(sid, 0) if buf is not None else 0
            firsts.append(off)
            if buf is None or (self.native_decode and 1 <= n <= cpu_ops.MAX_QUERIES):
                if buf is not None:  # the kernel sees the copy's positions: ctx - off
                    for col, x in zip(dec, (i, row, buf.data_ptr(), buf.shape[3],
                                            ctx - off, n)):
                        col.append(x)
                    token_rows.extend(range(row, row + n))
                dst.append(None)
                keys.append(None)
                values.append(None)
            else:
                with_copy.append(i)
                dst.append(buf[:, :, :, ctx - n - off:ctx - off].unbind(0))
                keys.append(buf[:, 0:1, :, :ctx - off].unbind(0))
                values.append(buf[:, 1:2, :, :ctx - off].unbind(0))
            row += n
        decode = None
        if dec[0]:
            rows, bases, caps, lens, qlens = (torch.tensor(c, dtype=torch.long)
                                              for c in dec[1:])
            one_each = len(token_rows) == len(dec[0])
            decode = DecodeRows(dec[0], rows, bases, caps, lens, None if one_each else qlens,
                                rows if one_each else torch.tensor(token_rows,
                                                                   dtype=torch.long))
        return StepViews(dst, keys, values, with_copy, decode, firsts)

    def _copy_for(self, seq_id: int, block_table: Sequence[int], done: int,
                  end: int) -> torch.Tensor | None:
        """The sequence's copy with room for its tokens up to `end`, those before `done`
        filled (from self.offsets[seq_id] on); None (read the pages) when the budget is
        spent."""
        kv = self.copies.get(seq_id)
        off = self.offsets.get(seq_id, 0)
        if kv is not None and kv.shape[3] >= end - off:
            return kv
        w = self.window
        # With a window, keep only what the step's first query sees.
        start = max(off, done - w + 1) if w else 0
        if kv is not None and w and kv.shape[3] >= end - start:
            # Full: shift the tail to the front (clone: the ranges may overlap).
            kv[:, :, :, :done - start] = kv[:, :, :, start - off:done - off].clone()
            self.offsets[seq_id] = start
            return kv
        need = end - start
        if w:
            cap = max(MIN_CAPACITY, need + w)
        else:
            cap = max(MIN_CAPACITY, end, 2 * kv.shape[3] if kv is not None else 0)
        cap = min(cap, max(need, self.max_model_len - start))
        _, layers, _, bs, kvh, d = self.kv_cache.shape
        size = 2 * layers * cap * kvh * d * self.kv_cache.dtype.itemsize
        grow = size - (0 if kv is None else kv.nbytes)
        if self.nbytes + grow > self.budget_bytes:
            self.drop(seq_id)
            logger.debug("contiguous K/V budget spent: a sequence reads its pages")
            return None
        new = torch.empty(layers, 2, kvh, cap, d, dtype=self.kv_cache.dtype,
                          device=self.kv_cache.device)
        if kv is not None:
            new[:, :, :, :done - start] = kv[:, :, :, start - off:done - off]
        elif done > start:  # from the pages of positions start..done - 1 only
            blocks = torch.as_tensor(block_table[start // bs:cdiv(done, bs)], dtype=torch.long,
                                     device=new.device)
            pages = self.kv_cache[:, :, blocks].reshape(2, layers, -1, kvh, d)
            a = start % bs
            new[:, :, :, :done - start] = pages[:, :, a:a + done - start].permute(1, 0, 3, 2, 4)
        logger.debug("contiguous K/V: %s to %d tokens (%d computed)",
                     "grown" if kv is not None else ("built" if done else "new"), cap, done)
        self.nbytes += grow
        self.copies[seq_id] = new
        self.offsets[seq_id] = start
        return new


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
              layer: int, window: int | None = None) -> torch.Tensor:
    """One layer's attention step over meta.cpu_kv: store this step's K/V
    ([T, kv_heads, d]) in the paged cache and append them to the copies at `layer`, then
    attend (within `window`, None: full), reading each sequence's copy in place (or its
    pages, if it has none)."""
    views = meta.cpu_kv
    dec = views.decode
    # The kernel's rows only: it stores every one itself.
    all_rows = dec is not None and serves_all_rows(dec, meta, q.shape[0])
    if not all_rows:  # (the kernel's rows, if any, are then stored twice: harmless)
        reference.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    cu = meta.cu_seqlens_q_host
    lens = [cu[i + 1] - cu[i] for i in range(meta.num_seqs)]
    if views.with_copy:
        # One call writes this layer's K/V into every sequence's copy.
        src = torch.stack((k, v), 1).permute(1, 2, 0, 3).split(lens, dim=2)
        torch._foreach_copy_([views.dst[i][layer] for i in views.with_copy],
                             [src[i] for i in views.with_copy])
    keys, values, firsts = views.keys, views.values, views.firsts

    def kv_of(i: int, first: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if keys[i] is not None:
            return keys[i][layer], values[i][layer], firsts[i]
        first -= first % k_cache.shape[1]
        return (*reference.gather_kv(k_cache, v_cache, meta, i, first), first)

    if dec is None:
        return reference.attend_runs(q, meta, scale, kv_of, lens, window)
    out = torch.empty_like(q)
    cpu_ops.decode_attention(out, q, k, v, k_cache, v_cache, dec.slots, dec.rows, dec.bases,
                             dec.caps, dec.lens, layer, scale, window or 0, dec.query_lens)
    if len(dec.seqs) < meta.num_seqs:
        _attend_the_rest(out, q, meta, set(dec.seqs), kv_of, scale, window)
    return out


def _attend_the_rest(out: torch.Tensor, q: torch.Tensor, meta: AttentionMetadata,
                     native: set[int], kv_of, scale: float, window: int | None) -> None:
    """out's rows of the sequences the native kernel did not serve (not in `native`):
    SDPA over the K/V kv_of reads, the reference's arithmetic."""
    cu = meta.cu_seqlens_q_host
    for i in range(meta.num_seqs):
        a, b = cu[i], cu[i + 1]
        if i in native or a == b:
            continue
        ctx = meta.seq_lens_host[i]
        ki, vi, first = reference.visible_kv(kv_of, i, ctx, b - a, window)
        o = reference.attend_run(q[a:b].transpose(0, 1).unsqueeze(0), ki, vi, ctx, scale,
                                 window, first)
        out[a:b] = o[0].transpose(0, 1)


def serves_all_rows(dec: DecodeRows, meta: AttentionMetadata, tokens: int) -> bool:
    """Whether the kernel serves every row of the step; also takes dec.slots (once)."""
    if dec.all_rows is None:
        dec.all_rows = len(dec.token_rows) == tokens
        dec.slots = meta.slot_mapping if dec.all_rows else meta.slot_mapping[dec.token_rows]
    return dec.all_rows


def decode_qkv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, heads: int, kv_heads: int, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, layer: int,
               window: int | None = None) -> torch.Tensor | None:
    """A step's attention from the fused projection ``qkv``
    ([T, (heads + 2 kv_heads) d]) in one native call: neox rotary (cos/sin: the float32
    [max_pos, d] tables), the K/V stores and attention, as split + rotary_embedding +
    ``attention`` compute them (the same values); [T, heads * d]. None when the step is not
    the kernel's alone (some sequence prefills more than cpu_ops.MAX_QUERIES tokens or
    reads its pages): the caller takes the general path."""
    views = meta.cpu_kv
    dec = views.decode if views is not None else None
    if dec is None or not serves_all_rows(dec, meta, qkv.shape[0]):
        return None
    return cpu_ops.decode_attention_qkv(qkv, positions, cos, sin, heads, kv_heads, k_cache,
                                        v_cache, dec.slots, dec.rows, dec.bases, dec.caps,
                                        dec.lens, layer, scale, window or 0,
                                        dec.query_lens)


@dataclass(slots=True)
class PagedRows:
    """The sequences of a step the native kernel serves in paged mode (no contiguous
    copies: the runner keeps none, ``cpu_kv_mirror=False``): those with 1..MAX_QUERIES new
    tokens (decodes, verify rows, short prompt chunks). The int64 vectors it reads, made
    once per step by its first layer; ``seqs`` are their indices in the step and
    ``all_rows`` whether they are every row (else the others go to SDPA)."""

    seqs: list[int]
    rows: torch.Tensor  # each one's first row
    lens: torch.Tensor  # context length after the step
    query_lens: torch.Tensor | None  # None: one token each
    slots: torch.Tensor
    block_tables: torch.Tensor  # int32 [len(seqs), max_blocks]
    all_rows: bool


def paged_rows(meta: AttentionMetadata, k_cache: torch.Tensor, heads: int,
               kv_heads: int) -> PagedRows | None:
    """The step's PagedRows, or None when the native kernel serves none of it (only long
    prompt runs, a padding slot, a shape or dtype it lacks, the ops not built); decided by
    the step's first layer and kept in ``meta.cpu_paged`` for the others."""
    if meta.cpu_paged is None:
        meta.cpu_paged = _paged_rows(meta, k_cache, heads, kv_heads) or False
    return meta.cpu_paged or None


def _paged_rows(meta: AttentionMetadata, k_cache: torch.Tensor, heads: int,
                kv_heads: int) -> PagedRows | None:
    bs, d = k_cache.shape[1], k_cache.shape[-1]
    if (k_cache.dtype not in (torch.float32, torch.bfloat16) or d > 256 or bs & (bs - 1)
            or heads % kv_heads or heads // kv_heads > 16 or meta.num_seqs == 0
            or k_cache.device.type != "cpu" or not cpu_ops.load()):
        return None
    cu = meta.cu_seqlens_q_host
    seqs = [i for i in range(meta.num_seqs) if 1 <= cu[i + 1] - cu[i] <= cpu_ops.MAX_QUERIES]
    if not seqs:
        return None
    qlens = [cu[i + 1] - cu[i] for i in seqs]
    all_rows = len(seqs) == meta.num_seqs
    if all_rows:
        slots, tables = meta.slot_mapping, meta.block_tables
    else:
        token_rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in seqs])
        index = torch.tensor(seqs, dtype=torch.long)
        slots, tables = meta.slot_mapping[token_rows], meta.block_tables[index]
    if bool((slots < 0).any()):
        return None
    return PagedRows(seqs, torch.tensor([cu[i] for i in seqs], dtype=torch.long),
                     torch.tensor([meta.seq_lens_host[i] for i in seqs], dtype=torch.long),
                     None if all(n == 1 for n in qlens) else torch.tensor(qlens,
                                                                          dtype=torch.long),
                     slots.to(torch.long), tables.to(torch.int32).contiguous(), all_rows)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor | None:
    """``attention`` reading the pages, stores included: the paged kernel for its
    sequences (paged_rows), SDPA over gathered pages for the others (the reference's
    arithmetic); None when the kernel serves none (the caller takes the reference)."""
    pr = paged_rows(meta, k_cache, q.shape[1], k.shape[1])
    if pr is None:
        return None
    if not pr.all_rows:  # the others' K/V (the kernel stores its own, again: harmless)
        reference.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    cpu_ops.paged_decode_attention(out, q, k, v, k_cache, v_cache, pr.slots, pr.rows,
                                   pr.block_tables, pr.lens, scale, window or 0, pr.query_lens)
    if not pr.all_rows:

        def kv_of(i: int, first: int) -> tuple[torch.Tensor, torch.Tensor, int]:
            first -= first % k_cache.shape[1]
            return (*reference.gather_kv(k_cache, v_cache, meta, i, first), first)

        _attend_the_rest(out, q, meta, set(pr.seqs), kv_of, scale, window)
    return out


def paged_decode_qkv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, heads: int, kv_heads: int, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     window: int | None = None) -> torch.Tensor | None:
    """decode_qkv in paged mode: None unless the paged kernel serves every row of the step
    (the caller then splits, rotates and calls ``attention``)."""
    pr = paged_rows(meta, k_cache, heads, kv_heads)
    if pr is None or not pr.all_rows:
        return None
    return cpu_ops.paged_decode_attention_qkv(qkv, positions, cos, sin, heads, kv_heads,
                                              k_cache, v_cache, pr.slots, pr.rows,
                                              pr.block_tables, pr.lens, scale, window or 0,
                                              pr.query_lens)

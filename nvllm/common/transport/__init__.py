"""Zero-copy transport for bulky arrays in msgpack messages (prompt token arrays, block
tables, logprob tensors, prompt embeddings).

A message carries an ArrayRef (a short list) instead of the array. On one host the array
lives in a reusable shared-memory ring owned by the writer; an inline ref carries the
bytes themselves (an empty array, a payload under ``min_shm_bytes``, ``inline_ref``).
Readers resolve both kinds with the same call.

API
---
Writer (one per producing process; one producer thread, acks from any thread)::

    w = ArrayWriter(capacity_bytes=16 << 20, slot_bytes=64 << 10, num_readers=1,
                    timeout_s=1.0, min_shm_bytes=0)
    refs = w.put_many([a, b, ...])            # one region, one generation -> [ArrayRef]
    ref = w.put(a)
    res = w.reserve([(shape, dtype), ...])    # fill res.arrays in place (no staging copy)
    refs = res.commit()                       # or res.abort(); refs exist only after commit
    w.acked(reader, generation)               # reader is done with everything <= generation
    w.acked_all(generation); w.reclaim_all()  # all readers; readers replaced
    w.holders(generation) -> int; w.last_generation; w.name; w.close()

    ref.encode() -> list                      # what goes in the msgpack message
    inline_ref(array) -> ArrayRef             # the cross-host / ring-full fallback

Reader (one per consuming process)::

    r = ArrayReader()
    arr = r.get(ref_or_list)   # a read-only numpy view
    r.check(ref)               # StaleRef if the region was rewritten since
    g = r.release(generation)  # cumulative value to send back for the writer's acked()
    r.close()

Errors: BadRef (a ProtocolError, so a ValueError) for anything a reader cannot resolve:
malformed list, unknown dtype, bad shape, out-of-range offset/length, unknown buffer
name; StaleRef (a BadRef) when the region's generation changed. RingFull (a
TimeoutError) when no region was acknowledged in time; its message names the fixes.
TransportError when a writer cannot be set up (no POSIX shared memory, no room in
/dev/shm).

Guarantees: no per-step allocation (a fixed ring, regions reused in order); a region is
reused only once every reader acknowledged its generation, and the writer waits at most
timeout_s for that; each ref's generation is checked against the ring's table in shared
memory, so a reader never silently reads a rewritten region. Ring names are
``nvllm-tr-PID-TOKEN`` (unique; "nvllm" for /dev/shm leak checks); the owner unlinks on
close(), on garbage collection and at exit (weakref.finalize), and if it is killed,
its janitor does (nvllm/common/shm_janitor.py: a shell that waits on a pipe only the
owner holds, started once per process; rings are made with shm_open, so
multiprocessing's resource tracker never starts). Readers map rings read-only. Nothing is
ever unpickled.

Intended integration (leader -> workers plan path)
--------------------------------------------------
- Leader: at start, ``ArrayWriter()`` when every rank runs on the leader's host
  (nvllm/launch/engine_builder.py); with ranks on other nodes there is no writer and
  plans travel as lists. num_readers=1 (see acks). Close it after the workers stopped.
- _build_plan: pack each step's bulk data into one reservation, CSR style: all new
  sequences' token ids in one int32 array plus offsets, all block ids likewise
  (``vals[:] = list(itertools.chain.from_iterable(lists))`` converts in one C call,
  straight into the ring), and running sequences as columns (seq ids, tokens to
  compute) rather than one record each: per-record msgpack work, not bytes, is what a
  decode step costs (docs/benchmarks.md, "Plan transport"). The plan carries
  ``[ref.encode() for ref in refs]``; protocol decoding checks them with
  ``ArrayRef.decode`` (raises BadRef, a ProtocolError). Remember ``step_id ->
  res.generation`` (0 when it went inline: nothing to ack). Use min_shm_bytes=16 KiB:
  smaller payloads are as fast inline.
- Acks with no wire change: ranks run a step in lockstep (the forward pass has
  collectives), so rank 0's StepResult for step N means every rank is past its input
  preparation for N; the leader calls ``w.acked_all(generation_of_step_N)`` on it. This
  holds if workers copy what they keep (WorkerSeq.token_ids, block tables) out of the
  views while preparing inputs, before the first collective, and hold no view past it.
  Explicit alternative: num_readers=world size, each rank returns ``r.release(g)`` in its
  reply and the leader calls ``w.acked(rank, g)``.
- A plan a worker rejects (InvalidPlan) is not held either: ack its generation with the
  WorkerError. After a worker-group restart call ``w.reclaim_all()``. On RingFull send
  that step inline (``inline_ref``) and log it; it means acks are not arriving.
- Workers: one ``ArrayReader`` per process; ``r.get(ref)`` during plan validation, so a
  BadRef becomes InvalidPlan and leaves the worker's state untouched. The views are
  read-only: ``torch.from_numpy`` on one warns once (not writable); copy what is kept
  (``torch.tensor(view)``, ``view.tolist()``), which also ends its use of the ring.
  bfloat16 travels as uint16 (``t.view(torch.uint16).numpy()`` /
  ``torch.from_numpy(a).view(torch.bfloat16)``).
"""

from nvllm.common.transport.reader import ArrayReader
from nvllm.common.transport.refs import (
    DTYPES,
    INLINE,
    SHM,
    ArrayRef,
    BadRef,
    RingFull,
    StaleRef,
    dtype_name,
    inline_ref,
)
from nvllm.common.transport.ring import (
    ArrayWriter,
    Reservation,
    TransportError,
    new_buffer_name,
)

__all__ = [
    "DTYPES", "INLINE", "SHM", "ArrayReader", "ArrayRef", "ArrayWriter", "BadRef",
    "Reservation", "RingFull", "StaleRef", "TransportError", "dtype_name", "inline_ref",
    "new_buffer_name",
]

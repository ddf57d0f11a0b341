"""Weight updates from a trainer (update_weights) and pause/resume, end to end: an engine
started on checkpoint A and updated to checkpoint B's tensors (same shapes, other seed)
generates what HF generates on B, token for token, at tp 1 and 2; a partial update
changes only its tensors; a refused update leaves the old weights in force; the prefix
cache never serves KV from before an update; every request ends exactly once whatever
the pause mode."""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch
from served import serve, teardown
from weight_ckpts import (  # noqa: F401 (ckpts: a fixture)
    GREEDY,
    MAX_TOKENS,
    PROMPTS,
    _run,
    ckpts,
    hf_greedy,
    hf_refs,
)

from nvllm import LLM, AsyncClient, Client, SamplingParams
from nvllm.common.weight_transfer import WeightUpdateError

pytestmark = pytest.mark.e2e

SMALL_CHUNK = 16 << 10  # several chunks, and tensors larger than one chunk
LONG = 40  # tokens of the request held across an update


def _trainer(endpoint: str, folder, mode: str) -> subprocess.CompletedProcess:
    script = pathlib.Path(__file__).parents[1] / "support" / "rl_trainer.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run([sys.executable, str(script), endpoint, str(folder), mode],
                          capture_output=True, text=True, timeout=120, env=env)


def test_served_update_from_a_trainer_process_at_tp2(ckpts):  # noqa: F811
    """A trainer process pushes B through nvllm.Client (its own shared memory, the
    leader forwarding the refs) into a tp=2 engine; a trainer killed mid-update leaves
    the weights as they were."""
    folder, a, b, b_dir = ckpts
    llm = LLM(folder, tensor_parallel_size=2, device="cpu", dtype="float32", block_size=8,
              client_timeout_s=1.0)
    s = serve(llm)
    try:
        with Client(s.endpoint, timeout_s=60) as client:
            def run() -> list:
                return [client.generate(p, GREEDY) for p in PROMPTS]

            assert [o.token_ids for o in run()] == hf_refs(folder, "A", a)
            died = _trainer(s.endpoint, b_dir, "die")
            assert died.returncode == 3, died.stderr[-2000:]
            time.sleep(1.5)  # past client_timeout_s: the leader drops its staging
            assert [o.token_ids for o in run()] == hf_refs(folder, "A", a)
            assert s.server.rollout.update_id is None

            done = _trainer(s.endpoint, b_dir, "update")
            assert done.returncode == 0 and "version=B" in done.stdout, done.stderr[-2000:]
            after = run()
            assert [o.token_ids for o in after] == hf_refs(folder, "B", b)
            assert all(o.weight_version == "B" for o in after)
        # AsyncClient: a partial update (A's final norm) while a request is held.
        norm = "model.norm.weight"
        toks, version, finish = asyncio.run(_async_partial(s.endpoint, {norm: a[norm]}))
        assert version == 3 and finish == ("length", 3)
        # Its first k tokens came from B before the pause, the rest from B with A's norm,
        # its KV recomputed: k is where it leaves B's own continuation (or earlier, if
        # the new weights happen to agree for a while).
        on_b = hf_greedy(folder, b, PROMPTS[1], LONG)
        k0 = next((i for i, (x, y) in enumerate(zip(toks, on_b)) if x != y), len(toks))
        mixed = {**b, norm: a[norm]}
        assert 0 < k0 < len(toks) and any(
            toks[k:] == hf_greedy(folder, mixed, PROMPTS[1] + toks[:k], len(toks) - k)
            for k in range(k0, 0, -1))
    finally:
        teardown(s)


async def _async_partial(endpoint: str, tensors: dict) -> tuple:
    """Stream a request; once it has tokens, pause (keep), update, resume: it goes on and
    ends once. Returns its tokens, the new version and its final (reason, version)."""
    client = AsyncClient(endpoint, timeout_s=60)
    params = SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True)
    first = asyncio.Event()
    deltas: list = []

    async def consume() -> None:
        async for d in client.stream(PROMPTS[1], params):
            deltas.append(d)
            first.set()

    try:
        task = asyncio.create_task(consume())
        await first.wait()
        await client.pause_generation(mode="keep")
        version = await client.update_weights(tensors, weight_version=3)
        await client.resume_generation()
        await task
    finally:
        client.close()
    ends = [(d.finish_reason, d.weight_version) for d in deltas if d.finish_reason]
    assert len(ends) == 1
    return [t for d in deltas for t in d.token_ids], version, ends[0]


def test_update_refusal_partial_and_pause_modes(ckpts):  # noqa: F811
    """tp=1, one engine: a full update, two refused ones, a partial one, then every
    pause mode (keep across an update)."""
    folder, a, b, _ = ckpts
    with LLM(folder, device="cpu", dtype="float32", block_size=8) as llm:
        before = _run(llm)
        assert [o.token_ids for o in before] == hf_refs(folder, "A", a)
        assert all(o.weight_version is None for o in before)

        hits = llm.engine.kv.stats.hits
        assert llm.update_weights(b.items(), weight_version="B",
                                  chunk_bytes=SMALL_CHUNK) == "B"
        after = _run(llm)
        assert [o.token_ids for o in after] == hf_refs(folder, "B", b)
        # The same prompts again, but nothing computed on A may be hit: only the third
        # prompt may reuse the first's two full blocks, computed on B in this batch.
        assert llm.engine.kv.stats.hits - hits <= 16
        assert all(o.weight_version == "B" and o.outputs[0].weight_version == "B"
                   for o in after)

        # One wrong shape among good tensors: refused on every rank, B stays in force.
        q0 = "model.layers.0.self_attn.q_proj.weight"
        bad = {q0: a[q0], "model.norm.weight": torch.ones(3)}
        with pytest.raises(WeightUpdateError, match=r"model\.norm\.weight.*shape"):
            llm.update_weights(bad, weight_version="bad")
        with pytest.raises(WeightUpdateError, match="not a tensor of this model"):
            llm.update_weights({"model.layers.9.mlp.up_proj.weight": torch.ones(2, 2)})
        assert [o.token_ids for o in _run(llm)] == hf_refs(folder, "B", b)
        assert llm.weight_version == "B"

        # Partial: A's q_proj (a third of the fused q/k/v) and gate_proj (half of
        # gate/up) of layer 0, in bfloat16 (cast on the way in); the rest stays B.
        names = [q0, "model.layers.0.mlp.gate_proj.weight"]
        part = {n: a[n].to(torch.bfloat16) for n in names}
        assert llm.update_weights(part) == 2  # no version given: the count of updates
        mixed = {**b, **{n: t.float() for n, t in part.items()}}
        assert [o.token_ids for o in _run(llm)] == hf_refs(folder, "mixed", mixed)
        llm.update_weights(b, weight_version="B")
        _pause_modes(llm, folder, a)


def _pause_modes(llm: LLM, folder: str, a: dict[str, torch.Tensor]) -> None:
    eng = llm.engine

    def submit(n: int) -> list[str]:
        return [eng.submit(prompt_token_ids=PROMPTS[i % 3], params=GREEDY).request_id
                for i in range(n)]

    def drive(ids: list[str]) -> dict[str, object]:
        done: dict[str, object] = {}
        while eng.has_unfinished_requests():
            for o in eng.step().finished:
                assert o.request_id not in done
                done[o.request_id] = o
        assert set(done) == set(ids)
        return done

    # abort: every running (and waiting) request ends now, with "abort", once.
    ids = submit(3)
    eng.step()
    out = llm.pause_generation(mode="abort")
    assert sorted(o.request_id for o in out) == sorted(ids)
    assert all(o.finish_reason == "abort" for o in out)
    late = submit(1)  # arrives while paused: waits
    for _ in range(3):
        assert not eng.step().finished
    llm.resume_generation()
    drive(late)

    # wait: running requests finish; one that arrives meanwhile waits for resume.
    ids = submit(2)
    eng.step()
    out = llm.pause_generation(mode="wait")
    late = submit(1)
    assert sorted(o.request_id for o in out) == sorted(ids)
    assert all(len(o.token_ids) == MAX_TOKENS for o in out)
    assert not eng.step().finished
    llm.resume_generation()
    drive(late)

    # keep: held across an update (B -> A), their KV recomputed on A: each goes on as HF
    # on A continues its prompt plus the tokens it had made on B.
    ids = submit(2)
    for _ in range(4):
        eng.step()
    llm.pause_generation(mode="keep")
    so_far = {rid: list(eng.requests[rid].seqs[0].token_ids) for rid in ids}
    llm.update_weights(a, weight_version=7)
    llm.resume_generation()
    done = drive(ids)
    for rid in ids:
        toks = so_far[rid]
        made = toks[len(done[rid].prompt_token_ids):]
        assert 0 < len(made) < MAX_TOKENS
        want = made + hf_greedy(folder, a, toks, MAX_TOKENS - len(made))
        assert done[rid].token_ids == want
        assert done[rid].weight_version == 7

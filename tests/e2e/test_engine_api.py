"""The LLM API beyond greedy exactness: seeded sampling, rejections, n > 1, logprobs,
bf16, and process lifetime (shutdown, parent death, worker death)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nvllm import LLM, SamplingParams
from nvllm.common import worker_protocol as protocol
from nvllm.common.errors import EngineDeadError

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(tiny("qwen3"), device="cpu", dtype="float32", tensor_parallel_size=2,
             block_size=8, max_model_len=256, num_kv_blocks=64) as engine:
        yield engine


def assert_no_blocks_held(llm):
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_seeded_sampling_reproducible_across_runs_and_batches(llm):
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    target = "The quick brown fox"
    alone = llm.generate(target, p, use_tqdm=False)[0].token_ids
    again = llm.generate(target, p, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate(["Hello there", target, "Once upon a time in a land far away"],
                         [others, p, others.clone(seed=7)], use_tqdm=False)[1].token_ids
    assert alone == again == mixed
    other_seed = llm.generate(target, p.clone(seed=4321), use_tqdm=False)[0].token_ids
    assert other_seed != alone
    assert_no_blocks_held(llm)


def test_unseeded_sampling_varies(llm):
    p = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(["Once upon a time"] * 4, p, use_tqdm=False)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_rejections_name_the_limit_and_the_rest_proceed(llm):
    vocab = llm.config.model_info.vocab_size
    good = "Name a prime number larger than ten."
    prompts = [
        list(range(1, 300)),  # longer than max_model_len=256
        good,
        [5, 6, vocab + 3],  # outside the vocabulary
        list(range(1, 250)),  # 249 + max_tokens 16 > 256
        [],  # empty
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert [o.finish_reason == "error" for o in outs] == [True, False, True, True, True]
    assert outs[1].finish_reason in ("stop", "length")
    assert "prompt has 299 tokens, max_model_len is 256" in outs[0].error
    assert outs[1].error is None and outs[1].token_ids
    assert f"token id {vocab + 3}" in outs[2].error and "vocabulary" in outs[2].error
    assert "exceeds max_model_len 256" in outs[3].error and "max_tokens" in outs[3].error
    assert "empty" in outs[4].error
    huge_n = llm.generate(good, SamplingParams(n=10**8, max_tokens=4), use_tqdm=False)[0]
    assert "n=100000000 exceeds max_num_seqs 256" in huge_n.error
    # The engine keeps serving, and the rejected requests held no blocks.
    again = llm.generate(good, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert again[0].token_ids == outs[1].token_ids
    assert_no_blocks_held(llm)


def test_a_malformed_prompt_adds_nothing(llm):
    """A prompt of the wrong type in the middle of a batch is a TypeError that leaves no
    request behind (none of the batch was added), so the next call is unaffected."""
    with pytest.raises(TypeError, match="unsupported prompt type"):
        llm.generate(["Hello", [5, 6, 7], 42, "World"], SamplingParams(max_tokens=4),
                     use_tqdm=False)
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="needs 'prompt' or 'prompt_token_ids'"):
        llm.generate([[5, 6, 7], {"text": "x"}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.requests
    assert_no_blocks_held(llm)


def test_request_larger_than_kv_cache_is_rejected(tiny):
    with LLM(tiny("qwen3"), device="cpu", dtype="float32", block_size=8,
             num_kv_blocks=4) as small:
        out = small.generate([list(range(1, 40))], SamplingParams(max_tokens=8),
                             use_tqdm=False)[0]
        assert "KV cache holds only 32 tokens" in out.error
        ok = small.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)[0]
        assert ok.error is None and len(ok.token_ids) >= 1


def test_n_completions_and_logprobs(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, logprobs=2)
    out = llm.generate("Why is the sky blue?", p, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds seed, seed+1, seed+2
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 8
        for tok, lps in zip(c.token_ids, c.logprobs):
            assert tok in lps and len(lps) <= 3
            assert all(v <= 0.0 for v in lps.values())
            assert sum(math.exp(v) for v in lps.values()) <= 1.0 + 1e-5
    assert_no_blocks_held(llm)


def test_stop_token_ids_and_min_tokens(llm):
    base = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = llm.generate("Once upon a time", base, use_tqdm=False)[0].token_ids
    stop_at = ref[3]
    first = ref.index(stop_at)
    out = llm.generate("Once upon a time", base.clone(stop_token_ids=[stop_at]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:first + 1]
    # min_tokens masks the stop token until reached.
    out = llm.generate("Once upon a time",
                       base.clone(stop_token_ids=[stop_at], min_tokens=first + 2),
                       use_tqdm=False)[0]
    assert len(out.token_ids) >= first + 2
    assert stop_at not in out.token_ids[:first + 2]


def test_bfloat16_runs_and_tracks_float32(tiny):
    """bf16 cannot equal float32 token for token (near-ties flip under rounding); the
    criterion of tests/e2e/test_cuda.py, over the whole generated sequence: against HF run
    in float32 on the engine's own output (teacher forcing), every generated token is in
    HF's top-5 at its position, and at least 90% of them are HF's top-1."""
    import hf_ref

    model = tiny("qwen3-bf16")
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42], list(range(100, 140))]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(model, device="cpu", tensor_parallel_size=2) as bf:
        assert bf.config.dtype == "bfloat16"
        outs_bf = bf.generate([{"prompt_token_ids": q} for q in prompts], p, use_tqdm=False)
    top1 = total = 0
    for q, out in zip(prompts, outs_bf):
        assert len(out.token_ids) == 24
        top5 = hf_ref.logprobs(model, q, out.token_ids).topk(5, dim=-1).indices.tolist()
        for pos, t in enumerate(out.token_ids):
            assert t in top5[pos], f"token {t} at {pos} is outside HF fp32's top-5"
            top1 += t == top5[pos][0]
            total += 1
    assert top1 / total >= 0.9, f"only {top1}/{total} tokens are HF's top-1"


def test_shutdown_stops_every_worker(tiny, procs):
    llm = LLM(tiny("qwen3"), device="cpu", tensor_parallel_size=2)
    pids = llm.worker_pids
    assert all(procs.pid_alive(p) for p in pids)
    llm.shutdown()
    assert not any(procs.pid_alive(p) for p in pids)
    llm.shutdown()  # idempotent


def test_workers_die_with_their_parent(tiny, procs):
    code = textwrap.dedent(f"""
        import os, sys
        from nvllm import LLM
        llm = LLM({tiny("qwen3")!r}, device="cpu", tensor_parallel_size=2)
        print(*llm.worker_pids, flush=True)
        os.kill(os.getpid(), 9)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2, proc.stderr
    deadline = time.monotonic() + 10
    while any(procs.pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(procs.pid_alive(p) for p in pids), "workers outlived their parent"


def _death_is_reported(llm, sig: int, match: str, max_tokens: int, within_s: float, procs):
    """Signal worker rank 1 and generate: an EngineDeadError matching `match` within
    `within_s`, no KV block left held, and no worker left after shutdown."""
    pids = llm.worker_pids
    try:
        os.kill(pids[1], sig)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=match):
            llm.generate(["Hello"] * 4, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         use_tqdm=False)
        assert time.monotonic() - t0 < within_s
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    finally:
        llm.shutdown()  # SIGKILL also reaches a stopped process
    assert not any(procs.pid_alive(p) for p in pids)


def test_worker_death_is_an_error_not_a_hang(tiny, procs):
    llm = LLM(tiny("qwen3"), device="cpu", tensor_parallel_size=2)
    _death_is_reported(llm, signal.SIGKILL, "rank 1", 64, 30, procs)


def test_a_stopped_worker_is_found_by_its_missing_heartbeats(tiny, procs):
    """SIGSTOP: the process lives and keeps its sockets, but answers nothing; the leader
    must call it dead within heartbeat_timeout_s, not wait for the step watchdog."""
    llm = LLM(tiny("qwen3"), device="cpu", tensor_parallel_size=2, heartbeat_timeout_s=2.0)
    _death_is_reported(llm, signal.SIGSTOP, "rank 1 .* sent no heartbeat", 512, 5, procs)


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(") ", 1)[1][0]


def test_a_suspended_engine_resumes(tiny, procs):
    """Ctrl-Z then fg stops the leader and its workers together: on resume neither side
    may take its own pause for the other's death."""
    code = textwrap.dedent(f"""
        import sys
        from nvllm import LLM, SamplingParams
        llm = LLM({tiny("qwen3")!r}, device="cpu", tensor_parallel_size=2,
                  heartbeat_timeout_s=2.0)
        print("ready", *llm.worker_pids, flush=True)
        sys.stdin.readline()
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        print("tokens", len(out[0].token_ids), flush=True)
        llm.shutdown()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        first = proc.stdout.readline().split()
        assert first[0] == "ready", proc.stderr.read() if proc.poll() is not None else first
        os.killpg(proc.pid, signal.SIGSTOP)
        group = [proc.pid, *map(int, first[1:])]
        # Every process of the group stays stopped for 2.5x the heartbeat timeout, counted
        # from when the last one is seen stopped (SIGSTOP lands asynchronously).
        deadline, since = time.monotonic() + 10, None
        while since is None or time.monotonic() - since < 5.0:
            stopped = all(proc_state(p) == "T" for p in group)
            if since is None and stopped:
                since = time.monotonic()
            assert since is not None or time.monotonic() < deadline, "SIGSTOP did not land"
            assert since is None or stopped, "a process of the group ran while stopped"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGCONT)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=60)
        assert "tokens 4" in out, err[-2000:]
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not any(procs.pid_alive(int(p)) for p in first[1:])


def test_a_stuck_step_trips_the_watchdog(tiny):
    """Heartbeats flow but no result comes (a hung collective, a deadlock): the step
    timeout turns it into an error instead of a hang."""
    llm = LLM(tiny("qwen3"), device="cpu", tensor_parallel_size=1, step_timeout_s=1.0)
    try:
        # Swallow the plans so the (live, heartbeating) worker never computes a step.
        for sock in llm.engine.executor.workers.plan_socks:
            sock.close(0)
        llm.engine.executor.workers.plan_socks = []
        with pytest.raises(EngineDeadError, match="no answer from the workers within 1 s"):
            llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.shutdown()


def test_decode_plans_stay_small(llm):
    """Running sequences travel as deltas: a decode step costs a few bytes per sequence."""
    from nvllm.common.sampling_params import SamplingParams as SP

    engine = llm.engine
    for i in range(32):
        engine.submit(prompt_token_ids=[7, 8, 9, 10 + i],
                      params=SP(temperature=0, max_tokens=20, ignore_eos=True))
    sizes = []
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.last_step
        if s.num_scheduled_tokens == 32 and s.step_id > 1:  # a pure decode step
            sizes.append(s.plan_bytes / 32)
    assert sizes, "expected decode steps with all 32 sequences"
    # Columns: an 8-byte id, a 4-byte count and a 4-byte block offset per sequence, plus
    # the few new block ids a step adds; never the sequence's tokens or its whole table.
    assert max(sizes) <= 24, f"decode plan costs {max(sizes):.1f} bytes per sequence"
    assert_no_blocks_held(llm)


def test_two_engines_side_by_side(tiny):
    """No fixed ports or names: two engines in one process serve independently."""
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(tiny("qwen3"), device="cpu", dtype="float32", tensor_parallel_size=2) as a, \
            LLM(tiny("qwen3"), device="cpu", dtype="float32", tensor_parallel_size=2) as b:
        out_a = a.generate("Hello there", p, use_tqdm=False)[0].token_ids
        out_b = b.generate("Hello there", p, use_tqdm=False)[0].token_ids
    assert out_a == out_b and len(out_a) == 8


def test_garbage_on_the_result_socket_changes_nothing(llm):
    """Frames that are not a worker's answer are dropped (never unpickled); the engine
    keeps serving with the same outputs."""
    import pickle

    import msgpack
    import zmq


    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = llm.generate("Hello there", p, use_tqdm=False)[0].token_ids
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(llm.engine.executor.workers.result_endpoint)
    for frame in (b"\xc1garbage", pickle.dumps({"x": 1}), msgpack.packb([99, 1, 2]),
                  msgpack.packb([11, "not an int", [], [], None, 0.0]),
                  protocol.encode(protocol.StepResult(10**9, [0], [5], None, 0.0))):
        sock.send(frame)
    sock.close()
    # The heartbeat socket: garbage, a pickle, a rank that does not exist, an oversized
    # frame (ZMQ drops it and the sender's connection) change nothing either.
    hb = ctx.socket(zmq.DEALER)
    hb.setsockopt(zmq.LINGER, 1000)
    hb.connect(llm.engine.executor.workers.heartbeat_endpoint)
    for frame in (b"\xc1", pickle.dumps([0, 1, "h"]), msgpack.packb([7, 1, "h"]),
                  msgpack.packb(["0", 1, "h"]), b"\x00" * 10_000):
        hb.send(frame)
    hb.close()
    ctx.term()
    time.sleep(0.2)
    after = llm.generate("Hello there", p, use_tqdm=False)[0].token_ids
    assert after == before
    assert llm.engine.executor.workers.check_alive() is None
    assert_no_blocks_held(llm)


def test_a_forged_result_for_the_current_step_is_dropped(llm, monkeypatch):
    """A well-formed StepResult with the right step id but tokens for the wrong sequences
    (or outside the vocabulary) is not our workers' answer: dropped, the real one wins."""

    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = llm.generate("Hello there", p, use_tqdm=False)[0].token_ids
    workers = llm.engine.workers
    real_recv = workers.recv
    forged: list = []
    # Each forged result is dropped; the real one (held back once) is used instead.
    held: list = []

    def forging_recv(timeout_s, cancelled=None):
        if held:
            return held.pop()
        msg = real_recv(timeout_s, cancelled)
        if isinstance(msg, protocol.StepResult) and len(forged) < 2:
            bad = (protocol.StepResult(msg.step_id, msg.seq_ids, [10**6] * len(msg.seq_ids),
                                       None, 0.0) if not forged else
                   protocol.StepResult(msg.step_id, [s + 999 for s in msg.seq_ids],
                                       msg.token_ids, None, 0.0))
            forged.append(bad)
            held.append(msg)
            return bad
        return msg

    monkeypatch.setattr(workers, "recv", forging_recv)
    after = llm.generate("Hello there", p, use_tqdm=False)[0].token_ids
    assert len(forged) == 2 and after == before
    assert_no_blocks_held(llm)


def test_ctrl_c_in_generate_leaves_the_engine_clean(llm, monkeypatch):
    """Ctrl-C during generate raises KeyboardInterrupt between steps (or in a wait, before
    a result is taken): the call's requests end and free their blocks, nothing stays in
    flight half-applied, and the next call gives exactly the uninterrupted output. The
    signal is sent from inside the k-th step (a real SIGINT to this process), so where
    it lands does not depend on how fast the machine is."""
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24]]
    p = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
    real_step = llm.engine.step
    for k in (3, 40):
        calls = [0]

        def step(*args, k=k, calls=calls, **kwargs):
            calls[0] += 1
            if calls[0] == k:
                os.kill(os.getpid(), signal.SIGINT)
            return real_step(*args, **kwargs)

        monkeypatch.setattr(llm.engine, "step", step)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, p, use_tqdm=False)
        monkeypatch.setattr(llm.engine, "step", real_step)
        assert calls[0] == k  # it landed in that step, not later
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert not llm.engine.requests
        got = [o.token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
        assert got == want
        assert_no_blocks_held(llm)

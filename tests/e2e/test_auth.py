"""Authenticated remote attach: an engine whose client endpoint is a CURVE server (bound on
127.0.0.1; CURVE is the same on any tcp endpoint) serves authorised keypairs only, through
Client, AsyncClient, nvllm-client and the HTTP gateway; non-loopback binds without
authentication are refused."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from raw_client import RawClient
from subproc import free_port, stop_process, wait_healthy

from nvllm import LLM, SamplingParams
from nvllm.common.client import AsyncClient
from nvllm.common.zmq_utils import generate_keys
from nvllm.leader.server import EngineServer

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
PROMPTS = ["The capital of France is", "Once upon a time"]
FRAME_LIMIT = 64 << 10


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return generate_keys(tmp_path_factory.mktemp("auth") / "keys")


@pytest.fixture(scope="module")
def stranger(tmp_path_factory, keys):
    """A client that knows the server's public key, with a keypair nobody authorised."""
    d = generate_keys(tmp_path_factory.mktemp("auth") / "stranger")
    shutil.copyfile(keys / "server.key", d / "server.key")
    return d


@pytest.fixture(scope="module")
def secured(tiny, keys):
    llm = LLM(tiny("qwen3"), device="cpu", dtype="float32", client_timeout_s=2.0)
    # The reference, from the same engine before it serves (LLM.generate, offline).
    ref = [(o.token_ids, o.text) for o in
           llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)]
    server = EngineServer(llm.engine, "127.0.0.1", 0, curve_key_dir=keys,
                          max_frame_bytes=FRAME_LIMIT)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    yield SimpleNamespace(llm=llm, server=server, endpoint=server.endpoint, ref=ref)
    stop.set()
    thread.join(30)
    server.close()
    llm.shutdown()


def assert_idle(llm: LLM, timeout: float = 15.0) -> None:
    kv = llm.engine.kv
    deadline = time.monotonic() + timeout
    while llm.engine.requests or kv.num_free_blocks != kv.num_blocks:
        assert time.monotonic() < deadline, "requests or KV blocks left in the engine"
        time.sleep(0.05)


def test_authorised_client_gets_the_offline_output(secured, keys):
    with RawClient(secured.endpoint, timeout_s=60, curve_key_dir=keys) as c:
        assert c.info()["ready"]
        got = [(o.token_ids, o.text) for o in (c.generate(p, GREEDY) for p in PROMPTS)]
    assert got == secured.ref

    async def run() -> list:
        c = AsyncClient(secured.endpoint, timeout_s=60, curve_key_dir=keys)
        try:
            outs = await asyncio.gather(*(c.generate(p, GREEDY) for p in PROMPTS))
        finally:
            c.close()
        return [(o.token_ids, o.text) for o in outs]

    assert asyncio.run(run()) == secured.ref
    assert_idle(secured.llm)


@pytest.mark.parametrize("who", ["no keys", "unauthorised keypair"])
def test_other_clients_get_no_answer(secured, stranger, who, caplog):
    key_dir = None if who == "no keys" else stranger
    caplog.set_level(logging.WARNING, logger="nvllm.common.zmq_utils")
    t0 = time.monotonic()
    with RawClient(secured.endpoint, timeout_s=1.5, curve_key_dir=key_dir) as c:
        with pytest.raises(TimeoutError, match="no answer"):
            c.generate("let me in", GREEDY)
        with pytest.raises(TimeoutError):
            c.info()
    assert time.monotonic() - t0 < 10
    assert not secured.llm.engine.requests  # nothing of theirs reached the engine
    if key_dir is not None:  # ZAP logs a refused key; a NULL client never gets that far
        assert "refused a CURVE client" in caplog.text

    async def run() -> None:
        c = AsyncClient(secured.endpoint, timeout_s=1.5, curve_key_dir=key_dir)
        try:
            with pytest.raises((TimeoutError, asyncio.TimeoutError)):
                await c.generate("let me in", GREEDY)
        finally:
            c.close()

    asyncio.run(run())


def test_frame_limit_applies_to_authorised_clients(secured, keys):
    assert secured.server.max_frame_bytes == FRAME_LIMIT
    with RawClient(secured.endpoint, timeout_s=60, curve_key_dir=keys) as c:
        # Under the limit: the frame is read, and answered (the prompt is too long).
        c.send_map({"op": "submit", "id": "big", "prompt_token_ids": [1] * 2000,
                 "params": GREEDY})
        assert c.wait_map("big", ())["code"] == "rejected"
    with RawClient(secured.endpoint, timeout_s=60, curve_key_dir=keys) as bad, \
            RawClient(secured.endpoint, timeout_s=60, curve_key_dir=keys) as good:
        bad._sock.send(b"\x00" * FRAME_LIMIT)  # over the limit once encrypted: dropped
        assert good.generate(PROMPTS[0], GREEDY).token_ids == secured.ref[0][0]
    with RawClient(secured.endpoint, timeout_s=60, curve_key_dir=keys) as c:
        assert c.generate(PROMPTS[1], GREEDY).text == secured.ref[1][1]
    assert_idle(secured.llm)


def test_non_loopback_bind_needs_keys(secured, keys):
    for host in ("0.0.0.0", "::", "192.0.2.1"):
        with pytest.raises(ValueError, match=r"needs authentication: pass --curve-key-dir "
                                             r"DIR \(create one with `nvllm-keys DIR`\)"):
            EngineServer(secured.llm.engine, host, 0)
    with pytest.raises(ValueError, match="max_frame_bytes"):
        EngineServer(secured.llm.engine, max_frame_bytes=0)
    # With keys a wildcard bind is accepted (closed at once: this test sends nothing to it).
    EngineServer(secured.llm.engine, "0.0.0.0", 0, curve_key_dir=keys).close()


CLIENT = [sys.executable, "-m", "nvllm.launch.client_cli"]


def run_client(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLIENT, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8", **(env or {})})


def test_nvllm_client_with_keys(secured, keys):
    out = run_client("--endpoint", secured.endpoint, "--curve-key-dir", str(keys),
                     "--max-tokens", "12", "--ignore-eos", PROMPTS[0])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(secured.ref[0][1]) and "finish_reason: length" in out.stdout
    # The key folder can come from the environment, as for nvllm-serve.
    out = run_client("--endpoint", secured.endpoint, "--info",
                     env={"NVLLM_CURVE_KEY_DIR": str(keys)})
    assert out.returncode == 0 and '"ready": true' in out.stdout, out.stderr
    out = run_client("--endpoint", secured.endpoint, "--timeout", "1", "--info")
    assert out.returncode == 1 and "--curve-key-dir" in out.stderr
    out = run_client("--endpoint", secured.endpoint, "--curve-key-dir", str(keys / "clients"),
                     "--info")
    assert out.returncode == 2 and "nvllm-keys" in out.stderr


def test_gateway_attaches_with_keys(secured, keys, procs):
    from nvllm.launch.openai.process import start_gateway_process

    port = free_port()
    gateway = start_gateway_process(secured.endpoint, "127.0.0.1", port, "tiny",
                                    curve_key_dir=str(keys), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, gateway, 60)
        r = httpx.post(f"{base}/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": PROMPTS[0], **GREEDY})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == secured.ref[0][1]
    finally:
        stop_process(gateway, signal.SIGTERM)
    assert not procs.pid_alive(gateway.pid)


def test_worker_sockets_with_curve_admit_only_keyed_peers(tiny, keys):
    """With curve_key_dir the leader's plan/result/heartbeat sockets are CURVE servers that
    admit the workers' key only: the engine's own workers (worker.key_secret) run as usual,
    and a stray PULL peer on a plan endpoint, which without auth could take plans
    round-robin, gets nothing and takes nothing, although it holds the client keypair
    that the client endpoint admits."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from nvllm.common.config import DistConfig
    from nvllm.common.zmq_utils import curve_client

    p = SamplingParams(**GREEDY)
    with LLM(tiny("qwen3"), device="cpu", dtype="float32", tensor_parallel_size=2) as plain:
        ref = [o.token_ids for o in plain.generate(PROMPTS, p, use_tqdm=False)]
    with LLM(tiny("qwen3"), device="cpu", dtype="float32", tensor_parallel_size=2,
             dist=DistConfig(curve_key_dir=str(keys)), step_timeout_s=30) as llm:
        ctx = zmq.Context()
        thief = ctx.socket(zmq.PULL)
        thief.setsockopt(zmq.LINGER, 0)
        curve_client(thief, keys)  # keys/client.key_secret, in keys/clients/
        monitor = thief.get_monitor_socket()
        thief.connect(llm.engine.executor.workers.plan_endpoints[1])
        # Until the leader has refused the thief's handshake (or dropped its connection).
        refused = {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                   zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_DISCONNECTED}
        deadline = time.monotonic() + 10
        while True:
            assert monitor.poll(max(1, int(1000 * (deadline - time.monotonic())))), \
                "the leader neither refused nor dropped the client-keyed peer"
            if recv_monitor_message(monitor)["event"] in refused:
                break
        thief.disable_monitor()
        monitor.close()
        try:
            got = [o.token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)]
            assert got == ref
            assert not thief.poll(200), "a client-keyed peer received a plan"
        finally:
            thief.close()
            ctx.term()


def test_one_host_worker_sockets_are_ipc_in_a_private_folder(tiny):
    """On one host the leader's worker sockets are unix sockets in a folder of mode 0700
    owned by this user (no other user can connect), and the folder goes with the group."""
    import stat

    with LLM(tiny("qwen3"), device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        folder = llm.engine.executor.group.tmpdir
        st = os.stat(folder)
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
        workers = llm.engine.executor.workers
        for endpoint in (*workers.plan_endpoints, workers.result_endpoint,
                         workers.heartbeat_endpoint):
            assert endpoint.startswith(f"ipc://{folder}/"), endpoint
            assert stat.S_ISSOCK(os.stat(endpoint[len("ipc://"):]).st_mode)
        out = llm.generate(PROMPTS[:1], SamplingParams(**GREEDY), use_tqdm=False)
        assert len(out[0].token_ids) == GREEDY["max_tokens"]
    assert not os.path.exists(folder)

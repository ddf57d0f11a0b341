"""nvllm-launch: generate-and-exit, and serve-until-interrupted with a clean shutdown."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
from subproc import wait_healthy

pytestmark = pytest.mark.e2e

LAUNCH = [sys.executable, "-m", "nvllm.launch.cli"]


def test_launch_generates_and_exits(tiny, procs):
    out = subprocess.run(
        [*LAUNCH, "--model", tiny("qwen3"), "--tp", "2", "--device", "cpu", "--prompt", "Hello",
         "--prompt", "The capital of France is", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "--- 'Hello'" in out.stdout and "--- 'The capital of France is'" in out.stdout
    assert re.search(r"2 requests, \d+ prompt \+ \d+ generated tokens", out.stdout)
    assert "output tok/s" in out.stdout
    assert "KV cache:" in out.stderr and "maximum concurrency" in out.stderr
    pids = [int(p) for p in re.search(r"workers=\[([\d, ]+)\]", out.stdout).group(1).split(",")]
    assert not any(procs.pid_alive(p) for p in pids)


def test_launch_serves_clients_until_sigint(tiny, procs):
    import socket

    import httpx
    import msgpack
    import zmq

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    proc = subprocess.Popen([*LAUNCH, "--model", tiny("qwen3"), "--tp", "2", "--device", "cpu",
                             "--http-port", str(http_port), "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "HTTP gateway" in line or not line:
                break
        text = "".join(lines)
        gateway_pid = int(re.search(r"HTTP gateway on \S+ \(pid (\d+)\)", text).group(1))
        endpoint = re.search(r"serving on (tcp://\S+);", text).group(1)
        assert endpoint.startswith("tcp://127.0.0.1:")
        pids = [int(p) for p in re.search(r"workers=\[([\d, ]+)\]", text).group(1).split(",")]
        assert all(procs.pid_alive(p) for p in pids)
        # Each process names itself for `ps`.
        assert procs.cmdline(proc.pid).startswith("nvllm-leader")
        assert [procs.cmdline(p) for p in pids] == ["nvllm-worker-0", "nvllm-worker-1"]
        sock.connect(endpoint)

        def ask(msg, raw=False):
            sock.send(msg if raw else msgpack.packb(msg))
            assert sock.poll(60_000), "no reply from the server"
            return msgpack.unpackb(sock.recv())

        info = ask({"v": 1, "op": "info"})
        assert info["ready"] and info["max_model_len"] == 1024
        assert ask(b"\x93garbage", raw=True)["code"] == "bad_frame"
        assert ask({"op": "launch_missiles"})["code"] == "bad_op"
        bad = ask({"op": "submit", "id": "t1", "prompt": "hi",
                   "params": {"temperature": -1}})
        assert bad["id"] == "t1" and "temperature" in bad["message"]
        long = ask({"op": "submit", "id": 2, "prompt_token_ids": [5] * 2000})
        assert long["code"] == "rejected" and "max_model_len is 1024" in long["message"]
        outs = [ask({"op": "submit", "id": "ok", "prompt": "Hello",
                     "params": {"temperature": 0, "max_tokens": 8, "ignore_eos": True}})]
        while outs[-1].get("finish_reason") is None:  # the stream, to its last message
            assert sock.poll(60_000), "no reply from the server"
            outs.append(msgpack.unpackb(sock.recv()))
        assert all(o["op"] == "output" and o["id"] == "ok" for o in outs)
        out = {"text": "".join(o["text"] for o in outs),
               "token_ids": [t for o in outs for t in o["token_ids"]]}
        assert len(out["token_ids"]) == 8 and outs[-1]["finish_reason"] == "length"

        # The OpenAI gateway started beside the engine answers over HTTP.
        base = f"http://127.0.0.1:{http_port}"
        wait_healthy(base, proc, 60)
        assert procs.cmdline(gateway_pid).startswith("nvllm-http")
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "tiny"
        r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "Hello",
                                                         "max_tokens": 8, "temperature": 0,
                                                         "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == out["text"]
        # Chat needs the tokenizer, found through the leader although the name is "tiny".
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert not any(procs.pid_alive(p) for p in [*pids, gateway_pid])
    finally:
        sock.close(0)
        ctx.term()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_launch_passes_the_http_options_to_the_gateway(tiny, monkeypatch):
    """--http-max-body-bytes, --http-trust-request-chat-template, --http-allow-priority and
    --http-tool-call-parser reach start_gateway_process, and from there nvllm-serve's
    command line (no engine: the builder, the ZMQ server and the gateway process are
    stand-ins)."""
    from types import SimpleNamespace

    from click.testing import CliRunner

    import nvllm.launch.openai.process as gateway_proc
    from nvllm.launch import cli, engine_builder
    from nvllm.leader import server as leader_server

    engine = SimpleNamespace(executor=SimpleNamespace(group=SimpleNamespace(pids=[])),
                             shutdown=lambda: None)
    monkeypatch.setattr(engine_builder, "build_engine", lambda config, dist, **kw: engine)

    class FakeServer:
        def __init__(self, *a, **kw) -> None:
            self.endpoint = "tcp://127.0.0.1:1"

        def serve(self, stop, timeout) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(leader_server, "EngineServer", FakeServer)
    monkeypatch.setattr(cli, "stop_on_signals", lambda stop: None)
    calls = []
    real = gateway_proc.start_gateway_process

    def fake_start(*args, **kwargs):
        calls.append(kwargs)
        popen = SimpleNamespace(pid=1, terminate=lambda: None, wait=lambda t=None: 0)
        args_seen = {}

        class Recorder:  # what the real function would run, without running it
            def __init__(self, cmd, **kw) -> None:
                args_seen["cmd"] = cmd

        monkeypatch.setattr(gateway_proc.subprocess, "Popen", Recorder)
        real(*args, **kwargs)
        kwargs["cmd"] = args_seen["cmd"]
        return popen

    monkeypatch.setattr(gateway_proc, "start_gateway_process", fake_start)
    base = ["--model", tiny("qwen3"), "--device", "cpu", "--http-port", "1"]
    out = CliRunner().invoke(cli.launch, [*base, "--http-max-body-bytes", "12345",
                                          "--http-trust-request-chat-template",
                                          "--http-allow-priority",
                                          "--http-tool-call-parser", "llama3_json"])
    assert out.exit_code == 0, out.output
    assert calls[-1]["max_body_bytes"] == 12345
    assert calls[-1]["trust_request_chat_template"] and calls[-1]["allow_priority"]
    cmd = calls[-1]["cmd"]
    assert cmd[cmd.index("--max-body-bytes") + 1] == "12345"
    assert "--trust-request-chat-template" in cmd and "--allow-priority" in cmd
    assert cmd[cmd.index("--tool-call-parser") + 1] == "llama3_json"
    out = CliRunner().invoke(cli.launch, [*base, "--no-page-out-libraries"])
    assert out.exit_code == 0, out.output
    assert calls[-1]["page_out_libraries"] is False
    assert "--no-page-out-libraries" in calls[-1]["cmd"]  # the engine's setting, shared
    out = CliRunner().invoke(cli.launch, base)  # defaults: nothing added
    assert out.exit_code == 0, out.output
    assert not {"--max-body-bytes", "--trust-request-chat-template", "--no-page-out-libraries",
                "--allow-priority", "--tool-call-parser"} & set(calls[-1]["cmd"])


def test_sigterm_stops_everything_even_with_a_stopped_worker(tiny, procs):
    """A worker that stops answering (SIGSTOP) mid-stream: SIGTERM still ends the
    leader and every worker within --shutdown-timeout plus a few seconds, and the client
    gets its request's end rather than silence."""
    import os

    import msgpack
    import zmq

    proc = subprocess.Popen([*LAUNCH, "--model", tiny("qwen3"), "--tp", "2", "--device", "cpu",
                             "--shutdown-timeout", "1", "--heartbeat-timeout", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    pids: list[int] = []
    try:
        lines = []
        while not lines or ("serving on" not in lines[-1] and lines[-1]):
            lines.append(proc.stdout.readline())
        text = "".join(lines)
        endpoint = re.search(r"serving on (tcp://\S+);", text).group(1)
        pids = [int(p) for p in re.search(r"workers=\[([\d, ]+)\]", text).group(1).split(",")]
        sock.connect(endpoint)
        sock.send(msgpack.packb({"op": "submit", "id": "r", "prompt": "A long story",
                                 "params": {"max_tokens": 1000, "ignore_eos": True}}))
        assert sock.poll(60_000) and msgpack.unpackb(sock.recv())["finish_reason"] is None
        os.kill(pids[1], signal.SIGSTOP)  # hung: no heartbeats, no steps
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=1 + 20)
        assert time.monotonic() - t0 < 1 + 20
        assert not any(procs.pid_alive(p) for p in pids)
        last = None
        while sock.poll(2000):
            last = msgpack.unpackb(sock.recv())
        assert last is not None and (last.get("finish_reason") == "abort"
                                     or last.get("op") == "error"), last
    finally:
        sock.close(0)
        ctx.term()
        for p in pids:
            if procs.pid_alive(p):
                os.kill(p, signal.SIGCONT)
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""ZMQ helpers: loopback detection, the CURVE key folder, CURVE server/client sockets, and
the frame limit, on bare ROUTER/DEALER sockets over 127.0.0.1 (no engine)."""

from __future__ import annotations

import shutil
import stat
import time

import pytest
import zmq
from click.testing import CliRunner
from zmq.utils.monitor import recv_monitor_message

from nvllm.common.zmq_utils import (
    curve_client,
    curve_server,
    generate_keys,
    is_loopback,
    load_client_keys,
    make_socket,
)
from nvllm.launch.keys import main as keys_main


@pytest.mark.parametrize("host,expected", [
    ("127.0.0.1", True), ("127.1.2.3", True), ("localhost", True), ("LOCALHOST", True),
    ("::1", True), ("[::1]", True), ("::ffff:127.0.0.1", True),
    ("0.0.0.0", False), ("*", False), ("::", False), ("10.0.0.5", False),
    ("192.168.1.1", False), ("example.com", False), ("", False), ("eth0", False)])
def test_is_loopback(host, expected):
    assert is_loopback(host) is expected


def test_generate_keys_layout_modes_and_no_overwrite(tmp_path):
    d = generate_keys(tmp_path / "keys")
    names = sorted(p.relative_to(d).as_posix() for p in d.rglob("*"))
    assert names == ["client.key", "client.key_secret", "clients", "clients/client.key",
                     "server.key", "server.key_secret"]
    for secret in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((d / secret).stat().st_mode) == 0o600
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert (d / "clients/client.key").read_bytes() == (d / "client.key").read_bytes()
    before = (d / "server.key_secret").read_bytes()
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        generate_keys(d)
    assert (d / "server.key_secret").read_bytes() == before


def test_nvllm_keys_command(tmp_path):
    runner = CliRunner()
    out = runner.invoke(keys_main, [str(tmp_path / "k")])
    assert out.exit_code == 0 and "--curve-key-dir" in out.output
    assert (tmp_path / "k/server.key_secret").is_file()
    again = runner.invoke(keys_main, [str(tmp_path / "k")])
    assert again.exit_code == 1 and "refusing to overwrite" in again.output


def test_missing_key_files_name_the_fix(tmp_path):
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.ROUTER)
        with pytest.raises(FileNotFoundError, match=r"no server.key_secret in .*nvllm-keys"):
            curve_server(ctx, sock, tmp_path)
        with pytest.raises(FileNotFoundError, match=r"no server.key in .*nvllm-keys"):
            curve_client(sock, tmp_path)
        d = generate_keys(tmp_path / "k")
        shutil.rmtree(d / "clients")
        with pytest.raises(FileNotFoundError, match=r"no clients/ folder .*nvllm-keys"):
            curve_server(ctx, sock, d)
        (d / "client.key_secret").unlink()
        with pytest.raises(FileNotFoundError, match=r"no client.key_secret"):
            load_client_keys(d)
        with pytest.raises(ValueError, match="no secret key"):
            load_client_keys(d, client_key=d / "client.key")
        sock.close(0)
    finally:
        ctx.term()


class Router:
    """A CURVE ROUTER on 127.0.0.1 and a way to ask whether a client's frame gets in."""

    def __init__(self, key_dir, max_msg_bytes: int = -1) -> None:
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, max_msg_bytes=max_msg_bytes)
        self.auth = curve_server(self.ctx, self.sock, key_dir) if key_dir else None
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def reaches(self, key_dir, client_key=None, payload: bytes = b"hello",
                wait_s: float = 1.0) -> bool:
        ctx = zmq.Context()
        dealer = make_socket(ctx, zmq.DEALER)
        try:
            if key_dir is not None:
                curve_client(dealer, key_dir, client_key)
            dealer.connect(self.endpoint)
            dealer.send(payload)
            if not self.sock.poll(int(wait_s * 1000)):
                return False
            return self.sock.recv_multipart()[-1] == payload
        finally:
            dealer.close(0)
            ctx.term()

    def close(self) -> None:
        self.sock.close(0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


@pytest.fixture
def keys(tmp_path):
    return generate_keys(tmp_path / "server-keys")


def test_curve_admits_only_authorised_keys(keys, tmp_path):
    # Another client knows the server's public key but holds a keypair it never authorised.
    stranger = generate_keys(tmp_path / "stranger")
    shutil.copyfile(keys / "server.key", stranger / "server.key")
    router = Router(keys)
    try:
        assert router.reaches(keys)
        assert not router.reaches(None)  # plain (NULL) client: the handshake fails
        assert not router.reaches(stranger)
        assert not router.reaches(keys, client_key=stranger / "client.key_secret")
        # The clients folder is read at each handshake: authorising needs no restart...
        shutil.copyfile(stranger / "client.key", keys / "clients/stranger.key")
        assert router.reaches(stranger)
        # ... and neither does revoking; a junk file in the folder locks nobody out.
        (keys / "clients/stranger.key").unlink()
        (keys / "clients/junk.key").write_text("not a certificate")
        assert not router.reaches(stranger)
        assert router.reaches(keys)
    finally:
        router.close()


def test_frame_limit_disconnects_the_sender_only(keys):
    router = Router(keys, max_msg_bytes=4096)
    try:
        # The limit is on the frame on the wire: CURVE adds 33 bytes to each.
        assert router.reaches(keys, payload=b"x" * (4096 - 33))
        ctx = zmq.Context()
        dealer = make_socket(ctx, zmq.DEALER)
        curve_client(dealer, keys)
        monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            dealer.connect(router.endpoint)
            dealer.send(b"x" * (4096 - 32))
            assert monitor.poll(5000), "the oversized frame did not cost its connection"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            assert not router.sock.poll(200)  # nothing of it reached the application
            # ZMQ reconnects by itself: the same socket is heard again on a new connection.
            deadline = time.monotonic() + 5
            while not router.sock.poll(100):
                assert time.monotonic() < deadline, "no reconnection after the disconnect"
                dealer.send(b"back")
            assert router.sock.recv_multipart()[-1] == b"back"
        finally:
            dealer.disable_monitor()
            monitor.close(0)
            dealer.close(0)
            ctx.term()
        assert router.reaches(keys)  # other clients never noticed
    finally:
        router.close()

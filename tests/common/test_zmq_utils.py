"""ZMQ helpers: loopback detection, the CURVE key folder (worker keypair, secret file
modes), CURVE server/client sockets (client keys vs the worker key), private ipc folders,
and the frame limit, on bare ROUTER/DEALER sockets (no engine)."""

from __future__ import annotations

import os
import shutil
import stat
import time

import pytest
import zmq
from click.testing import CliRunner
from zmq.utils.monitor import recv_monitor_message

from nvllm.common.zmq_utils import (
    IPC_PATH_MAX,
    bind_ipc,
    curve_client,
    curve_server,
    curve_worker,
    generate_keys,
    is_loopback,
    load_client_keys,
    make_socket,
    private_ipc_dir,
)
from nvllm.launch.keys import main as keys_main


@pytest.mark.parametrize("host,expected", [
    ("127.0.0.1", True), ("127.1.2.3", True), ("localhost", True), ("LOCALHOST", True),
    ("::1", True), ("[::1]", True), ("::ffff:127.0.0.1", True),
    ("0.0.0.0", False), ("*", False), ("::", False), ("10.0.0.5", False),
    ("192.168.1.1", False), ("example.com", False), ("", False), ("eth0", False)])
def test_is_loopback(host, expected):
    assert is_loopback(host) is expected


SECRETS = ("server.key_secret", "client.key_secret", "worker.key_secret")


def test_generate_keys_layout_modes_and_no_overwrite(tmp_path):
    d = generate_keys(tmp_path / "keys")
    names = sorted(p.relative_to(d).as_posix() for p in d.rglob("*"))
    assert names == ["client.key", "client.key_secret", "clients", "clients/client.key",
                     "server.key", "server.key_secret", "worker.key", "worker.key_secret"]
    for secret in SECRETS:
        assert stat.S_IMODE((d / secret).stat().st_mode) == 0o600
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert (d / "clients/client.key").read_bytes() == (d / "client.key").read_bytes()
    before = (d / "server.key_secret").read_bytes()
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        generate_keys(d)
    assert (d / "server.key_secret").read_bytes() == before
    # A folder from before worker keys: nvllm-keys adds the worker keypair, nothing else.
    for name in ("worker.key", "worker.key_secret"):
        (d / name).unlink()
    generate_keys(d)
    assert (d / "server.key_secret").read_bytes() == before
    assert stat.S_IMODE((d / "worker.key_secret").stat().st_mode) == 0o600
    assert sorted(p.name for p in (d / "clients").iterdir()) == ["client.key"]


def test_nvllm_keys_command(tmp_path):
    runner = CliRunner()
    out = runner.invoke(keys_main, [str(tmp_path / "k")])
    assert out.exit_code == 0 and "--curve-key-dir" in out.output
    for secret in SECRETS:  # written 0600 from the start, whatever the umask
        assert stat.S_IMODE((tmp_path / "k" / secret).stat().st_mode) == 0o600
    again = runner.invoke(keys_main, [str(tmp_path / "k")])
    assert again.exit_code == 1 and "refusing to overwrite" in again.output


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o700, 0o610])
def test_secret_keys_readable_by_others_are_refused(tmp_path, mode):
    d = generate_keys(tmp_path / "k")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)

    def attempt(load) -> None:
        got = load()
        if hasattr(got, "stop"):  # curve_server's authenticator thread: never leave it
            got.stop()

    try:
        loaders = {"server.key_secret": lambda: curve_server(ctx, sock, d),
                   "client.key_secret": lambda: load_client_keys(d),
                   "worker.key_secret": lambda: curve_worker(sock, d)}
        for name, load in loaders.items():
            path = d / name
            os.chmod(path, mode)
            fix = f"chmod 600 {path}"
            if mode & 0o077:
                with pytest.raises(PermissionError, match=f"{path}.*{fix}"):
                    attempt(load)
            else:  # owner-only bits are fine
                attempt(load)
            os.chmod(path, 0o600)
        # The leader's side of the worker sockets checks both secrets it reads.
        os.chmod(d / "worker.key_secret", 0o644)
        with pytest.raises(PermissionError, match="worker.key_secret"):
            attempt(lambda: curve_server(ctx, sock, d, workers=True))
    finally:
        sock.close(0)
        ctx.term()


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

    def __init__(self, key_dir, max_msg_bytes: int = -1, workers: bool = False) -> None:
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, max_msg_bytes=max_msg_bytes)
        self.auth = (curve_server(self.ctx, self.sock, key_dir, workers=workers)
                     if key_dir else None)
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


def test_worker_sockets_admit_the_worker_key_only(keys, tmp_path):
    """A CURVE server for workers admits DIR/worker.key and nothing in clients/; the client
    endpoint's server the reverse."""
    stranger = generate_keys(tmp_path / "stranger")  # another deployment's worker keys
    shutil.copyfile(keys / "server.key", stranger / "server.key")
    workers = Router(keys, workers=True)
    clients = Router(keys)
    try:
        assert workers.reaches(keys, client_key=keys / "worker.key_secret")
        assert not workers.reaches(keys)  # client.key_secret, authorised in clients/
        assert not workers.reaches(None)
        assert not workers.reaches(keys, client_key=stranger / "worker.key_secret")
        # Authorising a client key for the client endpoint changes nothing here.
        shutil.copyfile(stranger / "client.key", keys / "clients/stranger.key")
        assert not workers.reaches(stranger)
        assert clients.reaches(stranger)
        assert not clients.reaches(keys, client_key=keys / "worker.key_secret")
    finally:
        workers.close()
        clients.close()


def test_private_ipc_dir_is_ours_and_shut(tmp_path):
    d = private_ipc_dir()
    try:
        st = os.stat(d)
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
        ctx = zmq.Context()
        pull, push = make_socket(ctx, zmq.PULL), make_socket(ctx, zmq.PUSH)
        try:
            endpoint = bind_ipc(pull, d, "result")
            assert endpoint == f"ipc://{d}/result"
            push.connect(endpoint)
            push.send(b"hi")
            assert pull.poll(5000) and pull.recv() == b"hi"
            with pytest.raises(ValueError, match="longer than .*TMPDIR"):
                bind_ipc(pull, d, "x" * IPC_PATH_MAX)
        finally:
            pull.close(0)
            push.close(0)
            ctx.term()
    finally:
        shutil.rmtree(d)


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

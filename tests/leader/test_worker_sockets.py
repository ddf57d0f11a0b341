"""Who can reach the leader's worker sockets (plan, result, heartbeat), on a bare
WorkerGroupClient (no workers): on one host they are ipc paths in a private folder that
another user cannot enter; across nodes (tcp) they are CURVE servers that admit the
workers' key and refuse every client key."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from nvllm.common.zmq_utils import curve_client, generate_keys, make_socket, private_ipc_dir
from nvllm.leader.worker_client import WorkerGroupClient

NOBODY = 65534
REFUSED = {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
           zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_DISCONNECTED}


def handshake(endpoint: str, kind: int, key_dir=None, client_key=None) -> bool:
    """Does a `kind` socket (CURVE with `client_key` when key_dir is given) complete the
    ZMTP handshake with `endpoint`? Watched on the connecting socket's monitor."""
    ctx = zmq.Context()
    sock = make_socket(ctx, kind)
    mon = sock.get_monitor_socket()
    try:
        if key_dir is not None:
            curve_client(sock, key_dir, client_key)
        sock.connect(endpoint)
        deadline = time.monotonic() + 10
        while True:
            assert mon.poll(max(1, int(1000 * (deadline - time.monotonic())))), \
                f"neither a handshake nor a refusal on {endpoint}"
            event = recv_monitor_message(mon)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return True
            if event in REFUSED:
                return False
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
        ctx.term()


def endpoints(client: WorkerGroupClient) -> list[tuple[str, int]]:
    """Each leader endpoint with the socket kind a worker connects to it with."""
    return [*((e, zmq.PULL) for e in client.plan_endpoints),
            (client.result_endpoint, zmq.PUSH), (client.heartbeat_endpoint, zmq.DEALER)]


def test_curve_worker_sockets_admit_the_worker_key_only(tmp_path):
    keys = generate_keys(tmp_path / "keys")
    client = WorkerGroupClient(2, "127.0.0.1", curve_key_dir=str(keys))
    try:
        for endpoint, kind in endpoints(client):
            assert endpoint.startswith("tcp://127.0.0.1:")
            # The default client keypair, authorised in clients/ for the client endpoint.
            assert not handshake(endpoint, kind, keys), endpoint
            assert not handshake(endpoint, kind), endpoint  # no CURVE at all
            assert handshake(endpoint, kind, keys, keys / "worker.key_secret"), endpoint
        # And a worker-keyed result frame gets through where a client-keyed one does not.
        ctx = zmq.Context()
        try:
            for key, arrives in (("client.key_secret", False), ("worker.key_secret", True)):
                push = make_socket(ctx, zmq.PUSH)
                curve_client(push, keys, keys / key)
                push.connect(client.result_endpoint)
                push.send(b"frame", flags=zmq.NOBLOCK)  # queued before the handshake
                got = client.result_sock.poll(2000 if arrives else 500)
                assert bool(got) is arrives, key
                if got:
                    assert client.result_sock.recv() == b"frame"
                push.close(0)
        finally:
            ctx.term()
    finally:
        client.close()


def test_one_host_sockets_are_ipc_in_a_folder_only_we_can_enter():
    folder = private_ipc_dir()
    try:
        st = os.stat(folder)
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
        assert len(folder) < 80
        client = WorkerGroupClient(2, ipc_dir=folder)
        try:
            paths = []
            for endpoint, kind in endpoints(client):
                assert endpoint.startswith(f"ipc://{folder}/"), endpoint
                paths.append(endpoint[len("ipc://"):])
                assert handshake(endpoint, kind)  # this user: the group's own workers
            if os.geteuid() == 0:  # root can be another user for a moment: try as nobody
                for path in paths:
                    assert connect_as(NOBODY, path) == "refused", path
        finally:
            client.close()
    finally:
        shutil.rmtree(folder)


def connect_as(uid: int, path: str) -> str:
    """Connect to the unix socket `path` from a child process running as `uid`."""
    pid = os.fork()
    if pid == 0:  # the child: no Python cleanup, no ZMQ, just connect(2)
        code = 3
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                code = 0
            except PermissionError:
                code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {0: "connected", 1: "refused"}.get(os.waitstatus_to_exitcode(status), "error")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_connects_when_the_folder_is_open():
    """The control for the test above: the same check does connect through an open folder."""
    folder = private_ipc_dir()
    try:
        os.chmod(folder, 0o755)
        client = WorkerGroupClient(1, ipc_dir=folder)
        try:
            path = client.result_endpoint[len("ipc://"):]
            os.chmod(path, 0o777)  # ZMQ makes the socket file with the umask's mode
            assert connect_as(NOBODY, path) == "connected"
        finally:
            client.close()
    finally:
        shutil.rmtree(folder)

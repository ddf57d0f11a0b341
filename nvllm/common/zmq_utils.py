"""Small ZMQ helpers: sockets bound to ephemeral loopback ports or to ``ipc://`` paths in a
private folder, frame limits, and CURVE authentication for the client endpoint and the
worker sockets.

CURVE key directory (``nvllm-keys DIR`` creates it; files are pyzmq certificates)::

    DIR/server.key          the server's public key: every client and worker needs a copy
    DIR/server.key_secret   the server's keypair (mode 0600): only the leader reads it
    DIR/clients/*.key       public keys of the authorised clients; the server re-reads
                            this folder at every handshake, so adding or deleting a file
                            grants or revokes access without a restart
    DIR/client.key          a default client keypair (its public key is also in clients/),
    DIR/client.key_secret   so that on a trusted machine a copy of DIR is all a client needs
    DIR/worker.key          the workers' keypair: the only key the leader's worker sockets
    DIR/worker.key_secret   (plans, results, heartbeats) admit; every worker node needs it

What admits what: the client endpoint admits the keys in ``clients/`` (never worker.key
unless someone copies it there); the worker sockets admit ``worker.key`` only, so a key
authorised as a client cannot reach them. A remote client needs only ``server.key`` and its
own ``client.key`` + ``client.key_secret``; a worker node needs ``server.key`` and
``worker.key_secret``. A peer whose key is not admitted, or that speaks no CURVE, is
refused during the handshake: ZMQ never delivers one of its frames.

Every ``*.key_secret`` must be readable by its owner only: loading one whose mode has any
group or other bit raises PermissionError (fix: ``chmod 600 FILE``).

On one host the worker sockets need no keys: they bind ``ipc://`` paths inside a private
(0700) folder (``private_ipc_dir``), which no other user can enter.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shlex
import shutil
import stat
import tempfile
from collections import deque
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)

SERVER_KEY, CLIENT_KEY, WORKER_KEY, CLIENTS_DIR = "server", "client", "worker", "clients"
# A unix socket path (sun_path) holds 108 bytes on Linux, the terminating NUL included.
IPC_PATH_MAX = 107
# Leaves room for the socket names under the folder (plan-<rank>, result, heartbeat).
_IPC_DIR_MAX = 80


def _keygen_hint(key_dir: Path) -> str:
    return f"run `nvllm-keys {shlex.quote(str(key_dir))}` first"


def bind_random(sock: zmq.Socket, host: str = "127.0.0.1") -> str:
    """Bind to an OS-chosen port so two engines can run side by side; returns endpoint."""
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


def private_ipc_dir(prefix: str = "nvllm-") -> str:
    """A fresh folder of mode 0700 owned by this user, short enough for ``ipc://`` paths
    (under $TMPDIR, or /tmp when that is too long). The caller removes it."""
    path = tempfile.mkdtemp(prefix=prefix)
    if len(os.fsencode(path)) > _IPC_DIR_MAX:
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    st = os.stat(path)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        shutil.rmtree(path, ignore_errors=True)
        raise PermissionError(f"{path} is not a private folder (owner uid {st.st_uid}, mode "
                              f"{stat.S_IMODE(st.st_mode):o}); expected ours, mode 700")
    return path


def bind_ipc(sock: zmq.Socket, folder: str, name: str) -> str:
    """Bind to the unix socket FOLDER/NAME; returns the endpoint. Who can connect is decided
    by the folder's permissions (see private_ipc_dir)."""
    path = os.path.join(folder, name)
    if len(os.fsencode(path)) > IPC_PATH_MAX:
        raise ValueError(f"the ipc path {path} is longer than {IPC_PATH_MAX} bytes: "
                         "set TMPDIR to a shorter folder")
    endpoint = f"ipc://{path}"
    sock.bind(endpoint)
    return endpoint


def make_socket(ctx: zmq.Context, kind: int, *, max_msg_bytes: int = -1) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if max_msg_bytes > 0:
        # ZMQ drops an oversized frame itself and disconnects the peer that sent it, before
        # any of it reaches Python.
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    return sock


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 (bracketed or not, or IPv4-mapped) and "localhost"; any
    other name or address, wildcards included, may be reachable from elsewhere."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def check_curve_bind(host: str, curve_key_dir: str | os.PathLike | None, what: str) -> None:
    """Refuse to bind `what` beyond loopback without CURVE keys (ValueError naming the fix)."""
    if curve_key_dir is None and not is_loopback(host):
        raise ValueError(f"binding {what} to {host} needs authentication: pass --curve-key-dir "
                         "DIR (create one with `nvllm-keys DIR`)")


# ---- CURVE -------------------------------------------------------------------------------


def generate_keys(key_dir: str | os.PathLike) -> Path:
    """Create the key directory layout above (the folder may exist but must hold no keys);
    returns it. A folder made before worker keys existed (server and client keys, no
    worker.key) gets its worker keypair added and nothing else touched. Secret files are
    written 0600 from the start: each keypair is made in a private (0700) temporary
    folder and moved into place."""
    d = Path(key_dir)
    older = [f"{SERVER_KEY}.key", f"{SERVER_KEY}.key_secret", f"{CLIENT_KEY}.key",
             f"{CLIENT_KEY}.key_secret", f"{CLIENTS_DIR}/{CLIENT_KEY}.key"]
    worker = [f"{WORKER_KEY}.key", f"{WORKER_KEY}.key_secret"]
    existing = [n for n in older + worker if (d / n).exists()]
    upgrade = existing == older  # only the worker keypair is missing
    if existing and not upgrade:
        raise FileExistsError(f"{d} already holds keys ({', '.join(existing)}); refusing to "
                              "overwrite them: pick another folder or delete them first")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    (d / CLIENTS_DIR).mkdir(mode=0o700, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=d, prefix=".keygen-") as tmp:
        for name in (WORKER_KEY,) if upgrade else (SERVER_KEY, CLIENT_KEY, WORKER_KEY):
            public, secret = zmq.auth.create_certificates(tmp, name)
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)
            os.replace(secret, d / f"{name}.key_secret")
            os.replace(public, d / f"{name}.key")
    if not upgrade:
        shutil.copyfile(d / f"{CLIENT_KEY}.key", d / CLIENTS_DIR / f"{CLIENT_KEY}.key")
    return d


def _load_secret(path: Path, key_dir: Path) -> tuple[bytes, bytes]:
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} in {key_dir}: "
                                + _keygen_hint(key_dir))
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key (is it a public .key file?)")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(
            f"{path} holds a secret key but is accessible by other users (mode {mode:o}); "
            f"refusing to use it: run `chmod 600 {shlex.quote(str(path))}`")
    return public, secret


def _load_public(path: Path, key_dir: Path) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(
            f"no {path.name} in {key_dir}: " + _keygen_hint(key_dir)
            + f" (or copy {path.name} from the server's key folder)")
    return zmq.auth.load_certificate(path)[0]


class _ClientKeys:
    """The ZAP check (pyzmq calls ``callback(domain, z85 public key)``): is the key one of
    the files in the clients folder? The folder is re-read at every handshake (rare, and
    only after the client proved it holds the secret of the key it shows), so access
    changes need no restart. An exception here would kill the ZAP thread and with it
    every later handshake: any failure refuses, and says why."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def callback(self, domain: str, client_key: bytes) -> bool:
        keys = set()
        try:
            for path in sorted(self.folder.glob("*.key")):
                try:
                    keys.add(zmq.auth.load_certificate(path)[0])
                except Exception as e:  # one bad file must not lock everyone out
                    logger.warning("ignoring %s: not a public key file (%s)", path, e)
        except OSError as e:
            logger.error("cannot read the client keys in %s: %s", self.folder, e)
        if client_key not in keys:
            logger.warning("refused a CURVE client: its public key %s is not in %s",
                           client_key.decode(errors="replace"), self.folder)
            return False
        return True


class _WorkerKey:
    """The ZAP check of the worker sockets: only the public half of DIR/worker.key_secret
    (read once, when the leader binds) gets in."""

    def __init__(self, key: bytes, path: Path) -> None:
        self.key, self.path = key, path

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key != self.key:
            logger.warning("refused a CURVE peer on the worker sockets: its public key %s is "
                           "not the workers' (%s)", client_key.decode(errors="replace"),
                           self.path)
            return False
        return True


def curve_server(ctx: zmq.Context, sock: zmq.Socket, key_dir: str | os.PathLike, *,
                 workers: bool = False) -> ThreadAuthenticator:
    """Make `sock` (not yet bound) a CURVE server with the keypair DIR/server.key_secret.
    It admits the public keys in DIR/clients (the client endpoint), or with `workers` only
    the workers' key DIR/worker.key (the leader's worker sockets): a client key never
    reaches a worker socket, nor the worker key the client endpoint (unless copied into
    clients/). Starts a ZAP authenticator thread on `ctx` and returns it: it checks every
    socket of ctx, so the caller keeps client and worker sockets in separate contexts, and
    stops it before terminating ctx. Refused keys are logged at WARNING."""
    d = Path(key_dir)
    public, secret = _load_secret(d / f"{SERVER_KEY}.key_secret", d)
    if workers:
        path = d / f"{WORKER_KEY}.key_secret"
        provider: _ClientKeys | _WorkerKey = _WorkerKey(_load_secret(path, d)[0], path)
    else:
        clients = d / CLIENTS_DIR
        if not clients.is_dir():
            raise FileNotFoundError(f"no {CLIENTS_DIR}/ folder in {d}: "
                                    + _keygen_hint(d))
        if not any(clients.glob("*.key")):
            logger.warning("%s holds no client keys: every client will be refused", clients)
        provider = _ClientKeys(clients)

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("nvllm.zap"))
    auth.start()
    try:
        auth.configure_curve_callback("*", credentials_provider=provider)
        curve_server_keys(sock, d)
    except BaseException:
        auth.stop()
        raise
    return auth


def curve_server_keys(sock: zmq.Socket, key_dir: str | os.PathLike) -> None:
    """Give another socket (not yet bound) of a context whose authenticator curve_server
    started the server keypair: one ZAP handler per context serves all its sockets."""
    d = Path(key_dir)
    sock.curve_publickey, sock.curve_secretkey = _load_secret(d / f"{SERVER_KEY}.key_secret", d)
    sock.curve_server = True


def load_client_keys(key_dir: str | os.PathLike, client_key: str | os.PathLike | None = None
                     ) -> tuple[bytes, bytes, bytes]:
    """(client public, client secret, server public) from DIR/server.key and
    DIR/client.key_secret, or the `client_key` secret file; errors name the missing file."""
    d = Path(key_dir)
    server_public = _load_public(d / f"{SERVER_KEY}.key", d)
    path = Path(client_key) if client_key is not None else d / f"{CLIENT_KEY}.key_secret"
    public, secret = _load_secret(path, path.parent)
    return public, secret, server_public


def curve_client(sock: zmq.Socket, key_dir: str | os.PathLike,
                 client_key: str | os.PathLike | None = None) -> None:
    """Make `sock` (before connect) a CURVE client of the server whose public key is
    DIR/server.key, with the keypair DIR/client.key_secret or the `client_key` file."""
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = load_client_keys(
        key_dir, client_key)


def curve_worker(sock: zmq.Socket, key_dir: str | os.PathLike) -> None:
    """Make a worker's socket (before connect) a CURVE client of the leader (DIR/server.key)
    with the workers' keypair DIR/worker.key_secret: the one key the worker sockets admit."""
    curve_client(sock, key_dir, Path(key_dir) / f"{WORKER_KEY}.key_secret")


class ClientOutboxes(dict[bytes, deque[bytes]]):
    """Frames a ROUTER socket could not hand to a client yet, per client, oldest first.

    A server never blocks on one client and never drops a message silently: a frame the
    client's ZMQ queue cannot take waits here (with ROUTER_MANDATORY set, a full queue
    raises instead of dropping), and a client whose box grows past ``limit`` is the
    caller's to evict. Shared by the leader's and the router's client endpoints."""

    def __init__(self, sock: zmq.Socket, limit: int) -> None:
        super().__init__()
        self.sock = sock
        self.limit = limit

    def try_send(self, client: bytes, frame: bytes) -> bool:
        """Send without blocking; False where the client cannot take it now."""
        try:
            self.sock.send_multipart([client, frame], flags=zmq.NOBLOCK)
            return True
        except zmq.Again:  # its ZMQ queue is full: it reads slower than it is sent
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:  # not connected now (it may come back)
                return False
            raise

    def send(self, client: bytes, frame: bytes, *, queue: bool = True) -> bool:
        """Send now, or (``queue``) behind what the client has not taken yet; False when
        its box has grown past the limit."""
        box = self.get(client)
        if box is None and self.try_send(client, frame):
            return True
        if not queue:
            return True
        if box is None:
            box = self[client] = deque()
        box.append(frame)
        return len(box) <= self.limit

    def flush(self) -> None:
        """Send what waits, oldest first, as far as each client takes it."""
        for client, box in list(self.items()):
            while box and self.try_send(client, box[0]):
                box.popleft()
            if not box:
                del self[client]

"""Small ZMQ helpers: sockets bound to ephemeral loopback ports, frame limits, and CURVE
authentication for the client endpoint.

CURVE key directory (``nvllm-keys DIR`` creates it; files are pyzmq certificates)::

    DIR/server.key          the server's public key: every client needs a copy
    DIR/server.key_secret   the server's keypair (mode 0600): only the server reads it
    DIR/clients/*.key       public keys of the authorised clients; the server re-reads
                            this folder at every handshake, so adding or deleting a file
                            grants or revokes access without a restart
    DIR/client.key          a default client keypair (its public key is also in clients/),
    DIR/client.key_secret   so that on a trusted machine a copy of DIR is all a client needs

A remote client needs only ``server.key`` and its own ``client.key`` + ``client.key_secret``
in its copy of the folder. A client whose key is not authorised, or that speaks no CURVE,
is refused during the handshake: ZMQ never delivers one of its frames.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shlex
import shutil
import stat
import tempfile
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)

SERVER_KEY, CLIENT_KEY, CLIENTS_DIR = "server", "client", "clients"


def _keygen_hint(key_dir: Path) -> str:
    return f"run `nvllm-keys {shlex.quote(str(key_dir))}` first"


def bind_random(sock: zmq.Socket, host: str = "127.0.0.1") -> str:
    """Bind to an OS-chosen port so two engines can run side by side; returns endpoint."""
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


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
    returns it. Secret files are written 0600 from the start: each keypair is made in a
    private (0700) temporary folder and moved into place."""
    d = Path(key_dir)
    names = [f"{SERVER_KEY}.key", f"{SERVER_KEY}.key_secret", f"{CLIENT_KEY}.key",
             f"{CLIENT_KEY}.key_secret", f"{CLIENTS_DIR}/{CLIENT_KEY}.key"]
    existing = [n for n in names if (d / n).exists()]
    if existing:
        raise FileExistsError(f"{d} already holds keys ({', '.join(existing)}); refusing to "
                              "overwrite them: pick another folder or delete them first")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    (d / CLIENTS_DIR).mkdir(mode=0o700, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=d, prefix=".keygen-") as tmp:
        for name in (SERVER_KEY, CLIENT_KEY):
            public, secret = zmq.auth.create_certificates(tmp, name)
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)
            os.replace(secret, d / f"{name}.key_secret")
            os.replace(public, d / f"{name}.key")
    shutil.copyfile(d / f"{CLIENT_KEY}.key", d / CLIENTS_DIR / f"{CLIENT_KEY}.key")
    return d


def _load_secret(path: Path, key_dir: Path) -> tuple[bytes, bytes]:
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} in {key_dir}: "
                                + _keygen_hint(key_dir))
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("%s is readable by other users: chmod 600 it", path)
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key (is it a public .key file?)")
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


def curve_server(ctx: zmq.Context, sock: zmq.Socket,
                 key_dir: str | os.PathLike) -> ThreadAuthenticator:
    """Make `sock` (not yet bound) a CURVE server that admits only the public keys in
    DIR/clients. Starts a ZAP authenticator thread on `ctx` and returns it: the caller
    stops it before terminating ctx. Refused keys are logged at WARNING."""
    d = Path(key_dir)
    public, secret = _load_secret(d / f"{SERVER_KEY}.key_secret", d)
    clients = d / CLIENTS_DIR
    if not clients.is_dir():
        raise FileNotFoundError(f"no {CLIENTS_DIR}/ folder in {d}: "
                                + _keygen_hint(d))
    if not any(clients.glob("*.key")):
        logger.warning("%s holds no client keys: every client will be refused", clients)

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("nvllm.zap"))
    auth.start()
    try:
        auth.configure_curve_callback("*", credentials_provider=_ClientKeys(clients))
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

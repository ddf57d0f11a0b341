"""``nvllm-keys DIR``: create the CURVE key folder that authenticates clients of the
engine's ZMQ endpoint and the workers of a multi-node group (layout in
nvllm/common/zmq_utils.py; docs/security.md, "Remote access").

The server reads DIR (``nvllm-launch --curve-key-dir DIR``); a client needs DIR's
``server.key`` and a keypair whose public half is in the server's ``DIR/clients/``; a
worker node needs ``server.key`` and ``worker.key_secret``, the one key the leader's worker
sockets admit. Secret files are written 0600 (any wider mode is refused when loading).
"""

from __future__ import annotations

import sys

import click

from nvllm.common.zmq_utils import generate_keys


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("key_dir", type=click.Path(file_okay=False))
def main(key_dir: str) -> None:
    """Create a server keypair, a default client keypair, DIR/clients/ authorising it, and
    the worker keypair (the only key the worker sockets admit).

    Existing keys are never overwritten; a folder that lacks only the worker keypair gets
    it."""
    try:
        d = generate_keys(key_dir)
    except (FileExistsError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    click.echo(f"CURVE keys in {d}:\n"
               f"  server:  nvllm-launch ... --host 0.0.0.0 --curve-key-dir {d}\n"
               f"  client:  nvllm-client --curve-key-dir {d} --endpoint tcp://HOST:PORT ...\n"
               f"  (a remote client needs a copy of {d}/server.key, client.key and "
               f"client.key_secret; to authorise another client, put its public .key file "
               f"in {d}/clients/; worker nodes need server.key and worker.key_secret, which "
               f"no client should get)")


if __name__ == "__main__":
    main()

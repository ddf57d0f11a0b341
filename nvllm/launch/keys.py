"""``nvllm-keys DIR``: create the CURVE key folder that authenticates clients of the
engine's ZMQ endpoint (layout in nvllm/common/zmq_utils.py; README "Remote access").

The server reads DIR (``nvllm-launch --curve-key-dir DIR``); a client needs DIR's
``server.key`` and a keypair whose public half is in the server's ``DIR/clients/``.
"""

from __future__ import annotations

import sys

import click

from nvllm.common.zmq_utils import generate_keys


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("key_dir", type=click.Path(file_okay=False))
def main(key_dir: str) -> None:
    """Create a server keypair, a default client keypair, and DIR/clients/ authorising it.

    Existing keys are never overwritten."""
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
               f"in {d}/clients/)")


if __name__ == "__main__":
    main()

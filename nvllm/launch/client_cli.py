"""``nvllm-client``: talk to a running engine from a terminal.

Streams the completion of one prompt as it is generated, then prints the finish reason
(``--info`` prints the engine's info instead). Speaks protocol v1 (docs/protocol.md)
through ``nvllm.common.client.Client``.
"""

from __future__ import annotations

import json
import sys

import click

from nvllm.common.client import Client, ClientError
from nvllm.common.errors import NvllmError


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--endpoint", required=True,
              help="The engine's client endpoint (nvllm-launch prints it: tcp://HOST:PORT).")
@click.option("--max-tokens", default=64, type=int)
@click.option("--temperature", default=0.0, type=float, help="0 means greedy.")
@click.option("--top-p", default=1.0, type=float)
@click.option("--seed", default=None, type=int)
@click.option("--stop", "stop", multiple=True, help="Stop string (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Generate max-tokens even past EOS.")
@click.option("--timeout", "timeout_s", default=600.0, type=float,
              help="Seconds to wait for each answer from the engine.")
@click.option("--info", "show_info", is_flag=True, help="Print the engine's info as JSON.")
@click.option("--curve-key-dir", default=None, envvar="NVLLM_CURVE_KEY_DIR",
              type=click.Path(exists=True, file_okay=False),
              help="CURVE keys for an engine that requires them: this folder's server.key "
                   "and client.key_secret (create with nvllm-keys; env NVLLM_CURVE_KEY_DIR).")
@click.argument("prompt", required=False)
def main(endpoint: str, max_tokens: int, temperature: float, top_p: float, seed: int | None,
         stop: tuple[str, ...], ignore_eos: bool, timeout_s: float, show_info: bool,
         curve_key_dir: str | None, prompt: str | None) -> None:
    """Stream the completion of PROMPT ('-' reads it from stdin)."""
    if not show_info and prompt is None:
        raise click.UsageError("give a PROMPT (or --info)")
    if prompt == "-":
        prompt = sys.stdin.read()
    params: dict = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                    "ignore_eos": ignore_eos}
    if seed is not None:
        params["seed"] = seed
    if stop:
        params["stop"] = list(stop)
    try:
        client = Client(endpoint, timeout_s=timeout_s, curve_key_dir=curve_key_dir)
    except (OSError, ValueError) as e:  # missing or unreadable key files
        raise click.UsageError(str(e)) from None
    with client:
        try:
            if show_info:
                info = {k: v for k, v in client.info().items() if k != "op"}
                click.echo(json.dumps(info, indent=2, sort_keys=True))
                return
            finish, n_tokens = None, 0
            stream = client.stream(prompt, params)
            try:
                for d in stream:
                    if d.text:
                        # Flush every delta: the point is to see tokens as they arrive.
                        sys.stdout.write(d.text)
                        sys.stdout.flush()
                    n_tokens += len(d.token_ids)
                    if d.finish_reason is not None:
                        finish = d.finish_reason
            finally:
                stream.close()  # on Ctrl-C this aborts the request instead of leaving it
            click.echo()
            click.echo(f"[finish_reason: {finish}, {n_tokens} tokens]")
        except (ClientError, NvllmError) as e:
            click.echo(f"\nerror: {e}", err=True)
            sys.exit(1)
        except TimeoutError as e:
            # A CURVE server ignores clients without keys: silence, not an error message.
            hint = "" if curve_key_dir else "; does it require --curve-key-dir?"
            click.echo(f"\nerror: {e} (is the engine running at {endpoint}{hint})", err=True)
            sys.exit(1)


if __name__ == "__main__":
    main()

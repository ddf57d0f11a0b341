"""Running the gateway: ``nvllm-serve`` (``main``). Starting it from another process is
``nvllm/launch/openai/process.py``'s."""

from __future__ import annotations

import logging
import os
import socket
import sys

import click

from nvllm.common import pageout
from nvllm.common.proc import die_with_parent, set_process_title
from nvllm.common.zmq_utils import load_client_keys
from nvllm.launch.openai.process import check_http_host
from nvllm.launch.openai.schemas import MAX_BODY_BYTES
from nvllm.launch.openai.tool_parsers import PARSER_CHOICES


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections made before uvicorn's loop runs wait in the backlog
    return sock


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--endpoint", required=True,
              help="The leader's client endpoint (nvllm-launch prints it: tcp://HOST:PORT).")
@click.option("--host", default="127.0.0.1",
              help="HTTP bind address (loopback by default; any other needs --api-key).")
@click.option("--port", default=8000, type=int, help="HTTP port (0: any free port).")
@click.option("--model-name", default=None,
              help="Model name clients use (default: the leader's model path).")
@click.option("--api-key", default=None, envvar="NVLLM_API_KEY",
              help="Require 'Authorization: Bearer KEY' on every route but /health.")
@click.option("--tokenizer", default=None,
              help="Tokenizer path for chat templates and logprob tokens (default: the "
                   "leader's model path).")
@click.option("--curve-key-dir", default=None, envvar="NVLLM_CURVE_KEY_DIR",
              type=click.Path(exists=True, file_okay=False),
              help="CURVE keys for a leader started with --curve-key-dir: this folder's "
                   "server.key and client.key_secret (env NVLLM_CURVE_KEY_DIR).")
@click.option("--max-body-bytes", default=MAX_BODY_BYTES, type=click.IntRange(min=1),
              help="Largest request body; a bigger one gets 413 (read no further).")
@click.option("--trust-request-chat-template", is_flag=True,
              help="Let requests supply a chat template (chat_template, or in "
                   "chat_template_kwargs); it is code the gateway runs, so refused by "
                   "default.")
@click.option("--allow-priority", is_flag=True,
              help="Let HTTP requests set priority (lower runs first and may preempt "
                   "others); refused by default.")
@click.option("--tool-call-parser", default="auto", type=click.Choice(PARSER_CHOICES),
              help="How tool_choice \"auto\" finds tool calls in the model's text: hermes "
                   "(<tool_call> JSON </tool_call>: Hermes, Qwen2.5, Qwen3), llama3_json "
                   "(a JSON call as the whole output), or auto: from the tokenizer.")
@click.option("--page-out-libraries/--no-page-out-libraries", default=True,
              help="Once started, give back the shared-library pages start-up touched "
                   "(madvise MADV_PAGEOUT; nvllm/common/pageout.py).")
@click.option("--log-level", default="info",
              type=click.Choice(["debug", "info", "warning", "error"]))
def main(endpoint: str, host: str, port: int, model_name: str | None, api_key: str | None,
         tokenizer: str | None, curve_key_dir: str | None, max_body_bytes: int,
         trust_request_chat_template: bool, allow_priority: bool, tool_call_parser: str,
         page_out_libraries: bool, log_level: str) -> None:
    """OpenAI-compatible HTTP server for a running nvllm engine."""
    try:
        check_http_host(host, api_key)
        if curve_key_dir:
            load_client_keys(curve_key_dir)  # fail here, not in the app's startup
    except (OSError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    set_process_title("nvllm-http")
    if os.environ.get("NVLLM_PARENT_PID"):  # started by nvllm-launch: go when it goes
        die_with_parent(int(os.environ["NVLLM_PARENT_PID"]))
    import uvicorn

    from nvllm.launch.openai.app import GatewayConfig, create_app

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s nvllm-serve %(levelname)s %(message)s")
    app = create_app(GatewayConfig(
        endpoint, model_name, api_key, tokenizer, curve_key_dir, max_body_bytes=max_body_bytes,
        trust_request_chat_template=trust_request_chat_template,
        allow_priority=allow_priority, tool_call_parser=tool_call_parser))
    sock = _bind(host, port)
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"nvllm-serve on http://{shown}:{sock.getsockname()[1]} -> {endpoint}")
    sys.stdout.flush()
    if page_out_libraries:  # the web stack is imported and the app built: warm enough
        pageout.page_out_libraries("gateway")
    server.run(sockets=[sock])

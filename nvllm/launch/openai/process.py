"""Starting the OpenAI gateway as a process of its own (``start_gateway_process``, for
nvllm-launch, the data-parallel router and tests) and the check that a non-loopback bind
has an API key. Apart from the gateway's web stack on purpose: the leader imports this,
and fastapi / pydantic would add ~24 MiB to its resident memory."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from nvllm.common.zmq_utils import is_loopback


def check_http_host(host: str, api_key: str | None) -> None:
    """Refuse to expose the HTTP API beyond this machine without a key."""
    if not api_key and not is_loopback(host):
        raise ValueError(f"binding the HTTP gateway to {host} needs authentication: pass "
                         "--api-key KEY (or set NVLLM_API_KEY); clients then send "
                         "'Authorization: Bearer KEY'")


def start_gateway_process(endpoint: str, host: str, port: int, model_name: str | None = None,
                          *, api_key: str | None = None, curve_key_dir: str | None = None,
                          log_level: str = "warning", max_body_bytes: int | None = None,
                          trust_request_chat_template: bool = False,
                          allow_priority: bool = False, tool_call_parser: str = "auto",
                          page_out_libraries: bool = True, **popen_kwargs: Any
                          ) -> subprocess.Popen:
    """Start ``python -m nvllm.launch.openai`` attached to `endpoint`; the caller owns
    the process (terminate it, then wait). Raises ValueError at once (no process) for a
    non-loopback `host` without `api_key`. The keyword options are nvllm-serve's flags."""
    check_http_host(host, api_key)
    cmd = [sys.executable, "-m", "nvllm.launch.openai", "--endpoint", endpoint,
           "--host", host, "--port", str(port), "--log-level", log_level]
    if model_name:
        cmd += ["--model-name", model_name]
    if curve_key_dir:
        cmd += ["--curve-key-dir", str(curve_key_dir)]
    if max_body_bytes is not None:
        cmd += ["--max-body-bytes", str(max_body_bytes)]
    if trust_request_chat_template:
        cmd += ["--trust-request-chat-template"]
    if allow_priority:
        cmd += ["--allow-priority"]
    if tool_call_parser != "auto":
        cmd += ["--tool-call-parser", tool_call_parser]
    if not page_out_libraries:
        cmd += ["--no-page-out-libraries"]
    env = dict(popen_kwargs.pop("env", None) or os.environ, NVLLM_PARENT_PID=str(os.getpid()))
    if api_key:  # by environment, not argv: ps shows every user a process's arguments
        env["NVLLM_API_KEY"] = api_key
    return subprocess.Popen(cmd, env=env, **popen_kwargs)

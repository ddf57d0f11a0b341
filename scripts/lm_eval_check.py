#!/usr/bin/env python
"""lm-evaluation-harness, a client that is not ours, against nvllm's HTTP gateway.

``python scripts/lm_eval_check.py`` creates (once) a virtual environment of its own under
``~/.cache/nvllm/lm-eval-VERSION`` with ``lm-eval[api]`` and ``transformers`` (lm-eval's
tokenizer backend; no torch needed), starts ``nvllm-launch`` with the gateway on the tiny
qwen3 checkpoint (random weights: the scores mean nothing), and runs ``lm_eval`` with model
``local-completions`` and token-id requests on two tasks kept here (scripts/lm_eval_tasks,
over a 12-item local jsonl): ``nvllm_tiny_mc`` (loglikelihood: echo=true, logprobs=1,
max_tokens=1 requests, read back as the prompt's token_logprobs) and ``nvllm_tiny_gen``
(generate_until). Everything is offline (HF_*_OFFLINE). Heavy, so never run in CI; the CI
replays lm-eval's loglikelihood request in tests/launch/openai/test_echo.py.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

VERSION = "0.4.13"
VENV = pathlib.Path(os.environ.get(
    "NVLLM_LM_EVAL_VENV", pathlib.Path.home() / ".cache" / "nvllm" / f"lm-eval-{VERSION}"))
TASKS = pathlib.Path(__file__).resolve().parent / "lm_eval_tasks"
NAME = "tiny-qwen3"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def lm_eval_python() -> pathlib.Path:
    """The venv's python, creating the venv when lm_eval does not import there."""
    py = VENV / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import lm_eval, transformers"],
                                      capture_output=True).returncode == 0:
        return py
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"lm-eval[api]=={VERSION}",
                    "transformers"], check=True)
    return py


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"nvllm-launch exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("the gateway did not become healthy in time")


def main() -> int:
    from nvllm.launch.tiny import ensure_tiny_checkpoint

    py = lm_eval_python()
    model = ensure_tiny_checkpoint("qwen3")
    port = free_port()
    launch = [sys.executable, "-m", "nvllm.launch.cli", "--model", str(model), "--tp", "1",
              "--device", "cpu", "--dtype", "float32", "--port", "0", "--http-port",
              str(port), "--served-model-name", NAME, "--log-level", "WARNING"]
    engine = subprocess.Popen(launch, stdout=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, engine, 180)
        model_args = (f"base_url={base}/v1/completions,model={NAME},tokenizer={model},"
                      "tokenizer_backend=huggingface,tokenized_requests=True,"
                      "num_concurrent=1,max_retries=1")
        cmd = [str(py), "-m", "lm_eval", "--model", "local-completions", "--model_args",
               model_args, "--tasks", "nvllm_tiny_mc,nvllm_tiny_gen", "--include_path",
               str(TASKS), "--batch_size", "4"]
        print("$", " ".join(cmd[1:]), flush=True)
        # Relative data_files in the task YAMLs resolve against the working directory.
        r = subprocess.run(cmd, cwd=TASKS, env={**os.environ, **OFFLINE}, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        print(r.stdout)
        if r.returncode != 0 or not re.search(r"nvllm_tiny_mc.*\|acc", r.stdout):
            return r.returncode or 1
        return 0
    finally:
        engine.send_signal(signal.SIGINT)
        try:
            engine.wait(60)
        except subprocess.TimeoutExpired:
            engine.kill()


if __name__ == "__main__":
    sys.exit(main())

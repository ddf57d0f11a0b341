"""What the HTTP gateway process imports: it forwards requests and streams text, so it
carries neither torch nor numpy (numpy alone is ~13 MiB of its resident set; the client's
RL calls import it only when they send weights)."""

from __future__ import annotations

import subprocess
import sys


def test_the_gateway_imports_neither_numpy_nor_torch():
    code = ("import sys; import nvllm.launch.openai.__main__, nvllm.launch.openai.app; "
            "print(sorted(m for m in ('numpy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_leader_starts_the_gateway_without_its_web_stack():
    """nvllm-launch's process (the leader) starts the gateway through
    nvllm/launch/openai/process.py: fastapi and pydantic would add ~24 MiB to it."""
    code = ("import sys; import nvllm.launch.cli, nvllm.launch.openai.process; "
            "print(sorted(m for m in ('fastapi', 'pydantic', 'starlette', 'uvicorn') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

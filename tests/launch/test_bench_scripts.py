"""The nvllm side of the peer benchmarks runs (the vLLM side needs its own venv and is
not run here: scripts/bench_vs_vllm.py and scripts/serve_vs_vllm.sh are run by hand)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_bench_vs_vllm_nvllm_child(tiny):
    model = tiny("qwen3")
    cmd = [sys.executable, str(REPO / "scripts" / "bench_vs_vllm.py"), "--child", "nvllm",
           "--dtype", "float32", "--model", model, "--vocab", "1024", "--max-model-len", "64",
           "--num-seqs", "3", "--input", "4", "8", "--output", "2", "5"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(next(ln for ln in r.stdout.splitlines()
                          if ln.startswith("RESULT "))[len("RESULT "):])
    assert res["tokens"] > 0 and res["output_tok_s"] > 0


def test_serve_vs_vllm_starts_nvllm_as_documented():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import serve_vs_vllm
    finally:
        sys.path.remove(str(REPO / "scripts"))

    class Args:
        model, max_model_len = "/m", 1024

    cmd = serve_vs_vllm.server_command("nvllm", Args, "bfloat16", 8123, pathlib.Path("/v"))
    assert cmd[0] == "nvllm-launch" and "--http-port" in cmd and "8123" in cmd
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--served-model-name") + 1] == serve_vs_vllm.NAME


def _script(name: str):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(REPO / "scripts"))


def test_pad_heads_gives_the_same_model_with_more_heads(tiny, tmp_path):
    """scripts/pad_heads.py: 9 / 3 heads padded for tp=2 are 12 / 4 and 28 / 4 (with q/k/v
    biases) for tp=3 are 42 / 6; HF computes the same logits from the copy."""
    import torch
    from transformers import AutoModelForCausalLM

    pad_heads = _script("pad_heads")
    assert [pad_heads.padded_kv_heads(kv, tp) for kv, tp in
            [(3, 2), (4, 3), (2, 3), (1, 4), (2, 4), (8, 8), (5, 1)]] == [4, 6, 3, 1, 2, 8, 5]
    ids = torch.tensor([[1, 5, 9, 200, 3, 77, 1000, 42]])
    for preset, tp, want in [("llama-9h3kv", 2, (12, 4)), ("qwen2-28h4kv", 3, (42, 6))]:
        src, dst = tiny(preset), tmp_path / preset
        assert pad_heads.pad_checkpoint(src, dst, tp) == want
        with torch.no_grad():
            a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
            b = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)(ids).logits
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)

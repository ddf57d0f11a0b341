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


def test_quant_quality_scores_every_position_and_orders_the_formats(tiny):
    """scripts/quant_quality.py on tiny:qwen3: the reference matches itself exactly, int8
    moves the distributions less than int4, and both hold fewer weight bytes."""
    quant_quality = _script("quant_quality")
    rows = {r.quantization: r for r in quant_quality.main(
        ["--model", tiny("qwen3"), "--max-tokens", "24", "--no-fp8"])}
    assert set(rows) == {"none", "int8", "int4"}
    ref = rows["none"]
    assert ref.kl_max == 0 and ref.top1 == 1 and ref.ppl_rel == 0
    assert 0 < rows["int8"].kl_mean < rows["int4"].kl_mean
    assert rows["int8"].weight_mib < ref.weight_mib and rows["int4"].weight_mib < ref.weight_mib
    assert all(r.ppl > 0 for r in rows.values())


def test_serve_vs_llamacpp_sizes_both_servers_alike():
    """Both servers: the same file, 8,192 KV tokens of 16-bit values, 512 per sequence,
    127.0.0.1, and nvllm's KV held once (no CPU mirror)."""
    peer = _script("serve_vs_llamacpp")
    args = peer.parse_args(["--concurrency", "16"])
    args.gguf, args.llama_bin = "/m.gguf", pathlib.Path("/l")
    nv = peer.server_command("nvllm", args, 8123)
    ll = peer.server_command("llama.cpp", args, 8124)
    opt = lambda cmd, k: cmd[cmd.index(k) + 1]  # noqa: E731
    assert opt(nv, "--model") == opt(ll, "-m") == "/m.gguf"
    kv = int(opt(nv, "--num-kv-blocks")) * int(opt(nv, "--block-size"))
    assert kv == int(opt(ll, "-c")) == 8192
    assert int(opt(nv, "--max-model-len")) == kv // int(opt(ll, "--parallel")) == 512
    assert "--no-cpu-kv-mirror" in nv and opt(nv, "--quantization") == "auto"
    assert opt(nv, "--kv-cache-dtype") == "bfloat16"  # 2 bytes a value, as llama.cpp's f16
    assert opt(nv, "--http-host") == opt(ll, "--host") == "127.0.0.1"
    assert ll[0] == "/l/llama-server" and opt(ll, "-t") == "2"
    log = "rank 0 holds 51.1 MiB of weights\nrank 1 holds 45.6 MiB of weights\n"
    assert abs(peer.weight_mib("nvllm", log, "") - 96.7) < 1e-9
    assert peer.weight_mib("llama.cpp", "load_tensors:   CPU_Mapped model buffer size =    "
                           "93.81 MiB\n", "") == 93.81
    assert peer.weight_mib("nvllm", "", "") is None
    timing = ("slot print_timing: id 15 | task 0 | prompt eval time =  386.64 ms /   128 "
              "tokens (3.02 ms per token)\nslot print_timing: id 15 | task 0 |        eval "
              "time =    1139.95 ms /   127 tokens (8.98 ms per token)\n")
    assert peer.server_tokens("llama.cpp", timing * 2) == 254
    assert peer.server_tokens("nvllm", timing) is None


def test_serve_vs_llamacpp_counts_cpu_from_the_first_request():
    """The load window opens at the first second the server's tree works: the client's
    start-up CPU (before its first request) is not counted against the load, and a
    client that has exited keeps the CPU it had used."""
    peer = _script("serve_vs_llamacpp")
    s = peer.LoadSampler(pid=0)
    s.samples = [(0.0, 5.00, 0.0), (1.0, 5.01, 4.0), (2.0, 5.02, 9.0),  # client starting
                 (3.0, 6.80, 9.1), (4.0, 8.70, 9.2), (5.0, 10.60, 9.4)]
    w = s.window()
    assert w["window_s"] == 3.0
    assert abs(w["server_cpu_s"] - 5.58) < 1e-9 and abs(w["client_load_cpu_s"] - 0.4) < 1e-9
    assert peer.LoadSampler(pid=0).window()["window_s"] is None  # never loaded
    line = peer.load_cpu({"client_cpu_s": 12.0, **w})
    assert "server 6 s" in line and "client 0.4 s" in line and "whole run 12 s" in line


def test_serve_vs_llamacpp_reads_pss_every_fifth_sample_and_no_client_memory(monkeypatch):
    """PSS costs the kernel a walk of every mapped page (tens of ms of CPU per tree, taken
    from the server under test): the sampler reads it every PSS_EVERY samples, RSS and CPU
    every sample, and only CPU for the client."""
    peer = _script("serve_vs_llamacpp")
    calls = []

    def fake(pid, pss=True):
        calls.append((pid, pss))
        return (100 + len(calls), 7 * len(calls) if pss else 0, float(len(calls)))

    monkeypatch.setattr(peer, "tree_usage", fake)
    s = peer.LoadSampler(pid=1)
    s.client_pid = 2
    for _ in range(2 * s.PSS_EVERY + 1):
        s.sample()
    server = [pss for pid, pss in calls if pid == 1]
    assert server == [i % s.PSS_EVERY == 0 for i in range(2 * s.PSS_EVERY + 1)]
    assert all(pss is False for pid, pss in calls if pid == 2)
    assert s.last == 100 + len(calls) - 1  # RSS from the last sample
    last_pss_call = max(i for i, (pid, pss) in enumerate(calls, 1) if pid == 1 and pss)
    assert s.last_pss == 7 * last_pss_call  # PSS from the last sample that read it


def test_llamacpp_build_options_follow_the_cpu_flags():
    """Each ggml extension is on exactly when /proc/cpuinfo lists it; AMX only when asked;
    a different set of options is a different cache folder."""
    lp = _script("llamacpp_peer")
    avx2 = lp.cmake_options({"avx", "avx2", "fma", "f16c", "bmi2"}, amx=False)
    assert "-DGGML_NATIVE=OFF" in avx2 and "-DLLAMA_CURL=OFF" in avx2
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=OFF" in avx2
    assert not any("AMX" in o for o in avx2)
    full = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile", "amx_int8"}
    amx = lp.cmake_options(full, amx=True)
    assert {"-DGGML_AVX512_BF16=ON", "-DGGML_AMX_INT8=ON", "-DGGML_AMX_BF16=OFF"} <= set(amx)
    assert lp.build_dir(amx) != lp.build_dir(lp.cmake_options(full, amx=False))
    sh = REPO / "scripts" / "serve_vs_llamacpp.sh"
    assert subprocess.run(["bash", "-n", str(sh)]).returncode == 0

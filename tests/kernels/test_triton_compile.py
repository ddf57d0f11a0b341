"""Every Triton kernel the engine launches compiles ahead of time for sm_90 (H100/H200) and
sm_80 (A100; all but the fp8 GEMM, which needs sm_89+), at the constexprs, dtypes and
launch options the launch wrappers pass, and fits the device's shared memory per block. No
GPU needed: ``triton.compile`` with an explicit ``GPUTarget`` and the ptxas that Triton
ships produce the cubin on this machine.

The launches come from the real wrappers (see nvllm/kernels/triton_aot.py), so a new tile
size at a launch site is checked without touching this test. The compilation runs in
subprocesses (one per target, in parallel) with ``TRITON_INTERPRET=0``: in this process
tests/conftest.py may have turned on the interpreter, whose ``@triton.jit`` cannot compile.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

# The AOT path drives triton internals (the runtime's binder and _pack_args); pinned in
# pyproject's dev extras.
TESTED_TRITON = "3.9.0"
REPO = pathlib.Path(__file__).resolve().parents[2]
TARGETS = ("sm_90", "sm_80")


def _ptxas() -> str | None:
    from triton import knobs

    try:
        path = knobs.nvidia.ptxas.path
    except Exception:
        return None
    return path if path and os.path.exists(path) else None


pytestmark = [
    pytest.mark.skipif(triton.__version__ != TESTED_TRITON,
                       reason=f"AOT compile check written against triton {TESTED_TRITON} "
                              f"internals, found {triton.__version__}"),
    pytest.mark.skipif(_ptxas() is None, reason="no ptxas found (Triton's bundled one or "
                                                "TRITON_PTXAS_PATH)"),
]


def _compile_all(tmp_path) -> list[dict]:
    from nvllm.common.config import EngineConfig

    # The engine's default KV block size: the kernels' compiler takes the shapes it compiles
    # for from its caller (nvllm/kernels imports nothing of the engine's config).
    page_size = EngineConfig.__dataclass_fields__["block_size"].default
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]),
        # A fresh cache: every kernel really goes through the compiler and ptxas.
        TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    procs = [subprocess.Popen([sys.executable, "-m", "nvllm.kernels.triton_aot", "--json",
                               "--page-size", str(page_size), "--targets", t],
                              env=env, cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for t in TARGETS]
    rows = []
    for t, p in zip(TARGETS, procs):
        out, err = p.communicate(timeout=600)
        try:
            rows += json.loads(out.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            pytest.fail(f"AOT compile for {t} produced no result (rc {p.returncode}):\n"
                        f"{err[-4000:]}")
    shutil.rmtree(tmp_path / "triton-cache", ignore_errors=True)
    return rows


def test_every_launched_kernel_compiles_and_fits_shared_memory(tmp_path):
    rows = _compile_all(tmp_path)
    print()
    for r in rows:
        print(f"{r['kernel']:22} {r['dtype']:9} {r['target']:6} {r.get('shared', 'ERR'):>6} "
              f"{r['config']}  [{','.join(r['models'])}]")
    for t in TARGETS:
        mine = [r for r in rows if r["target"] == t and "shared" in r]
        if mine:
            top = max(mine, key=lambda r: r["shared"])
            print(f"{t}: largest shared memory {top['shared']} B ({top['kernel']} "
                  f"{top['dtype']}), limit {top['limit']} B")

    # Every kernel the kernel modules define was launched by the recorded wrappers, for each
    # target and dtype (a new kernel whose wrapper record_launches does not call fails here).
    from triton.runtime.jit import KernelInterface

    from nvllm.kernels import triton_attention, triton_layer_ops, triton_moe, triton_quant

    kernels = {name for mod in (triton_attention, triton_layer_ops, triton_moe, triton_quant)
               for name, val in vars(mod).items()
               if name.endswith("_kernel") and isinstance(val, KernelInterface)}
    assert len(kernels) >= 9, kernels
    # fp8 e4m3 needs sm_89+: compiled for sm_90 only (triton_quant.FP8_MIN_ARCH).
    sm90_only = {"_fp8_matmul_kernel"}
    for t in TARGETS:
        want = kernels if t == "sm_90" else kernels - sm90_only
        for dt in ("float32", "bfloat16", "float16"):
            seen = {r["kernel"] for r in rows if r["target"] == t and r["dtype"] == dt}
            assert seen == want, (t, dt, want ^ seen)

    failed = [f"{r['kernel']} {r['dtype']} {r['target']} {r['config']}: {r['error']}"
              for r in rows if "error" in r]
    assert not failed, "kernels that do not compile:\n" + "\n".join(failed)
    over = [f"{r['kernel']} {r['dtype']} {r['target']} {r['config']}: {r['shared']} B > "
            f"{r['limit']} B" for r in rows if r["shared"] > r["limit"]]
    assert not over, "kernels over the shared-memory limit:\n" + "\n".join(over)

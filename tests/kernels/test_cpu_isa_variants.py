"""The native CPU ops hold one vector path per instruction set (AVX-512, AVX2 + FMA,
portable loops), and a build compiles only the best one this CPU has: so the rest of the
suite tests that one alone. Here the ops are built once more with the next narrower
path (``NVLLM_CPU_ISA``: AVX2 where the CPU has AVX-512, else the portable loops) and
the kernels' contract tests run against that build in a child process, so a machine of
either kind checks two of the three paths.

About 100 s to build (cached under ~/.cache/nvllm/ext like the native build; the test
command, scripts/test.sh, has scripts/install.sh compile it beside the native build, one
core each, so here it is found built) and 30 s of tests."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from nvllm.kernels import cpu_ops

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONTRACTS = [
    "tests/kernels/test_cpu_decode_kernel_runs.py",
    "tests/worker/test_quant.py::test_native_op_equals_dequantize_then_matmul",
    "tests/worker/test_quant_vnni.py",
    "tests/worker/test_quant_a16.py::test_a16_op_is_int16_rounded_x_times_dequantized_weights",
]


@pytest.mark.skipif(not cpu_ops.load(), reason="nvllm's CPU ops did not build here")
def test_kernel_contracts_hold_on_the_narrower_vector_path():
    isa = cpu_ops.narrower_isa()
    env = {**os.environ, cpu_ops.ISA_ENV: isa}
    built = subprocess.run([sys.executable, "-m", "nvllm.kernels.cpu_ops"], env=env,
                           cwd=ROOT, check=True, timeout=600, capture_output=True, text=True)
    probe = subprocess.run(
        [sys.executable, "-c", "from nvllm.kernels import cpu_ops; import torch; "
         "assert cpu_ops.load(); print(cpu_ops.library_path(), "
         "torch.ops.nvllm_cpu.quant_a8_vectorized(), "
         "torch.ops.nvllm_cpu.quant_a16_vectorized())"],
        env=env, cwd=ROOT, check=True, timeout=120, capture_output=True, text=True)
    path, vectorized, vectorized16 = probe.stdout.split()
    # What the build prints is where a later process finds it (the build must not change
    # its own key: cpp_extension appends to the flag lists it is given).
    assert built.stdout.strip().splitlines()[-1] == path, built.stdout
    assert path != str(cpu_ops.library_path()), "the variant must be a build of its own"
    # AVX2 has a vector loop for the int8- and int16-activation ops, the portable build
    # has none.
    assert vectorized == vectorized16 == ("True" if isa == "avx2" else "False"), probe.stdout
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-x", *CONTRACTS],
        env=env, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert run.returncode == 0, f"{isa} build:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout, run.stdout[-2000:]

#!/usr/bin/env python
"""The quantized-weights speed peer: llama.cpp's ``llama-server``, built from source.

``python scripts/llamacpp_peer.py`` builds ``llama-server`` and ``llama-bench`` when they
are missing and prints the folder holding them; ``scripts/serve_vs_llamacpp.sh`` calls it
first. The recipe lives here, not in CI:

* the source: the ``llama-cpp-python==0.3.36`` sdist from PyPI (``pip download
  --no-binary :all: --no-deps``), whose ``vendor/llama.cpp`` is a pinned llama.cpp: PyPI is
  the one registry this machine reaches, and a pin makes two builds the same program;
* cmake, Release, ``-DGGML_NATIVE=OFF`` with each x86 extension switched on only when
  ``/proc/cpuinfo`` lists it (a native build would bake in whatever the build machine
  has, and the cache key would not say so); no curl, no OpenSSL, no web UI download (the
  machine reaches no Hugging Face, and the benchmark speaks plain HTTP on 127.0.0.1);
* only the two targets, ``-j2`` under ``nice -n 10`` (about 7 minutes on 2 cores);
* cached under ``~/.cache/nvllm/llamacpp-<version>-<hash of the cmake flags>``;
* AMX: on CPUs with ``amx_tile``/``amx_int8``/``amx_bf16``, an AMX build is tried first and
  kept only when a one-minute ``llama-bench`` on the model runs (ggml's AMX path has died
  with SIGILL on such machines); otherwise the build without AMX is used.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

VERSION = "0.3.36"
CACHE = pathlib.Path(os.environ.get("NVLLM_CACHE", pathlib.Path.home() / ".cache" / "nvllm"))
TARGETS = ("llama-server", "llama-bench")

# ggml's cmake switch for each /proc/cpuinfo flag it needs (all of them for a switch).
X86_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_AVX512", ("avx512f",)),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512vbmi")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16")),
)
AMX_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_AMX_TILE", ("amx_tile",)),
    ("GGML_AMX_INT8", ("amx_tile", "amx_int8")),
    ("GGML_AMX_BF16", ("amx_tile", "amx_bf16")),
)
FIXED_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF",
)


def cpu_flags() -> set[str]:
    """The flags of the first processor in /proc/cpuinfo (what lscpu prints as Flags)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_summary() -> str:
    """The model name and the flags the build and the kernels care about, for reports."""
    model = "unknown CPU"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    wanted = sorted({f for _, need in X86_OPTIONS + AMX_OPTIONS for f in need} & cpu_flags())
    return f"{model}, {os.cpu_count()} CPUs; flags: {' '.join(wanted) or 'none of interest'}"


def cmake_options(flags: set[str], amx: bool) -> list[str]:
    """The -D options for this CPU: each extension ON exactly when the CPU has it."""
    table = X86_OPTIONS + (AMX_OPTIONS if amx else ())
    opts = list(FIXED_OPTIONS)
    opts += [f"-D{name}={'ON' if all(f in flags for f in need) else 'OFF'}"
             for name, need in table]
    return opts


def has_amx(flags: set[str]) -> bool:
    return "amx_tile" in flags


def build_dir(options: list[str]) -> pathlib.Path:
    key = hashlib.sha256(" ".join(options).encode()).hexdigest()[:12]
    return CACHE / f"llamacpp-{VERSION}-{key}"


def _source() -> pathlib.Path:
    """vendor/llama.cpp of the sdist, downloaded and unpacked once for every build."""
    root = CACHE / f"llamacpp-{VERSION}-src"
    src = root / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    with tempfile.TemporaryDirectory() as tmp:
        print(f"downloading the llama-cpp-python {VERSION} sdist from PyPI", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                        "--no-deps", f"llama-cpp-python=={VERSION}",
                        "-d", tmp, "-q"], check=True)
        sdist = next(pathlib.Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        partial = root.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(partial, filter="data")
        shutil.rmtree(root, ignore_errors=True)
        partial.rename(root)
    return src


def _build(options: list[str], jobs: int) -> pathlib.Path:
    """Configure and build TARGETS into build_dir(options); return its bin folder."""
    out = build_dir(options)
    bin_dir = out / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    src = _source()
    tree = out / "build"
    print(f"building {', '.join(TARGETS)} into {out} (about 7 minutes on 2 cores, once)",
          file=sys.stderr)
    nice = ["nice", "-n", "10"]
    subprocess.run([*nice, "cmake", "-S", str(src), "-B", str(tree), *options],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*nice, "cmake", "--build", str(tree), "--config", "Release", "-j",
                    str(jobs), "--target", *TARGETS], check=True, stdout=subprocess.DEVNULL)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for t in TARGETS:
        shutil.copy2(tree / "bin" / t, bin_dir / t)
    (out / "cmake-options.txt").write_text("\n".join(options) + "\n")
    return bin_dir


def bench_runs(bin_dir: pathlib.Path, model: str, timeout: float = 60) -> bool:
    """Whether a short llama-bench (tiny prompt and generation) completes on this CPU."""
    cmd = [str(bin_dir / "llama-bench"), "-m", model, "-p", "16", "-n", "8", "-r", "1",
           "-t", "2"]
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0


def ensure(model: str | None = None, jobs: int = 2) -> pathlib.Path:
    """Build llama.cpp for this CPU if not cached; return the folder with its binaries.

    With AMX in the CPU flags and a ``model`` to try it on, the AMX build is used only if
    llama-bench runs on it; a failed AMX build or run falls back to the plain build.
    """
    flags = cpu_flags()
    if has_amx(flags) and model is not None:
        amx_opts = cmake_options(flags, amx=True)
        marker = build_dir(amx_opts) / "amx-ok"
        try:
            amx_bin = _build(amx_opts, jobs)
            if marker.exists() or bench_runs(amx_bin, model):
                marker.touch()
                return amx_bin
            print("llama.cpp's AMX build fails on this CPU; using the build without AMX",
                  file=sys.stderr)
        except subprocess.CalledProcessError as e:
            print(f"llama.cpp's AMX build failed ({e}); building without AMX", file=sys.stderr)
    return _build(cmake_options(flags, amx=False), jobs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a .gguf to try an AMX build on (AMX CPUs only)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--print-options", action="store_true",
                    help="print the cmake options and the cache folder for this CPU; build "
                    "nothing")
    args = ap.parse_args()
    if args.print_options:
        opts = cmake_options(cpu_flags(), amx=False)
        print(cpu_summary())
        print(" ".join(opts))
        print(build_dir(opts))
        return
    print(ensure(args.model, args.jobs))


if __name__ == "__main__":
    main()

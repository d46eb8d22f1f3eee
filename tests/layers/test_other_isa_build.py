"""The kernels of an AVX2-only CPU, built and tested on an AVX-512 machine.

The fused kernels choose their code at compile time (`#if __AVX512F__ ...`, cpu_ops.cpp), and
the library is built for the machine it runs on, so an AVX-512 machine's suite skips the AVX2
kernels' tests, and an AVX2 machine's skips the AVX-512 ones. CI runs on either kind. Here, on
an AVX-512 machine, the kernel, quantisation, step-program and fused-backend tests run again in
a fresh interpreter against a library built for AVX2 (`DSINFER_CPU_MARCH=haswell`,
cpu_build.py). That is how the AVX2 step program was found choosing int8 kernels by its compile
flags where the Python side asks the CPU: the program and the eager step parted by a bf16 ulp.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsinfer.layers.kernels.cpu_build import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
FILES = (
    "tests/layers/test_fused_kernels.py",
    "tests/layers/test_quant.py",
    "tests/models/test_step_program.py",
    "tests/models/test_fused_backend.py",
)
# What may still skip in the AVX2 build: the AVX-512 kernels' tests.
AVX512_ONLY = re.compile(r"no AVX512-BF16 on this CPU|no AVX512-VNNI/BF16 on this CPU")


def test_the_avx2_build_passes_the_kernel_and_program_tests() -> None:
    flags = set(cpu_flags().split())
    if "avx512f" not in flags:
        pytest.skip("this machine's own build is the AVX2 one (or older): its tests ran above")
    if not {"avx2", "fma"} <= flags:
        pytest.skip("this CPU cannot run an AVX2 build")
    env = {**os.environ, "DSINFER_CPU_MARCH": "haswell"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    cmd += ["-m", "not slow and not gpu", *FILES]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    summary = re.search(r"(\d+) passed", done.stdout)
    assert summary and int(summary.group(1)) >= 200, tail
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    # The AVX2 kernels' tests ran (the native suite skips them): only AVX-512 ones skipped.
    assert skips and all(AVX512_ONLY.search(line) for line in skips), skips

"""The kernels of other x86 CPUs, built and tested on this one.

The fused kernels choose their code at compile time (`#if __AVX512F__ ...`, cpu_ops.cpp), and
the library is built for the machine it runs on, so a machine's suite tests its own ISA's
kernels only. CI runs on an AVX-512 (BF16, VNNI) kind or an AVX2-only one. Where this CPU can
run another ISA's build, the kernel tests run again in a fresh interpreter against a library
built for it (`DSINFER_CPU_MARCH`, cpu_build.py):

- AVX2 + FMA (`haswell`), on an AVX-512 machine: the kernel, quantisation, step-program and
  fused-backend tests. This found the AVX2 step program choosing int8 kernels by its compile
  flags where the Python side asks the CPU: the program and the eager step parted by a bf16 ulp.
- AVX-512 without BF16 and VNNI (`skylake-avx512`: Skylake-SP, Cascade Lake and Ice Lake
  servers are of this family), on an AVX512-BF16 machine: the kernel, quantisation,
  step-program, attention and MoE tests. This found that the kernels did not compile there at
  all (a bf16 conversion of AVX512-BF16 under a plain AVX-512 guard): the fused backend fell
  back to the reference on such CPUs.
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
KERNEL_FILES = (
    "tests/layers/test_fused_kernels.py",
    "tests/layers/test_quant.py",
    "tests/models/test_step_program.py",
)
# What may still skip in these builds: the AVX512-BF16/VNNI kernels' tests.
BF16_VNNI_ONLY = re.compile(r"no AVX512-BF16 on this CPU|no AVX512-VNNI/BF16 on this CPU")
BUILDS = {
    # march: (CPU flags it needs, a flag this CPU has only if its own build differs, files)
    "haswell": ({"avx2", "fma"}, "avx512f", (*KERNEL_FILES, "tests/models/test_fused_backend.py")),
    "skylake-avx512": (
        {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx2", "fma"},
        "avx512_bf16",
        (
            *KERNEL_FILES,
            "tests/layers/test_attention_backends.py",
            "tests/layers/test_moe.py",
        ),
    ),
}


@pytest.mark.parametrize("march", sorted(BUILDS))
def test_another_isas_build_passes_the_kernel_tests(march: str) -> None:
    needs, beyond, files = BUILDS[march]
    flags = set(cpu_flags().split())
    if not needs <= flags:
        pytest.skip(f"this CPU cannot run a {march} build")
    if beyond not in flags:
        pytest.skip(f"this machine's own build is no richer than {march}: its tests ran above")
    env = {**os.environ, "DSINFER_CPU_MARCH": march}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    cmd += ["-m", "not slow and not gpu", *files]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    summary = re.search(r"(\d+) passed", done.stdout)
    assert summary and int(summary.group(1)) >= 200, tail
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    # The kernels of this ISA ran (the native suite skips some of them): only the
    # AVX512-BF16/VNNI kernels' tests skipped.
    assert skips and all(BF16_VNNI_ONLY.search(line) for line in skips), skips

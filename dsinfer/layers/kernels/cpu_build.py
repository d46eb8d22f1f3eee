"""Build (once per machine, then cached) and load the fused CPU kernels of cpu_ops.cpp.

The library is compiled for this CPU (-march=native), so the cache key holds the torch
version, the source digest and the CPU's feature flags: another torch or another CPU gets its
own build instead of a library that would crash or run slowly. A failed build is reported once
with its reason; callers fall back to the reference kernels.

A compiled artifact may carry the built library (`dsinfer compile` copies it in, listed and
signed like the weights): `load_prebuilt` takes it instead of building when its target (torch
version, kernel sources, compiler flags, CPU feature set) is this machine's, so loading such an
artifact compiles nothing; otherwise the caller logs `target_mismatch`'s reason and the kernels
are built here as usual.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

from dsinfer.device import native_bf16_matmul

logger = logging.getLogger(__name__)
# One translation unit: the step program calls the kernels of cpu_ops.cpp as plain functions.
SOURCES = tuple(
    Path(__file__).with_name(n) for n in ("cpu_ops.cpp", "step_program.cpp", "step_program_mla.cpp")
)
# -fopenmp: at::parallel_for is a header template that parallelises only in code compiled
# with OpenMP; without it every kernel ran on one thread. Linked by soname, libgomp resolves
# to the copy torch has already loaded (one thread pool, not two).
# DSINFER_CPU_MARCH: the ISA to build for instead of this CPU's own ("haswell": AVX2 and FMA
# without AVX-512; "skylake-avx512": AVX-512 without BF16 and VNNI), so that one machine can
# build and test the kernels other CPUs run (tests/layers/test_other_isa_build.py). The kernels
# choose their paths at compile time (#if __AVX512F__ ...), so such a build takes that ISA's
# paths on any CPU that has it.
MARCH = os.environ.get("DSINFER_CPU_MARCH") or "native"
CFLAGS = ("-O3", f"-march={MARCH}", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)
_lock = threading.Lock()
_state: dict[str, str | bool] = {}


def cpu_flags() -> str:
    """The CPU's feature flags (the ISA the library is built for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()[:16]


def build_target() -> dict[str, str]:
    """What a built library is only valid for (an artifact's program records it)."""
    return {
        "torch": torch.__version__,
        "sources": _digest(*(source.read_bytes() for source in SOURCES)),
        "cflags": " ".join(CFLAGS + LDFLAGS),
        "cpu_flags": _digest(cpu_flags().encode()),
    }


_TARGET_NAMES = {
    "torch": "torch",
    "sources": "kernel sources (another dsinfer version)",
    "cflags": "compiler flags",
    "cpu_flags": "CPU feature set",
}


def target_mismatch(target: object) -> str | None:
    """Why a library built for `target` cannot run here, or None."""
    here = build_target()
    if not isinstance(target, dict):
        return "it records no build target"
    for key, name in _TARGET_NAMES.items():
        if target.get(key) != here[key]:
            return f"built for {name} {target.get(key)!r}, this machine has {here[key]!r}"
    return None


def build_key() -> str:
    h = hashlib.sha256()
    # torch's location too: two environments sharing the cache would otherwise rebuild each
    # other's build directory (ninja sees new include paths).
    for part in (
        *(source.read_bytes() for source in SOURCES),
        torch.__version__.encode(),
        torch.__file__.encode(),
        " ".join(CFLAGS + LDFLAGS).encode(),
    ):
        h.update(part)
    h.update(cpu_flags().encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    root = os.environ.get("DSINFER_KERNEL_CACHE") or Path.home() / ".cache" / "dsinfer" / "kernels"
    return Path(root) / f"cpu-{build_key()}"


def load_cpu_ops() -> str | None:
    """Load (building if needed) the kernels into torch.ops.dsinfer; None, or why not."""
    with _lock:
        if "error" in _state:
            return _state["error"] or None  # type: ignore[return-value]
        _state["error"] = _load() or ""
        return _state["error"] or None  # type: ignore[return-value]


def loaded_library() -> Path | None:
    """The library file the kernels of this process were loaded from (None: not loaded)."""
    path = _state.get("path")
    return Path(path) if isinstance(path, str) and path else None


def load_prebuilt(path: Path, target: object) -> str | None:
    """Load a library built elsewhere (an artifact's) instead of building; None when the
    kernels of this process now come from it, else why not (they are built as usual)."""
    with _lock:
        if why_not := target_mismatch(target):
            return why_not
        if kernels_loaded():
            return f"the kernels were already loaded in this process from {loaded_library()}"
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as e:
            return f"it does not load here ({type(e).__name__}: {str(e)[-200:]})"
        _state["error"], _state["path"] = "", str(path)
        _tell_the_library_this_cpu()
        return None


def kernels_loaded() -> bool:
    """Whether this process has the kernels already (built, cached or an artifact's)."""
    return hasattr(torch.ops, "dsinfer") and hasattr(torch.ops.dsinfer, "rope_decode_attention")


def _load() -> str | None:
    if kernels_loaded():
        return None
    try:
        from torch.utils.cpp_extension import load_inline
    except ImportError as e:  # pragma: no cover - torch always ships it
        return f"torch.utils.cpp_extension unavailable: {e}"
    out = cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    name = f"dsinfer_cpu_ops_{out.name.replace('-', '_')}"
    built = (out / f"{name}.so").exists()
    if not built:
        logger.info("building the fused CPU kernels into %s (once per machine and torch)", out)
    t0 = time.perf_counter()
    try:
        load_inline(
            name,
            cpp_sources=[source.read_text() for source in SOURCES],
            is_python_module=False,
            build_directory=str(out),
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any compiler or loader failure means "fall back"
        reason = f"building the fused CPU kernels failed ({type(e).__name__}: {str(e)[-300:]})"
        logger.warning("%s", reason)
        return reason
    if not built:
        logger.info("fused CPU kernels built in %.1fs", time.perf_counter() - t0)
    _state["path"] = str(out / f"{name}.so")
    _tell_the_library_this_cpu()
    return None


def _tell_the_library_this_cpu() -> None:
    """What the library cannot take from its compile flags: whether torch's bf16 GEMM is
    native on this CPU (its step program picks int8_mm's kernels by it, as quant.py does)."""
    torch.ops.dsinfer.set_native_bf16_gemm(native_bf16_matmul(torch.device("cpu")))


def main() -> int:
    """`make install` builds the kernels once, ahead of the first serve."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    error = load_cpu_ops()
    print(error or f"fused CPU kernels ready in {cache_dir()}")
    return 0  # a failed build is not an install failure: the engine falls back and says so

"""Build (once per machine, then cached) and load the fused CPU kernels of cpu_ops.cpp.

The library is compiled for this CPU (-march=native), so the cache key holds the torch
version, the source digest and the CPU's feature flags: another torch or another CPU gets its
own build instead of a library that would crash or run slowly. A failed build is reported once
with its reason; callers fall back to the reference kernels.
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

logger = logging.getLogger(__name__)
# One translation unit: the step program calls the kernels of cpu_ops.cpp as plain functions.
SOURCES = tuple(Path(__file__).with_name(n) for n in ("cpu_ops.cpp", "step_program.cpp"))
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno")
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


def build_key() -> str:
    h = hashlib.sha256()
    # torch's location too: two environments sharing the cache would otherwise rebuild each
    # other's build directory (ninja sees new include paths).
    for part in (
        *(source.read_bytes() for source in SOURCES),
        torch.__version__.encode(),
        torch.__file__.encode(),
        " ".join(CFLAGS).encode(),
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


def _load() -> str | None:
    if hasattr(torch.ops, "dsinfer") and hasattr(torch.ops.dsinfer, "rope_decode_attention"):
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
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any compiler or loader failure means "fall back"
        reason = f"building the fused CPU kernels failed ({type(e).__name__}: {str(e)[-300:]})"
        logger.warning("%s", reason)
        return reason
    if not built:
        logger.info("fused CPU kernels built in %.1fs", time.perf_counter() - t0)
    return None


def main() -> int:
    """`make install` builds the kernels once, ahead of the first serve."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    error = load_cpu_ops()
    print(error or f"fused CPU kernels ready in {cache_dir()}")
    return 0  # a failed build is not an install failure: the engine falls back and says so

"""The only module that knows which accelerators exist (cpu, cuda, npu via torch_npu)."""

from __future__ import annotations

import importlib.util
import os

import torch


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def resolve_device(name: str = "cpu") -> torch.device:
    """Map "auto" | "cpu" | "cuda[:i]" | "npu[:i]" to a torch.device, failing clearly if absent."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _npu_available():
            return torch.device("npu")
        return torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is visible; use --device cpu")
    if dev.type == "npu" and not _npu_available():
        raise ValueError("device 'npu' requested but torch_npu is missing or sees no NPU")
    if dev.type not in ("cpu", "cuda", "npu"):
        raise ValueError(f"unsupported device {name!r}; choose auto, cpu, cuda or npu")
    return dev


def native_bf16_matmul(device: torch.device) -> bool:
    """Whether bf16 GEMMs run at the hardware's rate here: accelerators, and CPUs with
    AVX512-BF16 or AMX. Elsewhere (AVX2 CPUs) torch emulates them at ~1 GFLOP/s (fp32: 70-95
    on a 2-core Zen 2)."""
    if device.type != "cpu":
        return True
    cpu = torch.cpu
    return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())


# torch's grouped GEMM: the public `F.grouped_mm` where this torch has it, else the private
# `torch._grouped_mm` of the releases before (same arguments); None where torch has neither.
grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_in_graphs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM (`F.grouped_mm`: every routed expert in one call, the
    groups' ends in a device tensor) runs here without reading those ends back to the host,
    so that a captured step graph can hold it: CUDA's kernel, bf16, compute capability 9.0 and
    later. Elsewhere torch loops over the groups on the host (a sync at every call)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return grouped_mm is not None and torch.cuda.get_device_capability(device) >= (9, 0)


def tinygemm_unavailable(device: torch.device) -> str | None:
    """Why torch's int4 tensor-core GEMM (`_weight_int4pack_mm`, "tinygemm": int4 weights in
    groups with a scale and zero each, bf16 activations) cannot run on `device`, or None: it is
    CUDA's kernel, built for compute capability 8.0 (Ampere) and later."""
    if device.type != "cuda":
        return f"torch has no int4 tensor-core kernel for {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 0):
        return f"compute capability {capability[0]}.{capability[1]} (the kernel needs 8.0)"
    return None


def total_memory(device: torch.device) -> int:
    """Bytes of memory the device has in all: the host's RAM for the CPU, the card's for an
    accelerator. A figure that is the same on every rank of one kind of machine (unlike what is
    free now), so a budget derived from it gives every rank the same KV block count."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "npu":
        return int(torch.npu.get_device_properties(device).total_memory)  # type: ignore[attr-defined]
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


def distributed_backend(device: torch.device) -> str:
    """torch.distributed's backend for ranks on this kind of device: gloo on CPU, NCCL on CUDA
    GPUs, HCCL on Ascend NPUs (registered by torch_npu)."""
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device.type]


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device a rank with this index on its node runs on (one accelerator per rank), made
    current so collectives and new tensors use it."""
    if device.type == "cpu":
        return device
    dev = torch.device(device.type, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.npu.set_device(dev)  # type: ignore[attr-defined]
    return dev


def memory_stats(device: torch.device) -> dict[str, float] | None:
    """The accelerator's own memory counters (bytes: allocated, reserved by the caching
    allocator, peak allocated) — None on CPU, whose memory the process collector reports."""
    if device.type == "cuda":
        mod = torch.cuda
    elif device.type == "npu":
        mod = torch.npu  # type: ignore[attr-defined]  # added by torch_npu
    else:
        return None
    return {
        "allocated": float(mod.memory_allocated(device)),
        "reserved": float(mod.memory_reserved(device)),
        "peak_allocated": float(mod.max_memory_allocated(device)),
    }

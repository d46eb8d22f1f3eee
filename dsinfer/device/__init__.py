"""The only module that knows which accelerators exist (cpu, cuda, npu via torch_npu)."""

from __future__ import annotations

import importlib.util

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


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]

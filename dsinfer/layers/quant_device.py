"""Quantised weights on accelerators (CUDA, Ascend NPU): int8 and int4 artifacts served there.

The methods here declare the same tensors as quant.py's CPU methods (torch's CPU int4pack
bytes with scales and zeros [in / G, out, 2]; int8 [out, in] with per-row scales), so one
artifact serves on every device. After loading, `use_kernels` turns the stored bytes into the
layout of the kernel this device has, once:

- int4 on CUDA (compute capability ≥ 8.0, bf16 activations): torch's tensor-core int4 GEMM
  (`_weight_int4pack_mm`, "tinygemm"). Its arithmetic is the CPU kernel's, (q − 8) · scale +
  zero per group, and it takes our scales and zeros as they are; the codes are repacked into
  its tiles. Before the first layer is repacked, a probe runs the kernel on a small weight
  against the portable path below: a kernel that fails or disagrees is not used, with the
  reason logged (int4 on CUDA stays correct where the kernel would not be).
- int4 elsewhere (NPU; CUDA without that kernel or for a shape it does not take): the
  portable path. The codes stay two to a byte and are widened to the activations' dtype for
  one GEMM per call: a quarter of fp32's memory, but a decode step reads each weight ~3
  times (codes, widened copy written and read) instead of once.
- int8: the weight widened per call for one GEMM with the scales after it (same memory
  trade-off). It serves the LM head of int4 artifacts and int8 artifacts.

Steps through these methods may be captured as CUDA graphs: nothing reads back to the host.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from dsinfer.device import tinygemm_unavailable
from dsinfer.layers.int4_pack import int4pack_codes
from dsinfer.layers.kernels import Kernels
from dsinfer.layers.linear import ProgramOperand
from dsinfer.layers.quant import (
    Int4ExpertsMethod,
    Int4LinearMethod,
    Int8ExpertsMethod,
    Int8LinearMethod,
    _finish,
    _rows,
    register_method,
)

logger = logging.getLogger(__name__)
DEVICE_TYPES = ("cuda", "npu")
TINYGEMM_GROUP_SIZES = (32, 64, 128, 256)
# The probe's bound on |tinygemm − portable| / max |portable|: both round the product of bf16
# activations and bf16-exact weights in fp32, so they differ by accumulation order only.
_PROBE_REL_TOL = 1e-2


# -- int4 layouts -------------------------------------------------------------------------------


def nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., K] (0..15) → bytes [..., K / 2]: byte j holds code 2j in its low nibble and
    2j + 1 in its high one (the portable path's storage)."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def codes_of_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `nibbles`: bytes [..., K / 2] → codes [..., K] (uint8)."""
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)  # [..., K/2, 2]
    return pairs.flatten(-2)


def widen_int4(
    packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Portable int4 bytes [O, K / 2] with scales/zeros [K / G, O, 2] → the weight [O, K] in
    `dtype`: (q − 8) · scale + zero, computed in fp32 and rounded once."""
    codes = codes_of_nibbles(packed)  # [O, K]
    o, k = codes.shape
    q = codes.view(o, k // group_size, group_size).float() - 8.0  # [O, groups, G]
    sz = scales_zeros.float().transpose(0, 1)  # [O, groups, 2]
    w = q * sz[..., :1] + sz[..., 1:]
    return w.view(o, k).to(dtype)


def tinygemm_inner_k_tiles(in_features: int) -> int | None:
    """The kernel's K tiling for `in` (the widest it takes), or None where `in` fits none."""
    for tiles in (8, 4, 2):
        if in_features % (16 * tiles) == 0:
            return tiles
    return None


def tinygemm_shape_unsupported(out_features: int, in_features: int, group_size: int) -> str | None:
    """Why tinygemm cannot take this weight's shape, or None."""
    if group_size not in TINYGEMM_GROUP_SIZES:
        return f"group size {group_size} (the kernel takes {TINYGEMM_GROUP_SIZES})"
    if out_features % 8:
        return f"out_features {out_features} is not a multiple of 8"
    if tinygemm_inner_k_tiles(in_features) is None:
        return f"in_features {in_features} is not a multiple of 32"
    return None


def tinygemm_pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes [O, K] on the device → tinygemm's tiles. Its input is [O, K / 2] bytes with code
    2j in the high nibble of byte j and 2j + 1 in the low one (torch ≥ 2.5)."""
    c = codes.to(torch.uint8)
    packed = (c[:, 0::2] << 4) | c[:, 1::2]
    tiles = tinygemm_inner_k_tiles(codes.shape[1])
    assert tiles is not None, "checked by tinygemm_shape_unsupported"
    return torch._convert_weight_to_int4pack(packed.contiguous(), tiles)


@functools.cache
def tinygemm_refused(device: torch.device) -> str | None:
    """Why int4 layers on `device` take the portable path instead of tinygemm, or None: the
    device has no such kernel, or the kernel, run once on a small random weight, fails or
    disagrees with the portable path."""
    why = tinygemm_unavailable(device)
    if why is not None:
        return why
    g = torch.Generator().manual_seed(0)
    o, k, group = 64, 256, 32
    codes = torch.randint(0, 16, (o, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(k // group, o, generator=g) * 0.02 + 0.001
    zeros = torch.randn(k // group, o, generator=g) * 0.01
    sz = torch.stack((scales, zeros), dim=-1).bfloat16()
    x = torch.randn(3, k, generator=g).bfloat16()
    want = x.float() @ widen_int4(nibbles(codes), sz, group, torch.bfloat16).float().t()
    try:
        got = torch._weight_int4pack_mm(
            x.to(device), tinygemm_pack(codes.to(device)), group, sz.to(device)
        )
        err = ((got.float().cpu() - want).abs().max() / want.abs().max()).item()
    except (RuntimeError, NotImplementedError) as e:  # a torch built without the kernel
        return f"tinygemm failed on {device}: {str(e).splitlines()[0]}"
    if not err <= _PROBE_REL_TOL:
        return f"tinygemm disagreed with the portable path on {device} (relative error {err:.3g})"
    return None


class _Int4OnDevice:
    """One int4 weight [O, K] prepared for this device's kernel: tinygemm tiles, or the
    portable bytes. Shared by the Linear and the experts' methods (one per expert)."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.kernel: str | None = None  # "tinygemm" | "portable", once prepared

    def choose(self, device: torch.device, dtype: torch.dtype, out_f: int, in_f: int) -> str:
        """The kernel for a weight of this shape whose activations are `dtype`; logged once per
        reason when it is the portable one."""
        why = tinygemm_refused(device)
        if why is None and dtype != torch.bfloat16:
            why = f"{dtype} activations (the kernel takes bfloat16)"
        if why is None:
            why = tinygemm_shape_unsupported(out_f, in_f, self.group_size)
        if why is None:
            return "tinygemm"
        _log_portable(device.type, why)
        return "portable"

    def prepare(
        self, cpu_packed: torch.Tensor, sz: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored bytes (torch's CPU int4pack, on the device) and scales/zeros → this kernel's
        tensors; scales/zeros stay [K / G, O, 2] for both."""
        codes = int4pack_codes(cpu_packed)  # [O, K]
        q = tinygemm_pack(codes) if self.kernel == "tinygemm" else nibbles(codes)
        return q, sz.contiguous()

    def mm(self, flat: torch.Tensor, q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """[M, K] activations → [M, O] in their dtype."""
        if self.kernel == "tinygemm":
            return torch._weight_int4pack_mm(flat, q, self.group_size, sz)
        return flat @ widen_int4(q, sz, self.group_size, flat.dtype).t()


@functools.cache
def _log_portable(device_type: str, why: str) -> None:
    logger.info("int4 weights on %s: the portable kernel (%s)", device_type, why)


def _activation_dtype(scales: torch.Tensor) -> torch.dtype:
    """The activations' dtype of a quantised layer: its scales are stored in it."""
    return scales.dtype


class DeviceInt4LinearMethod(Int4LinearMethod):
    """Int4LinearMethod's tensors, multiplied by this device's kernel (module docstring)."""

    def __init__(self, group_size: int) -> None:
        super().__init__(group_size)
        self.weight = _Int4OnDevice(group_size)

    def use_kernels(self, layer: nn.Module, kernels: Kernels, device_type: str) -> None:  # noqa: ARG002
        if self.weight.kernel is not None:
            return  # prepared already: the stored bytes are gone
        qweight, sz = layer.qweight.data, layer.scales_zeros.data
        self.weight.kernel = self.weight.choose(
            qweight.device, _activation_dtype(sz), layer.out_features, layer.in_features
        )
        q, sz = self.weight.prepare(qweight, sz)
        layer.qweight = nn.Parameter(q, requires_grad=False)
        layer.scales_zeros = nn.Parameter(sz, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.weight.mm(_rows(x), layer.qweight, layer.scales_zeros)
        return _finish(y, x, bias)

    def program_operand(self, layer: nn.Module) -> ProgramOperand | None:
        return None  # the CPU's step program only


class DeviceInt4ExpertsMethod(Int4ExpertsMethod):
    """Int4ExpertsMethod's stacks, each expert multiplied by this device's int4 kernel."""

    def __init__(self, group_size: int) -> None:
        super().__init__(group_size)
        self.weights = {w: _Int4OnDevice(group_size) for w in ("13", "2")}

    def use_kernels(self, experts: nn.Module, kernels: Kernels, device_type: str) -> None:  # noqa: ARG002
        two_i, h = 2 * experts.intermediate, experts.hidden
        for which, (out_f, in_f) in (("13", (two_i, h)), ("2", (h, two_i // 2))):
            weight = self.weights[which]
            if weight.kernel is not None:
                continue
            q, sz = getattr(experts, f"q{which}").data, getattr(experts, f"sz{which}").data
            weight.kernel = weight.choose(q.device, _activation_dtype(sz), out_f, in_f)
            parts = [weight.prepare(q[e], sz[e]) for e in range(q.shape[0])]
            for name, i in ((f"q{which}", 0), (f"sz{which}", 1)):
                stacked = torch.stack([p[i] for p in parts])
                setattr(experts, name, nn.Parameter(stacked, requires_grad=False))

    def matmul(self, experts: nn.Module, x: torch.Tensor, which: str, e: int) -> torch.Tensor:
        q, sz = getattr(experts, f"q{which}")[e], getattr(experts, f"sz{which}")[e]
        return self.weights[which].mm(x.contiguous(), q, sz)

    def program_operand(self, experts: nn.Module, which: str, e: int) -> ProgramOperand | None:
        return None


def _int8_mm(flat: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[M, K] × int8 [O, K] with per-row scales [O] → [M, O]: the weight widened for one GEMM
    in the activations' dtype (int8 values are exact there), the scales after it."""
    return (flat @ qweight.to(flat.dtype).t()) * scales.to(flat.dtype)


class DeviceInt8LinearMethod(Int8LinearMethod):
    """Int8LinearMethod's tensors, widened per call (module docstring)."""

    def use_kernels(self, layer: nn.Module, kernels: Kernels, device_type: str) -> None:
        """Nothing to prepare: the stored layout is the one `apply` reads."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _finish(_int8_mm(_rows(x), layer.qweight, layer.scales), x, bias)


class DeviceInt8ExpertsMethod(Int8ExpertsMethod):
    """Int8ExpertsMethod's stacks, each expert widened per call."""

    def use_kernels(self, experts: nn.Module, kernels: Kernels, device_type: str) -> None:
        """Nothing to prepare."""

    def matmul(self, experts: nn.Module, x: torch.Tensor, which: str, e: int) -> torch.Tensor:
        q, scales = getattr(experts, f"q{which}")[e], getattr(experts, f"s{which}")[e]
        return _int8_mm(x.contiguous(), q, scales)

    def program_operand(self, experts: nn.Module, which: str, e: int) -> ProgramOperand | None:
        return None


for _device in DEVICE_TYPES:
    register_method("int4", _device)(DeviceInt4LinearMethod)
    register_method("int4", _device)(DeviceInt4ExpertsMethod)
    register_method("int8", _device)(DeviceInt8LinearMethod)
    register_method("int8", _device)(DeviceInt8ExpertsMethod)

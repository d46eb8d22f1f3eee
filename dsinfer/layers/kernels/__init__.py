"""Kernel sets: the small per-token ops (norms, gated activation) a backend runs them with,
and the arithmetic its quantised matmuls use (int8 activations or not).

`reference` is plain torch and the oracle of every test; `fused` calls the C++ kernels of
cpu_ops.cpp on the CPU (built once per machine by cpu_build), and on an accelerator torch's own
fused kernels where it has them (FUSED_ACCELERATOR). Layers hold a kernel set and are switched
after loading by `dsinfer.layers.backend.apply_backend`; models never name one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class Kernels:
    name: str
    # (x [T, H], weight [H], eps) → weight · x / rms(x)
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual, weight, eps) → (rms_norm(x + residual), x + residual)
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    # [T, 2I] laid out [gate | up] → silu(gate) · up: [T, I]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # Which int4 layers (and, on AVX-512, narrow int8 ones) meet activations rounded to int8 per
    # group of 32 (llama.cpp's arithmetic; layers/quant.py): none, out_proj (the blocks' output
    # projections, whose inputs are not an RMSNorm's output) or all (--int8-activations).
    int8_activations: str = "none"

    def int8_for(self, output_projection: bool) -> bool:
        """Whether a layer (a block's output projection or not) takes int8 activations."""
        return self.int8_activations == "all" or (
            self.int8_activations == "out_proj" and output_projection
        )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32 whatever the activation dtype, as the reference models do.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return _rms_norm(x, weight, eps), x


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


REFERENCE = Kernels("reference", _rms_norm, _add_rms_norm, _silu_and_mul)


def _fusable(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """What the C++ kernels take: contiguous 2-D CPU fp32/bf16 rows, all of one dtype."""
    return (
        x.dim() == 2
        and x.is_contiguous()
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and all(o.dtype == x.dtype and o.is_contiguous() for o in others)
    )


def _fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _fusable(x, weight):
        return _rms_norm(x, weight, eps)
    return torch.ops.dsinfer.rms_norm(x, weight, eps)


def _fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if not _fusable(x, residual, weight) or x.shape != residual.shape:
        return _add_rms_norm(x, residual, weight, eps)
    return torch.ops.dsinfer.add_rms_norm(x, residual, weight, eps)


def _fused_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not _fusable(x):
        return _silu_and_mul(x)
    return torch.ops.dsinfer.silu_mul(x)


FUSED_CPU = Kernels("fused", _fused_rms_norm, _fused_add_rms_norm, _fused_silu_and_mul)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's RMSNorm: one fused kernel on CUDA (aten::_fused_rms_norm) where the reference's
    # spelled-out norm is six (cast, square, mean, rsqrt, scale, weight); statistics in fp32
    # either way, the output rounded once instead of twice (within one bf16 ulp of it).
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _torch_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return _torch_rms_norm(x, weight, eps), x


# The fused backend's set off the CPU (no C++ kernels there): in a CUDA decode step each norm
# is one kernel of a graph, not six (not yet measured on a GPU).
FUSED_ACCELERATOR = Kernels("fused", _torch_rms_norm, _torch_add_rms_norm, _silu_and_mul)

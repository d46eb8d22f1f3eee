"""Rotary position embedding (NeoX half-split layout) with default, linear and llama3 scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from dsinfer.config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "default":
        return inv
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "yarn":
        return _yarn_inverse_frequencies(head_dim, rope)
    if rope.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        old = rope.original_max_position
        low_wl, high_wl = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, blended, scaled)
    raise ValueError(
        f"unsupported rope_scaling type {rope.kind!r}; supported: default, linear, llama3, yarn"
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(rope: RopeConfig) -> float:
    """YaRN's multiplier on cos/sin (1 for every other kind)."""
    if rope.kind != "yarn":
        return 1.0
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def _yarn_inverse_frequencies(dim: int, rope: RopeConfig) -> torch.Tensor:
    """Interpolate long wavelengths by `factor`, keep short ones, ramp linearly between the
    dimensions that rotate beta_fast and beta_slow times over the original context."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    pos = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return (1.0 / (rope.factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate


@dataclass(frozen=True, slots=True)
class StepRope:
    """Rotary tables for one step, computed once and shared by every layer.

    `cos`/`sin` are the rows of this step's positions in the activation dtype ([T, 1, D], what
    the reference applies); `table_cos`/`table_sin` are the whole fp32 tables ([P, D]) for
    kernels that rotate inside attention and index them by position themselves."""

    cos: torch.Tensor
    sin: torch.Tensor
    table_cos: torch.Tensor
    table_sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig) -> None:
        super().__init__()
        # Computed on the CPU, then moved where the model is built: under a meta-device build
        # (the planner's parameter counts) this arithmetic would go through torch's reference
        # decompositions, which import torch._dynamo and triton (~65 MB resident, seconds).
        with torch.device("cpu"):
            inv = inverse_frequencies(head_dim, rope)
            t = torch.arange(max_position, dtype=torch.float32)
            freqs = torch.outer(t, inv)  # [P, D/2]
            emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
            scale = attention_factor(rope)
            cos, sin = emb.cos() * scale, emb.sin() * scale
        target = torch.get_default_device()
        self.register_buffer("cos", cos.to(target), persistent=False)
        self.register_buffer("sin", sin.to(target), persistent=False)
        self.head_dim = head_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRope:
        """Tables for one step, computed once and shared by every layer."""
        return StepRope(
            self.cos[positions].unsqueeze(1).to(dtype),  # [T, 1, D]
            self.sin[positions].unsqueeze(1).to(dtype),
            self.cos,
            self.sin,
        )


def deinterleave_pairs(x: torch.Tensor) -> torch.Tensor:
    """[..., D] with pairs (2j, 2j+1) → [..., D] as (evens | odds): NeoX layout (DeepSeek's
    checkpoints store the rope part of q and k interleaved)."""
    d = x.shape[-1]
    return x.unflatten(-1, (d // 2, 2)).transpose(-1, -2).reshape(x.shape)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (q and k heads may be stacked together) → rotated, same shape."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

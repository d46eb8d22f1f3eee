"""Rotary position embedding (NeoX half-split layout) with default, linear and llama3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from dsinfer.config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "default":
        return inv
    if rope.kind == "linear":
        return inv / rope.factor
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
        f"unsupported rope_scaling type {rope.kind!r}; supported: default, linear, llama3"
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig) -> None:
        super().__init__()
        inv = inverse_frequencies(head_dim, rope)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.head_dim = head_dim

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for one step, computed once and shared by every layer: [T, 1, D] each."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (q and k heads may be stacked together) → rotated, same shape."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

"""The attention seam: per-step metadata (built once, used by every layer) and the backend ABC."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """A sequence computing more than one token this step.

    Its queries are rows [q_start, q_start+q_len) of the flat batch; it attends to `ctx_len`
    cached tokens whose cache slots are `slots`; `start_pos` = ctx_len - q_len tokens came before.
    """

    q_start: int
    q_len: int
    ctx_len: int
    slots: torch.Tensor  # [ctx_len] int64


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Flat batch layout: the first `num_decode` rows are single-token decodes, then prefills."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    num_decode: int
    # Decodes gather whole blocks (one memcpy each) rather than single slots.
    decode_block_tables: torch.Tensor | None  # [B, NBmax] int64, padded with block 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, NBmax * block_size] bool, True = padding
    prefills: tuple[PrefillSeq, ...]


class AttentionBackend(abc.ABC):
    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KV, D] → [T, H, D]; writes k/v into the cache first."""

"""The attention seam: per-step metadata (built once, used by every layer) and the backend ABC.

Paged KV layout (MHA): per layer, K and V are each [num_blocks, num_kv_heads, block_size, D].
Heads sit outside the token axis inside a block so that a gathered block is already a
[KV, block_size, D] matrix per head: decode attention multiplies it without a transpose copy.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """A sequence computing more than one token this step.

    Its queries are rows [q_start, q_start+q_len) of the flat batch; it attends to `ctx_len`
    tokens held in `block_table`; ctx_len - q_len of them were cached before this step.
    """

    q_start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor  # [ceil(ctx_len / block_size)] int64


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Flat batch layout: the first `num_decode` rows are single-token decodes, then prefills."""

    slot_blocks: torch.Tensor  # [T] int64: block of each new token's K/V
    slot_offsets: torch.Tensor  # [T] int64: its offset inside that block
    num_decode: int
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

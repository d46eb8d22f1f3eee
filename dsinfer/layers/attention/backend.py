"""The attention seam: per-step metadata (built once, used by every layer) and the backend ABC.

Paged KV layout (MHA): per layer, K and V are each [num_blocks, num_kv_heads, block_size, D].
Heads sit outside the token axis inside a block so that a gathered block is already a
[KV, block_size, D] matrix per head: decode attention multiplies it without a transpose copy.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dsinfer.layers.rotary import StepRope


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
    decode_seq_lens: torch.Tensor | None = None  # [B] int64: tokens cached after this step

    def without_decodes(self) -> AttentionMetadata:
        """The same step less its decode rows (rows renumbered from 0): for a backend that
        runs the decodes itself and hands the prefill chunks to another."""
        nd = self.num_decode
        return dataclasses.replace(
            self,
            slot_blocks=self.slot_blocks[nd:],
            slot_offsets=self.slot_offsets[nd:],
            num_decode=0,
            decode_block_tables=None,
            decode_mask=None,
            decode_seq_lens=None,
            prefills=tuple(dataclasses.replace(p, q_start=p.q_start - nd) for p in self.prefills),
        )


class AttentionBackend(abc.ABC):
    """One attention kind on one device, built from the shape a model asks for.

    Backends are registered by (backend name, device type, kind) in registry.py; a model asks
    for a kind and the selected backend (`rebuilt`) replaces the reference after loading."""

    kind: ClassVar[str]
    # Whether its decode rows can be recorded into a step graph (worker/decode_graphs.py):
    # fixed shapes for fixed metadata shapes, no host syncs, no Python branching on data.
    graph_safe_decode: ClassVar[bool] = False

    def __init__(self, **shape: Any) -> None:
        self.shape = shape

    def rebuilt(self, backend: str, device_type: str) -> AttentionBackend:
        """This attention's shape on another backend (itself when that backend has no
        implementation of its kind for the device)."""
        from dsinfer.layers.attention.registry import attention_class

        cls = attention_class(backend, device_type, self.kind)
        return self if cls is type(self) else cls(**self.shape)


class MHABackend(AttentionBackend):
    kind = "mha"
    # Whether a decode-step program (layers/step_program.py) may stand in for this backend's
    # decode rows: its kernel is the program's (rotary + KV write + paged attention in one).
    step_program_kernel: ClassVar[bool] = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale
        )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abc.abstractmethod
    def forward_qkv(
        self,
        qkv: torch.Tensor,
        rope: StepRope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """qkv [T, (H + 2KV)·D] before rotary, rope: the step's StepRope → [T, H·D]; writes
        this step's keys and values into the cache."""

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

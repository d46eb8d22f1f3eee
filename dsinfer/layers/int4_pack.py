"""torch's packed int4 layout for its CPU kernels: reading it, writing it, and converting an
artifact's int4 bytes to the layout this process's torch packs.

torch packs int4 weights by its CPU capability: AVX-512 builds write, per block of 64 output
rows and per input k, 32 bytes (byte j: output j in the low nibble, 32 + j in the high); AVX2
and scalar builds use 32- and 16-row blocks. A packed tensor is right only for a process whose
torch packs the same way (measured: AVX-512 bytes under ATEN_CPU_CAPABILITY=avx2 give a
relative error of 1.5). Artifacts record the layout they were packed in (`int4_pack_layout`);
a process that packs otherwise converts them at load (`int4_to_this_layout`). Our repacking
for the fused int4 kernels reads 64- and 32-row blocks (`int4_block_rows`); the widening of
torch's own layout for a dense GEMM, 64-row blocks only.
"""

from __future__ import annotations

import functools

import torch

# The layout of AVX-512 builds: what this project's machines write and our kernels read.
BLOCKS64 = "torch-cpu-blocks64"


# The layout of AVX2 builds: the same scheme in blocks of 32 rows (named by torch's capability,
# as artifacts compiled on such machines record it).
BLOCKS32 = "torch-cpu-avx2"
_BLOCK_ROWS = {BLOCKS64: 64, BLOCKS32: 32}


def pack_blocks(codes: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """Codes [..., O, K] (0..15, O a multiple of 16) → torch's bytes in blocks of `rows` output
    rows [..., O, K / 2]: per block and input k, rows / 2 bytes, byte j holding output j in the
    low nibble and rows / 2 + j in the high one. The last O mod `rows` outputs (a tail) are
    laid out per input k too, byte j holding tail outputs 2j and 2j + 1 (measured against
    torch's packing, both layouts, every O to 1,024)."""
    *lead, o, k = codes.shape
    full = o - o % rows
    c = codes.to(torch.uint8)
    blocks = c[..., :full, :].reshape(*lead, full // rows, rows, k)  # [..., O/rows, rows, K]
    half = rows // 2
    # Rows j and half + j share a byte; merged while K is still the contiguous dim, then one
    # transposing copy (merging after the transpose ran ~3× slower: strided byte ops).
    merged = blocks[..., :half, :] | (blocks[..., half:, :] << 4)  # [..., O/rows, half, K]
    packed = merged.transpose(-1, -2).contiguous().reshape(*lead, full, k // 2)
    if full == o:
        return packed
    tail = c[..., full:, :].transpose(-1, -2)  # [..., K, tail rows]
    pairs = tail[..., 0::2] | (tail[..., 1::2] << 4)  # [..., K, tail / 2]
    return torch.cat([packed, pairs.reshape(*lead, o - full, k // 2)], dim=-2)


def unpack_blocks(packed: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """The inverse of `pack_blocks`: [..., O, K / 2] → codes [..., O, K] (uint8)."""
    *lead, o, half = packed.shape
    if o % 16:
        raise ValueError(
            f"an int4 weight of {o} output rows (not a multiple of 16) is not torch's int4pack"
        )
    k = 2 * half
    full = o - o % rows
    blocks = packed[..., :full, :].reshape(*lead, full // rows, k, rows // 2)
    codes = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)  # [..., O/rows, K, rows]
    codes = codes.transpose(-1, -2).reshape(*lead, full, k)
    if full == o:
        return codes
    pairs = packed[..., full:, :].reshape(*lead, k, (o - full) // 2)  # [..., K, tail / 2]
    tail = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).reshape(*lead, k, o - full)
    return torch.cat([codes, tail.transpose(-1, -2)], dim=-2)


def pack_blocks64(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., O, K] → the 64-row-block bytes [..., O, K / 2] (O a multiple of 64)."""
    return pack_blocks(codes, 64)


def unpack_blocks64(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_blocks64`."""
    return unpack_blocks(packed, 64)


@functools.cache
def int4_pack_layout() -> str:
    """How this process's torch packs int4 weights: BLOCKS64, or its CPU capability's name
    (BLOCKS32 on AVX2 builds)."""
    probe = (torch.arange(128 * 64) * 7 % 16).view(128, 64)
    packed = torch._convert_weight_to_int4pack_for_cpu(probe.int(), 1)
    if torch.equal(packed, pack_blocks(probe, 64)):
        return BLOCKS64
    name = f"torch-cpu-{torch.backends.cpu.get_cpu_capability().lower()}"
    if name == BLOCKS32 and not torch.equal(packed, pack_blocks(probe, 32)):
        return name + "-unknown"  # a torch that packs AVX2 otherwise: never read as blocks32
    return name


def int4_block_rows() -> int | None:
    """The rows of the blocks this process's torch packs int4 weights in, where we can read
    them (our repacking, tensor-parallel cuts): 64 (AVX-512 builds) or 32 (AVX2); else None."""
    return _BLOCK_ROWS.get(int4_pack_layout())


def int4pack_codes(packed: torch.Tensor) -> torch.Tensor:
    """This process's torch int4pack [..., O, K / 2] → the codes [..., O, K] (uint8, 0..15), for
    a tensor-parallel cut (taken on the codes, then packed again by `int4pack_from_codes`)."""
    rows = int4_block_rows()
    if rows is None:
        raise ValueError(
            "tensor-parallel cuts of int4 weights read torch's 64- or 32-row blocks (AVX-512 "
            f"and AVX2 builds); this torch packs {int4_pack_layout()}: serve in one process, "
            "or compile int8"
        )
    return unpack_blocks(packed, rows)


def int4pack_from_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., O, K] → this process's torch int4pack [..., O, K / 2] (any O): the whole
    stack in one pass where we know the layout (what torch's op writes, `int4_pack_layout`
    checks), else torch's op one matrix at a time (~5 ms per expert of DeepSeek-V2-Lite, 16 s
    over its 4,992 expert matrices)."""
    rows = int4_block_rows()
    if rows is not None:
        return pack_blocks(codes, rows).contiguous()
    *lead, o, k = codes.shape
    flat = codes.reshape(-1, o, k).to(torch.int32)
    packed = [torch._convert_weight_to_int4pack_for_cpu(c.contiguous(), 1) for c in flat]
    return torch.stack(packed).reshape(*lead, o, k // 2)


def int4_to_this_layout(packed: torch.Tensor, layout: str) -> torch.Tensor:
    """An artifact's packed int4 tensor, written in `layout`, in this process's layout."""
    here = int4_pack_layout()
    if layout == here:
        return packed
    if layout not in _BLOCK_ROWS:
        raise ValueError(
            f"int4 weights packed as {layout} cannot be read by this torch ({here}): compile "
            "the artifact on this machine"
        )
    return int4pack_from_codes(unpack_blocks(packed, _BLOCK_ROWS[layout]))

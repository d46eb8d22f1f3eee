"""torch's packed int4 layout for its CPU kernels: reading it, writing it, and converting an
artifact's int4 bytes to the layout this process's torch packs.

torch packs int4 weights by its CPU capability: AVX-512 builds write, per block of 64 output
rows and per input k, 32 bytes (byte j: output j in the low nibble, 32 + j in the high); AVX2
and scalar builds use 32- and 16-row blocks. A packed tensor is right only for a process whose
torch packs the same way (measured: AVX-512 bytes under ATEN_CPU_CAPABILITY=avx2 give a
relative error of 1.5). Artifacts record the layout they were packed in (`int4_pack_layout`);
a process that packs otherwise converts them at load (`int4_to_this_layout`), and our kernels
that read these bytes (VNNI repacking, widening) run only where torch writes 64-row blocks.
"""

from __future__ import annotations

import functools

import torch

# The layout of AVX-512 builds: what this project's machines write and our kernels read.
BLOCKS64 = "torch-cpu-blocks64"


def pack_blocks64(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., O, K] (0..15) → the 64-row-block bytes [..., O, K / 2] (O a multiple of 64)."""
    *lead, o, k = codes.shape
    blocks = codes.to(torch.uint8).reshape(*lead, o // 64, 64, k).transpose(-1, -2)  # [.., K, 64]
    return (blocks[..., :32] | (blocks[..., 32:] << 4)).reshape(*lead, o, k // 2)


def unpack_blocks64(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_blocks64`: [..., O, K / 2] → codes [..., O, K] (uint8)."""
    *lead, o, half = packed.shape
    if o % 64:
        raise ValueError(
            f"an int4 weight of {o} output rows (not a multiple of 64) cannot be cut for tensor "
            "parallelism or unpacked from torch's 64-row blocks: serve it in one process on a "
            "machine like the one it was compiled on, or compile an int8 artifact"
        )
    k = 2 * half
    blocks = packed.reshape(*lead, o // 64, k, 32)  # [..., O/64, K, 32]
    codes = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)  # [..., O/64, K, 64]
    return codes.transpose(-1, -2).reshape(*lead, o, k)


@functools.cache
def int4_pack_layout() -> str:
    """How this process's torch packs int4 weights: BLOCKS64, or its CPU capability's name."""
    probe = (torch.arange(128 * 64) * 7 % 16).view(128, 64)
    if torch.equal(torch._convert_weight_to_int4pack_for_cpu(probe.int(), 1), pack_blocks64(probe)):
        return BLOCKS64
    return f"torch-cpu-{torch.backends.cpu.get_cpu_capability().lower()}"


def int4pack_codes(packed: torch.Tensor) -> torch.Tensor:
    """This process's torch int4pack [..., O, K / 2] → the codes [..., O, K] (uint8, 0..15), for
    a tensor-parallel cut (taken on the codes, then packed again by `int4pack_from_codes`)."""
    if int4_pack_layout() != BLOCKS64:
        raise ValueError(
            "tensor-parallel cuts of int4 weights read torch's 64-row blocks (AVX-512 builds); "
            f"this torch packs {int4_pack_layout()}: serve in one process, or compile int8"
        )
    return unpack_blocks64(packed)


def int4pack_from_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., O, K] → this process's torch int4pack [..., O, K / 2] (any O)."""
    *lead, o, k = codes.shape
    flat = codes.reshape(-1, o, k).to(torch.int32)
    packed = [torch._convert_weight_to_int4pack_for_cpu(c.contiguous(), 1) for c in flat]
    return torch.stack(packed).reshape(*lead, o, k // 2)


def int4_to_this_layout(packed: torch.Tensor, layout: str) -> torch.Tensor:
    """An artifact's packed int4 tensor, written in `layout`, in this process's layout."""
    here = int4_pack_layout()
    if layout == here:
        return packed
    if layout != BLOCKS64:
        raise ValueError(
            f"int4 weights packed as {layout} cannot be read by this torch ({here}): compile "
            "the artifact on this machine"
        )
    return int4pack_from_codes(unpack_blocks64(packed))

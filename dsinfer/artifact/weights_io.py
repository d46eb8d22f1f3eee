"""Artifact weights as safetensors: written in shards, read back by mmap as zero-copy views.

Every tensor starts on a 64-byte boundary of the file (and so of the page-aligned mapping):
torch's packed int8 CPU kernel crashes on 8-byte-aligned weights with more than one activation
row. The format has no holes, so the gaps are filled by small U8 tensors named `__pad_N__`,
which keeps the files readable by any safetensors reader.

Reading maps each file once (`UntypedStorage.from_file`, private mapping) and returns tensors
that view that storage at the offsets in the safetensors header: no conversion and no copy at
start-up; pages come in from the page cache as the first forward pass touches them.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from dsinfer.artifact.errors import ArtifactError

_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I32": torch.int32,
    "I64": torch.int64,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
SHARD_BYTES = 2 * 1024**3
ALIGN = 64
PAD_PREFIX = "__pad_"


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors with every tensor's data 64-byte aligned in the file."""
    entries: dict[str, dict] = {"__metadata__": {"format": "pt", "producer": "dsinfer"}}
    layout: list[torch.Tensor | int] = []  # tensors and pad byte counts, in file order
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if offset % ALIGN:
            pad = ALIGN - offset % ALIGN
            entries[f"{PAD_PREFIX}{len(layout)}__"] = {
                "dtype": "U8",
                "shape": [pad],
                "data_offsets": [offset, offset + pad],
            }
            layout.append(pad)
            offset += pad
        nbytes = t.numel() * t.element_size()
        entries[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        layout.append(t)
        offset += nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % ALIGN)  # data starts on a 64-byte boundary
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for item in layout:
            if isinstance(item, int):
                f.write(bytes(item))
            else:
                f.write(item.contiguous().view(torch.uint8).numpy().tobytes())


def save_weights(tensors: dict[str, torch.Tensor], root: Path) -> list[str]:
    """Write `tensors` as model-NNNNN.safetensors shards of ≤ SHARD_BYTES; returns file names."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    names = []
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(shard, root / fname)
        names.append(fname)
    return names


def mmap_weights(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of one safetensors file, viewing a private memory map of it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise ArtifactError(f"{path}: bad safetensors header length")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)  # [size] bytes
    base = 8 + header_len
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name.startswith(PAD_PREFIX):
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ArtifactError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        chunk = raw[base + start : base + end]
        if (base + start) % ALIGN:  # not written by us: copy to an aligned buffer
            chunk = chunk.clone()
        out[name] = chunk.view(dtype).reshape(info["shape"])
    return out

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
import os
import struct
from pathlib import Path

import torch

from dsinfer.artifact.errors import ArtifactError
from dsinfer.artifact.safe_files import open_regular

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


MAX_HEADER_BYTES = 100 * 1024**2  # the safetensors format's own limit


def mmap_weights(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of one safetensors file, viewing a private memory map of it. A malformed file
    (header, dtype, shape or offsets that do not fit the file) is refused naming the file and
    the tensor; the file must be regular (it was checked by verification, and is again here)."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ArtifactError(f"{path}: truncated safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise ArtifactError(f"{path}: bad safetensors header length {header_len}")
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, RecursionError) as e:
            raise ArtifactError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    base = 8 + header_len
    layout = {
        name: _checked_entry(path, name, info, size - base)
        for name, info in header.items()
        if not name.startswith(PAD_PREFIX)
    }
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)  # [size] bytes
    out: dict[str, torch.Tensor] = {}
    for name, (dtype, shape, start, end) in layout.items():
        chunk = raw[base + start : base + end]
        if (base + start) % ALIGN:  # not written by us: copy to an aligned buffer
            chunk = chunk.clone()
        out[name] = chunk.view(dtype).reshape(shape)
    return out


def _checked_entry(
    path: Path, name: str, info: object, data_bytes: int
) -> tuple[torch.dtype, list[int], int, int]:
    """(dtype, shape, start, end) of one header entry, or ArtifactError saying what is wrong."""
    if not isinstance(info, dict):
        raise ArtifactError(f"{path}: tensor {name}: header entry is not an object")
    dtype = _DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise ArtifactError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise ArtifactError(f"{path}: tensor {name} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or not offsets[0] <= offsets[1] <= data_bytes
    ):
        raise ArtifactError(
            f"{path}: tensor {name} has data offsets {offsets!r} outside the file's "
            f"{data_bytes} data bytes (truncated or altered?)"
        )
    numel = 1
    for d in shape:
        numel *= d
    start, end = offsets
    if numel * dtype.itemsize != end - start:
        raise ArtifactError(
            f"{path}: tensor {name}: shape {shape} of {info['dtype']} needs "
            f"{numel * dtype.itemsize} bytes, its offsets give {end - start}"
        )
    return dtype, shape, start, end


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0

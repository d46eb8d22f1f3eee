"""Block-quantised FP8 checkpoints (DeepSeek-V3 / R1 / V3.2 as DeepSeek publishes them).

Their config.json says `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], ...}`: each projection's `*.weight` is float8 (e4m3) and a
`*.weight_scale_inv` beside it holds one fp32 factor per block of 128 × 128 weights, w = q · s
(the name says "inverse" because the quantiser divided by it). Embeddings, norms, the router and
the LM head stay bf16.

Here such a weight is widened at load, block by block, to fp32 values and handed to the loader
like any float tensor: the model's dtype (or `dsinfer compile --quant int8|int4`) decides what is
kept, as for a bf16 checkpoint. The FP8 arithmetic itself (an fp8 GEMM) is not ours: no CPU here
multiplies fp8 natively.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def checkpoint_quantization(path: Path) -> dict[str, Any] | None:
    """config.json's quantization_config, or None. A method other than FP8 is refused by name:
    its tensors (GPTQ/AWQ codes, bitsandbytes states) are not weights to copy."""
    config = path / "config.json"
    if not config.is_file():
        return None
    quant = json.loads(config.read_text()).get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"{path}: the checkpoint is quantised with {method!r}, which dsinfer does not read; "
            "load its float (bf16) release, or DeepSeek's block-FP8 one, and quantise with "
            "`dsinfer compile --quant int8|int4` or `--quantization int8|int4`"
        )
    return quant


def block_size(quant: dict[str, Any]) -> tuple[int, int]:
    rows, cols = quant.get("weight_block_size") or (128, 128)
    return int(rows), int(cols)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q [O, I] float8 with scale [⌈O / rows⌉, ⌈I / cols⌉] (one factor a block; the last blocks
    may be partial) → the weight [O, I] in fp32."""
    rows, cols = block
    o, i = q.shape
    if scale.shape != (-(-o // rows), -(-i // cols)):
        raise ValueError(
            f"scales {tuple(scale.shape)} do not cover a weight {tuple(q.shape)} in blocks of "
            f"{rows} × {cols}"
        )
    factors = scale.float().repeat_interleave(rows, 0)[:o].repeat_interleave(cols, 1)[:, :i]
    return q.float() * factors


def dequantized(
    tensors: Iterator[tuple[str, torch.Tensor]],
    read: Any,
    quant: dict[str, Any],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every FP8 weight widened by its scales (read(name): any
    tensor of the checkpoint, by name, wherever it is stored) and the scales themselves left
    out."""
    block = block_size(quant)
    for name, t in tensors:
        if name.endswith(SCALE_SUFFIX):
            continue
        if t.dtype in FP8_DTYPES:
            scale = read(name + SCALE_SUFFIX)
            if scale is None:
                raise ValueError(f"{name} is FP8 but the checkpoint has no {name}{SCALE_SUFFIX}")
            t = dequantize_blocks(t, scale, block)
        yield name, t

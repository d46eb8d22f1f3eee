"""The preallocated KV pool: per layer, K and V blocks [num_blocks, KV, block_size, D] (MHA),
or one latent block [num_blocks, block_size, kv_lora_rank + rope_dim] (MLA)."""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from dsinfer.config import CacheConfig, ModelConfig
from dsinfer.device.host_memory import HugePageArena
from dsinfer.distributed.parallel_state import parallel_state

logger = logging.getLogger(__name__)


def num_blocks_for_budget(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = model.kv_bytes_per_token(dtype) * cache.block_size
    n = cache.kv_cache_memory_bytes // per_block
    if n < 1:
        raise ValueError(
            f"KV cache budget {cache.kv_cache_memory_bytes} bytes is smaller than one "
            f"block ({per_block} bytes); raise kv_cache_memory (--kv-cache-memory)"
        )
    return int(n)


def allocate_kv_cache(
    model: ModelConfig,
    cache: CacheConfig,
    dtype: torch.dtype,
    device: torch.device,
    reserved_blocks: int = 0,
    huge_pages: bool = False,
) -> tuple[list[tuple[torch.Tensor, ...]], int]:
    """Allocate (and touch, so a too-large pool fails now, not mid-request) the whole pool.

    Returns the caches and the number of blocks the scheduler may hand out; `reserved_blocks`
    more follow them, never handed out (the step graphs' padding rows write there).
    Under tensor parallel each rank caches its own KV heads only (the budget is per rank).
    huge_pages (CPU): the pool is one arena in transparent huge pages (device/host_memory.py):
    decode attention reads pages of blocks scattered over it."""
    state = parallel_state()
    tp = state.tp_size
    full = model
    mla = model.mla
    if tp > 1 and mla is None:
        model = dataclasses.replace(model, num_kv_heads=model.num_kv_heads // tp)
    owned = state.stage_layers(full.num_layers)
    if state.pp_size > 1:  # a stage caches its own layers; every stage gets the same block count
        per_stage = -(-full.num_layers // state.pp_size)
        model = dataclasses.replace(model, num_layers=per_stage)
    n = num_blocks_for_budget(model, cache, dtype)
    rows = n + reserved_blocks
    none = torch.empty(0, dtype=dtype, device=device)  # another stage's layer
    # MLA layout: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], one per layer;
    # every TP rank keeps the whole latent (each of its heads reads all of it). MHA: K and V
    # blocks [num_blocks, KV, block_size, D].
    shapes = (
        [(rows, cache.block_size, mla.latent_width)]
        if mla is not None
        else [(rows, model.num_kv_heads, cache.block_size, model.head_dim)] * 2
    )
    # Layers past num_layers (the MTP layer) live on the first stage, beside the head.
    extra = state.is_first_stage
    cached = [i in owned or (i >= full.num_layers and extra) for i in range(full.num_cache_layers)]
    elem = none.element_size()
    arena = None
    if huge_pages and device.type == "cpu":
        arena = HugePageArena(
            HugePageArena.size_for(math.prod(s) * elem for c in cached if c for s in shapes)
        )

    def new(shape: tuple[int, ...]) -> torch.Tensor:
        if arena is None:
            return torch.zeros(shape, dtype=dtype, device=device)
        return arena.empty(shape, dtype).zero_()  # zero already: written to be touched now

    caches = [tuple(new(s) for s in shapes) if c else (none,) * 2 for c in cached]
    logger.info(
        "KV pool: %d blocks × %d tokens = %d tokens, %.1f MiB",
        n,
        cache.block_size,
        n * cache.block_size,
        n * cache.block_size * model.kv_bytes_per_token(dtype) / 2**20,
    )
    return caches, n

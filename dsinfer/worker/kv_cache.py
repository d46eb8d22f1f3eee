"""The preallocated KV pool: per layer, K and V blocks [num_blocks, KV, block_size, D] (MHA),
or one latent block [num_blocks, block_size, kv_lora_rank + rope_dim] (MLA)."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch

from dsinfer.config import CacheConfig, ModelConfig
from dsinfer.device import total_memory
from dsinfer.device.host_memory import HugePageArena
from dsinfer.distributed.parallel_state import parallel_state

logger = logging.getLogger(__name__)


# The pool `--kv-cache-memory auto` (the default) allocates: two sequences at the context length
# (two full-length requests at once never run out of blocks), at least AUTO_FLOOR (room for many
# short ones on a small model), at most AUTO_CEILING and a quarter of the device's memory (a long
# context such as DeepSeek-V3's 163,840 tokens would ask for tens of GiB; the start-up log then
# warns and names the flag). The fixed 512 MiB it replaces fitted no model in particular: a
# 7B-shaped model got 1,090 tokens of bf16 cache, a quarter of one sequence, SmolLM2 23,296
# (2.8 sequences; now 2 × 8,192 = 360 MiB).
AUTO_SEQUENCES = 2
AUTO_FLOOR = 256 * 2**20
AUTO_CEILING = 4 * 2**30


@dataclass(frozen=True, slots=True)
class KVBudget:
    """The bytes a pool was cut from and why: said in the start-up log."""

    nbytes: int
    reason: str


def auto_kv_budget(bytes_per_token: int, context_len: int, device_bytes: int) -> KVBudget:
    """The auto budget for a model caching `bytes_per_token` (per rank) at `context_len`."""
    ceiling = min(AUTO_CEILING, device_bytes // 4)
    want = AUTO_SEQUENCES * context_len * bytes_per_token
    if want > ceiling:
        return KVBudget(
            ceiling,
            f"auto: {AUTO_SEQUENCES} sequences at the context length would take "
            f"{want / 2**20:,.0f} MiB; capped at {ceiling / 2**20:,.0f} MiB "
            f"(at most {AUTO_CEILING // 2**30} GiB and a quarter of the device's memory)",
        )
    if want < AUTO_FLOOR:
        floor = min(AUTO_FLOOR, ceiling)
        return KVBudget(floor, f"auto: the floor of {floor / 2**20:,.0f} MiB")
    return KVBudget(want, f"auto: {AUTO_SEQUENCES} sequences at the context length")


def kv_budget(
    model: ModelConfig, cache: CacheConfig, dtype: torch.dtype, context_len: int, device_bytes: int
) -> KVBudget:
    """The budget a pool is cut from: the one given, else the auto one for this rank's model."""
    if cache.kv_cache_memory_bytes is not None:
        return KVBudget(cache.kv_cache_memory_bytes, "--kv-cache-memory")
    return auto_kv_budget(model.kv_bytes_per_token(dtype), context_len, device_bytes)


def blocks_in_budget(
    model: ModelConfig, block_size: int, dtype: torch.dtype, budget: KVBudget
) -> int:
    per_block = model.kv_bytes_per_token(dtype) * block_size
    n = budget.nbytes // per_block
    if n < 1:
        raise ValueError(
            f"KV cache budget {budget.nbytes} bytes is smaller than one "
            f"block ({per_block} bytes); raise kv_cache_memory (--kv-cache-memory)"
        )
    return int(n)


@dataclass(frozen=True, slots=True)
class KVPool:
    """The allocated pool: per layer its cache tensors, the blocks the scheduler may hand out
    and the budget they were cut from (None where the blocks were given)."""

    caches: list[tuple[torch.Tensor, ...]]
    num_blocks: int
    budget: KVBudget | None


def allocate_kv_cache(
    model: ModelConfig,
    cache: CacheConfig,
    dtype: torch.dtype,
    device: torch.device,
    context_len: int,
    reserved_blocks: int = 0,
    huge_pages: bool = False,
) -> KVPool:
    """Allocate (and touch, so a too-large pool fails now, not mid-request) the whole pool.

    The pool's blocks are the ones the scheduler may hand out; `reserved_blocks` more follow
    them, never handed out (the step graphs' padding rows write there). `context_len` sizes
    the auto budget.
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
    budget: KVBudget | None = None
    if cache.num_blocks is not None:
        n = cache.num_blocks
    else:
        budget = kv_budget(model, cache, dtype, context_len, total_memory(device))
        n = blocks_in_budget(model, cache.block_size, dtype, budget)
    rows = n + reserved_blocks
    none = torch.empty(0, dtype=dtype, device=device)  # another stage's layer
    # MLA layout: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], one per layer;
    # every TP rank keeps the whole latent (each of its heads reads all of it); with sparse
    # attention (V3.2) the indexer's keys [num_blocks, block_size, index_head_dim] beside it.
    # MHA: K and V blocks [num_blocks, KV, block_size, D].
    dsa = model.sparse_attention
    if mla is None:
        shapes = [(rows, model.num_kv_heads, cache.block_size, model.head_dim)] * 2
    else:
        shapes = [(rows, cache.block_size, mla.latent_width)]
        if dsa is not None:
            shapes.append((rows, cache.block_size, dsa.index_head_dim))
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
        "KV pool: %d blocks × %d tokens = %d tokens, %.1f MiB (%s)",
        n,
        cache.block_size,
        n * cache.block_size,
        n * cache.block_size * model.kv_bytes_per_token(dtype) / 2**20,
        budget.reason if budget else "--num-kv-blocks",
    )
    return KVPool(caches, n, budget)

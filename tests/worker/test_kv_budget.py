"""The auto KV budget (`--kv-cache-memory auto`, the default): two sequences at the context
length, between a floor and a ceiling, the same on every rank."""

from __future__ import annotations

import torch

from dsinfer.config import CacheConfig
from dsinfer.worker.kv_cache import (
    AUTO_CEILING,
    AUTO_FLOOR,
    allocate_kv_cache,
    auto_kv_budget,
    kv_budget,
)
from tests.helpers import tiny_model_config

GIB = 2**30
MACHINE = 24 * GIB  # the test machines' RAM


def test_two_full_length_sequences_where_they_fit():
    # SmolLM2-135M in bf16: 30 layers × 3 KV heads × 64 × 2 (K, V) × 2 B = 23,040 B a token.
    b = auto_kv_budget(23_040, 8192, MACHINE)
    assert b.nbytes == 2 * 8192 * 23_040  # 360 MiB
    assert "2 sequences at the context length" in b.reason
    # DeepSeek-LLM-7B in bf16 at 4,096 tokens: 3.75 GiB, still two sequences.
    assert auto_kv_budget(491_520, 4096, MACHINE).nbytes == 2 * 4096 * 491_520


def test_a_small_cache_gets_the_floor_and_a_long_context_the_ceiling():
    floor = auto_kv_budget(1_024, 2048, MACHINE)
    assert floor.nbytes == AUTO_FLOOR and "floor" in floor.reason
    # DeepSeek-V2-Lite's latent cache (27 layers × 576 × 2 B) at its 163,840-token context
    # would want 9.5 GiB: capped, and the reason says what it wanted.
    capped = auto_kv_budget(31_104, 163_840, MACHINE)
    assert capped.nbytes == AUTO_CEILING
    assert "would take 9,720 MiB; capped at 4,096 MiB" in capped.reason
    # A machine with 8 GiB: a quarter of it, floor and ceiling both.
    assert auto_kv_budget(31_104, 163_840, 8 * GIB).nbytes == 2 * GIB
    assert auto_kv_budget(1_024, 2048, GIB // 2).nbytes == GIB // 8


def test_a_given_budget_wins():
    cfg = tiny_model_config()
    given = kv_budget(cfg, CacheConfig(kv_cache_memory_bytes=3 * 2**20), torch.float32, 64, MACHINE)
    assert (given.nbytes, given.reason) == (3 * 2**20, "--kv-cache-memory")


def test_the_pool_is_cut_from_the_auto_budget():
    cfg = tiny_model_config()
    pool = allocate_kv_cache(
        cfg, CacheConfig(block_size=16), torch.float32, torch.device("cpu"), 64
    )
    per_block = cfg.kv_bytes_per_token(torch.float32) * 16
    assert pool.budget is not None and pool.budget.nbytes == AUTO_FLOOR
    assert pool.num_blocks == AUTO_FLOOR // per_block
    assert pool.caches[0][0].shape[0] == pool.num_blocks
    given = allocate_kv_cache(
        cfg, CacheConfig(block_size=16, num_blocks=5), torch.float32, torch.device("cpu"), 64
    )
    assert (given.num_blocks, given.budget) == (5, None)

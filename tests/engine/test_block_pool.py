"""BlockPool and KVCacheManager: exact block ids, prefix reuse, LRU eviction, integrity."""

from __future__ import annotations

import pytest

from dsinfer.engine.block_pool import BlockPool
from dsinfer.engine.kv_cache_manager import KVCacheManager
from dsinfer.engine.request import Request, RequestStatus
from dsinfer.sampling import SamplingParams


def _req(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=4))


def test_allocate_free_order_and_integrity():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([1, 0])
    pool.check_integrity()
    assert pool.counts() == (3, 0, 1)
    # LRU: block 3 was never used, then 1 and 0 were freed in that order.
    assert pool.allocate(3) == [3, 1, 0]
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_double_free_is_caught():
    pool = BlockPool(2)
    b = pool.allocate(1)
    pool.free(b)
    with pytest.raises(AssertionError):
        pool.free(b)


def test_prefix_reuse_by_chained_hash():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, block_size=4)
    a = _req("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.allocate_slots(a, 10)
    assert kv.block_table(a) == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    b = _req("b", list(range(8)) + [99, 98, 97])
    blocks, n = kv.get_computed_blocks(b)
    assert (blocks, n) == ([0, 1], 8)
    assert kv.allocate_slots(b, 3, blocks)
    assert kv.block_table(b) == [0, 1, 3]
    assert pool.ref_cnt[:4] == [2, 2, 1, 1]
    # Same tokens in another position do not match: the hash is chained.
    c = _req("c", list(range(4, 8)) + list(range(4)) + [5])
    assert kv.get_computed_blocks(c) == ([], 0)
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    b.status = RequestStatus.FINISHED_STOPPED
    kv.free(b)
    pool.check_integrity()
    free, cached, used = pool.counts()
    assert (cached, used) == (2, 0) and free == 6


def test_whole_prompt_hit_leaves_one_token_to_compute():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, block_size=4)
    a = _req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    b = _req("b", list(range(8)))
    blocks, n = kv.get_computed_blocks(b)
    assert n == 4 and blocks == [0]  # the last block is recomputed to get logits


def test_cached_blocks_are_evicted_lru_when_needed():
    pool = BlockPool(3)
    kv = KVCacheManager(pool, block_size=2)
    a = _req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    assert pool.counts() == (1, 2, 0)
    b = _req("b", [9, 9, 9, 9, 9])
    assert kv.allocate_slots(b, 5)  # needs all three: both cached blocks are evicted
    assert pool.counts() == (0, 0, 3)
    assert kv.get_computed_blocks(_req("c", [1, 2, 3, 4, 6])) == ([], 0)
    pool.check_integrity()


def test_revived_cached_blocks_count_against_free():
    pool = BlockPool(2)
    kv = KVCacheManager(pool, block_size=2)
    a = _req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    kv.cache_full_blocks(a)
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    b = _req("b", [1, 2, 7, 7, 7])
    blocks, n = kv.get_computed_blocks(b)
    assert blocks == [0]
    # Needs 3 blocks in a pool of 2: refused without touching anything.
    assert not kv.allocate_slots(b, 3, blocks)
    pool.check_integrity()
    assert pool.counts()[2] == 0


def test_capacity_report_advises_the_budget_for_one_full_sequence():
    from dsinfer.engine.block_pool import pool_capacity_report

    # DeepSeek-LLM-7B's shape in bf16: 491,520 B a token, 16-token blocks; a 512 MiB budget
    # (the default before the auto one) gives 68 blocks = 1,088 tokens against 4,096.
    per_block = 491_520 * 16
    budget = 512 * 2**20
    blocks = budget // per_block
    info, warning = pool_capacity_report(blocks, 16, 4096, budget)
    assert info == "KV pool: 1,088 tokens = 0.3 sequences at the context length 4,096"
    assert warning is not None
    assert "--kv-cache-memory 1928MiB" in warning  # 256 blocks' worth of the budget, rounded up
    assert 256 * per_block <= 1928 * 2**20
    assert "--max-model-len to 1,088" in warning
    assert pool_capacity_report(300, 16, 4096, budget)[1] is None
    # Blocks given, not a budget: the advice is a block count.
    warning = pool_capacity_report(blocks, 16, 4096, None)[1]
    assert warning is not None and "--num-kv-blocks 256" in warning

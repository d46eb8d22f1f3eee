"""A fixed pool of KV blocks: reference counts, an LRU free queue and a content-hash index.

Every block is in exactly one state: *used* (ref_cnt > 0), *cached* (ref_cnt == 0 but holding a
registered prefix hash, evictable) or *free*. Freed blocks go to the tail of the LRU queue and
allocation pops the head, so the least recently used cached prefix is evicted first.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self.hits = 0
        self.queries = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with only {len(self._free)} free blocks")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            self._evict(bid)
            self.ref_cnt[bid] = 1
            out.append(bid)
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on blocks found by prefix lookup (pulling them off the free queue)."""
        for bid in block_ids:
            if self.ref_cnt[bid] == 0:
                del self._free[bid]
            self.ref_cnt[bid] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each; callers pass tail blocks first so those are evicted first."""
        for bid in block_ids:
            assert self.ref_cnt[bid] > 0, f"double free of block {bid}"
            self.ref_cnt[bid] -= 1
            if self.ref_cnt[bid] == 0:
                self._free[bid] = None

    def lookup(self, block_hash: bytes) -> int | None:
        self.queries += 1
        bid = self._by_hash.get(block_hash)
        if bid is not None:
            self.hits += 1
        return bid

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Publish a full block's content hash; an equal block already published wins."""
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self._by_hash:
            return
        self.block_hash[block_id] = block_hash
        self._by_hash[block_hash] = block_id

    def _evict(self, bid: int) -> None:
        h = self.block_hash[bid]
        if h is not None:
            if self._by_hash.get(h) == bid:
                del self._by_hash[h]
            self.block_hash[bid] = None

    def reset_prefix_cache(self) -> None:
        for bid in list(self._free):
            self._evict(bid)

    def counts(self) -> tuple[int, int, int]:
        """(free, cached, used)."""
        cached = sum(1 for b in self._free if self.block_hash[b] is not None)
        return len(self._free) - cached, cached, self.num_blocks - len(self._free)

    def check_integrity(self) -> None:
        """Raise AssertionError if free + cached + used != total or the indexes disagree."""
        free, cached, used = self.counts()
        assert free + cached + used == self.num_blocks, (free, cached, used, self.num_blocks)
        for bid in range(self.num_blocks):
            in_free = bid in self._free
            assert in_free == (self.ref_cnt[bid] == 0), f"block {bid}: ref {self.ref_cnt[bid]}"
        for h, bid in self._by_hash.items():
            assert self.block_hash[bid] == h, f"hash index stale for block {bid}"


def pool_capacity_report(
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    budget_bytes: int | None,
) -> tuple[str, str | None]:
    """What the pool holds, said at start-up: (an info line, a warning or None).

    The warning is for a pool smaller than one sequence at the model's context length: the
    engine still serves, but refuses a longer prompt and cuts an answer short where its
    sequence outgrows the whole pool (scheduler.py). `budget_bytes` is the budget the blocks
    were cut from (per rank), None where the blocks were given; the advice scales it by the
    blocks a full sequence needs."""
    tokens = num_blocks * block_size
    info = (
        f"KV pool: {tokens:,} tokens = {tokens / max_model_len:.1f} sequences at the context "
        f"length {max_model_len:,}"
    )
    if tokens >= max_model_len:
        return info, None
    needed = -(-max_model_len // block_size)  # blocks for one full-length sequence
    if budget_bytes is None:
        advice = f"--num-kv-blocks {needed}"
    else:
        mib = -(-budget_bytes * needed // num_blocks // 2**20)
        advice = f"--kv-cache-memory {mib}MiB"
    warning = (
        f"the KV pool holds {tokens:,} tokens, fewer than the context length "
        f"{max_model_len:,}: a prompt longer than the pool is refused and an answer is cut "
        f"short where its sequence outgrows it; for one full-length sequence pass {advice} "
        f"(or lower --max-model-len to {tokens:,})"
    )
    return info, warning

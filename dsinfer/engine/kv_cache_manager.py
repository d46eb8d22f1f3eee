"""Maps requests to KV blocks: allocation, prefix reuse by chained block hashes, release."""

from __future__ import annotations

import hashlib
from array import array

from dsinfer.engine.block_pool import BlockPool
from dsinfer.engine.request import Request


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """Chained hash: a block's identity includes every token before it."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.req_blocks: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}

    def _hashes(self, req: Request, num_full_blocks: int) -> list[bytes]:
        hashes = self._req_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else b""
            hashes.append(hash_block(parent, req.all_token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks; at least one token is always left to compute,
        because the step that computes it is the one that yields the next-token logits."""
        if not self.pool.enable_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        found: list[int] = []
        for h in self._hashes(req, max_blocks):
            bid = self.pool.lookup(h)
            if bid is None:
                break
            found.append(bid)
        return found, len(found) * self.block_size

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Reserve room for `num_new_tokens` beyond what is computed; False if the pool is short."""
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.get(req.request_id, [])
        num_tokens = req.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = -(-(num_tokens + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, needed - len(blocks) - len(computed_blocks))
        # Cached blocks we are about to revive stop being allocatable once touched.
        revived = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if num_new_blocks + revived > self.pool.num_free:
            return False
        self.pool.touch(computed_blocks)
        blocks = blocks + computed_blocks + self.pool.allocate(num_new_blocks)
        self.req_blocks[req.request_id] = blocks
        if computed_blocks:
            self._num_registered[req.request_id] = len(computed_blocks)
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register every block whose tokens are now all computed (and thus present in KV)."""
        if not self.pool.enable_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        done = self._num_registered.get(req.request_id, 0)
        if num_full <= done:
            return
        hashes = self._hashes(req, num_full)
        blocks = self.req_blocks[req.request_id]
        for i in range(done, num_full):
            self.pool.register(blocks[i], hashes[i])
        self._num_registered[req.request_id] = num_full

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        self.pool.free(list(reversed(blocks)))
        self._num_registered.pop(req.request_id, None)
        # Keep hashes only while the tokens stand; a preempted request recomputes the same ones.
        if req.status.finished:
            self._req_hashes.pop(req.request_id, None)

    def block_table(self, req: Request) -> list[int]:
        return self.req_blocks.get(req.request_id, [])

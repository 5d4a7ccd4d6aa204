"""The paged KV cache's bookkeeping: a fixed pool of blocks, a block list per request."""
from __future__ import annotations

from collections import deque


class KVCacheManager:
    """Exact accounting: num_used_blocks + num_free_blocks == num_blocks, always."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, "
                             f"got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def num_blocks_held(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def can_allocate(self, request_id: str, num_total_tokens: int, reserve: int = 0) -> bool:
        """Would growing the request to `num_total_tokens` leave at least `reserve` blocks free?"""
        extra = self.blocks_needed(num_total_tokens) - self.num_blocks_held(request_id)
        return extra + reserve <= len(self._free)

    def try_allocate(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Grow the request's blocks to hold `num_total_tokens`; the new block ids, or None if the pool is
        short."""
        held = self._blocks.setdefault(request_id, [])
        extra = self.blocks_needed(num_total_tokens) - len(held)
        if extra > len(self._free):
            if not held:
                del self._blocks[request_id]
            return None
        new = [self._free.popleft() for _ in range(max(extra, 0))]
        held.extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Return all of the request's blocks to the pool; the number freed."""
        blocks = self._blocks.pop(request_id, [])
        self._free.extend(blocks)
        return len(blocks)

    def audit(self) -> list[str]:
        """What breaks exact accounting, in words (nothing, always): a block free twice, held twice,
        or both held and free; used + free != total."""
        problems = []
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append(f"{len(self._free) - len(free)} blocks are in the free list twice")
        held: dict[int, str] = {}
        for request_id, blocks in self._blocks.items():
            for block in blocks:
                if block in held:
                    problems.append(f"block {block} is held by {held[block]} and {request_id}")
                held[block] = request_id
                if block in free:
                    problems.append(f"block {block} is held by {request_id} and free")
        if len(self._free) + sum(len(b) for b in self._blocks.values()) != self.num_blocks:
            problems.append(f"used {self.num_blocks - len(self._free)} + free {len(self._free)} blocks do "
                            f"not match the {sum(len(b) for b in self._blocks.values())} held of "
                            f"{self.num_blocks}")
        return problems

    def holders(self) -> set[str]:
        """Request ids that hold at least one block."""
        return {request_id for request_id, blocks in self._blocks.items() if blocks}

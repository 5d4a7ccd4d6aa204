"""The paged KV cache's bookkeeping: a fixed pool of blocks, a block list per request, and automatic
prefix caching in the manner of vLLM V1.

A full block of computed tokens is named by a hash of its tokens chained to its parent block's hash
(`block_hash`): equal hashes mean equal KV, since one engine runs one model in one dtype and nothing
else changes the KV of the same tokens. With caching on, blocks are reference-counted; a request whose
leading full blocks are cached shares them, and their tokens count as computed. A block whose count
drops to zero goes to the tail of the free queue; one that holds a hash stays findable there (cached,
evictable) until an allocation takes it from the head, least recently freed first, and evicts it. Only
full blocks are cached, and a lookup never covers a request's last known token (it must be computed to
sample). A preempted request frees its blocks like a finished one and re-hits those that survived.

Accounting is exact, always: used (referenced) + cached (evictable) + empty == total; an allocation may
take any free block, cached or empty (`num_free_blocks`).
"""
from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable

from batchtop.telemetry.first_blocks import FirstBlocks

# Why a request's uncached full blocks missed (telemetry.events.MISS_REASONS).
NO_PREFIX, BELOW_BLOCK, EVICTED, PARTIAL = "no_prefix", "below_block", "evicted", "partial"
DISABLED = "disabled"
EVICTED_MEMORY = 65536            # evicted hashes remembered, to tell `evicted` from `no_prefix`
ROOT = b""                        # the parent hash of a request's first block


def block_hash(parent: bytes, token_ids) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()[:16]


def prefix_id(root_hash: bytes) -> str:
    """The short name of a prefix: its first block's hash in hex."""
    return root_hash.hex()[:12]


@dataclass(frozen=True)
class CacheLookup:
    """What the cache holds of a request's known tokens, and why the rest missed."""
    block_ids: tuple[int, ...]        # the cached leading blocks, shared at admission
    num_cached_tokens: int
    num_full_blocks: int              # full blocks before the last known token: what could hit
    reason: str | None                # why block len(block_ids) missed; None: no full block missed
    num_matched_tokens: int = 0       # below_block: tokens the best cached first block has in common
    evicted_ago_s: float | None = None  # evicted: how long ago the missing block was evicted
    prefix_id: str = ""               # the prefix (first block's hash) the request belongs to

    @property
    def num_hit_blocks(self) -> int:
        return len(self.block_ids)


NO_LOOKUP = CacheLookup((), 0, 0, None)


@dataclass(frozen=True)
class Eviction:
    block_id: int
    prefix_id: str                    # whose prefix the block belonged to
    t: float


@dataclass(frozen=True)
class CachedBlocks:
    """A request's blocks that became cached (hashed and findable) since the last take."""
    request_id: str
    prefix_id: str
    num_blocks: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, "
                             f"got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.clock = clock
        # head: allocated next (empty first at start, then least recently freed)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._root_of: list[bytes] = [ROOT] * num_blocks
        self._cached: dict[bytes, int] = {}              # hash -> block
        self._num_cached_free = 0                       # hashed blocks in the free queue
        self._blocks: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}        # full-block hash chain of each holder's known tokens
        self._num_registered: dict[str, int] = {}        # leading blocks of each holder already hashed
        self._evicted: OrderedDict[bytes, float] = OrderedDict()   # hash -> when it was evicted
        # cached first blocks' tokens, and their hashes by leading tokens: `below_block` or `no_prefix`
        self._first_blocks = FirstBlocks(block_size)
        self._evictions: list[Eviction] = []
        self._newly_cached: dict[str, CachedBlocks] = {}

    # -- accounting ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: empty ones and cached (evictable) ones."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a hash: a later request may hit them until they are evicted."""
        return self._num_cached_free

    @property
    def num_empty_blocks(self) -> int:
        return len(self._free) - self._num_cached_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request holds (a block shared by several counts once)."""
        return self.num_blocks - len(self._free)

    def free_queue(self) -> tuple[str, ...]:
        """The free blocks, the next one taken first: a cached block by its hash's short name, an empty
        one as ""."""
        return tuple("" if (h := self._hash_of[block]) is None else prefix_id(h) for block in self._free)

    def restore_free_queue(self, hashes: list[tuple[bytes, bytes] | None]) -> None:
        """The free queue as a snapshot had it (a replay that starts from one): the free blocks in their
        order, the i-th empty (None) or cached under (hash, its prefix's first hash). A hash some block
        holds already leaves its block empty; blocks past the list stay empty."""
        for block, entry in zip(list(self._free), hashes):
            if entry is None or entry[0] in self._cached:
                continue
            h, root = entry
            self._hash_of[block], self._cached[h] = h, block
            self._root_of[block] = ROOT if h == root else root
            self._num_cached_free += 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def num_blocks_held(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    # -- lookup ----------------------------------------------------------------------------

    def lookup(self, request_id: str, token_ids: list[int]) -> CacheLookup:
        """The cached leading full blocks of a request that holds no blocks yet, whose known tokens are
        `token_ids`, and why the next full block missed. Changes nothing."""
        if not self.enable_caching:
            return CacheLookup((), 0, 0, DISABLED)
        num_full = (len(token_ids) - 1) // self.block_size
        hashes = self._chain(request_id, token_ids, num_full)[:num_full]
        hit: list[int] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hit.append(block)
        pid = prefix_id(hashes[0]) if hashes else ""
        found = CacheLookup(tuple(hit), len(hit) * self.block_size, num_full, None, prefix_id=pid)
        if len(hit) == num_full:
            return found
        missed = hashes[len(hit)]
        if missed in self._evicted:
            return replace(found, reason=EVICTED, evicted_ago_s=self.clock() - self._evicted[missed])
        if hit:
            return replace(found, reason=PARTIAL)
        matched = self._first_blocks.longest_match(token_ids)
        return replace(found, reason=BELOW_BLOCK if matched else NO_PREFIX, num_matched_tokens=matched)

    def prompt_blocks(self, request_id: str, prompt_token_ids: list[int]) -> tuple[str, ...]:
        """A new request's full prompt blocks, each by its hash's short name (its admission's lookup
        reuses the chain); none where caching is off."""
        if not self.enable_caching:
            return ()
        num_full = len(prompt_token_ids) // self.block_size
        return tuple(prefix_id(h) for h in self._chain(request_id, prompt_token_ids, num_full))

    def _chain(self, request_id: str, token_ids: list[int], num_full: int) -> list[bytes]:
        """The hashes of the first `num_full` full blocks of `token_ids`, extending the request's chain."""
        hashes = self._hashes.setdefault(request_id, [])
        size = self.block_size
        for index in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else ROOT
            hashes.append(block_hash(parent, token_ids[index * size: (index + 1) * size]))
        return hashes

    # -- allocation ------------------------------------------------------------------------

    def can_allocate(self, request_id: str, num_total_tokens: int, reserve: int = 0,
                     cached: CacheLookup = NO_LOOKUP) -> bool:
        """Would growing the request to `num_total_tokens` (sharing `cached`'s blocks first) leave at
        least `reserve` blocks free?"""
        return self._num_new(request_id, num_total_tokens, cached) + reserve <= self._free_after(cached)

    def blocks_short(self, request_id: str, num_total_tokens: int, cached: CacheLookup = NO_LOOKUP) -> int:
        """New blocks the request needs to grow to `num_total_tokens`."""
        return self._num_new(request_id, num_total_tokens, cached)

    def _num_new(self, request_id: str, num_total_tokens: int, cached: CacheLookup) -> int:
        held = self.num_blocks_held(request_id) + cached.num_hit_blocks
        return max(0, self.blocks_needed(num_total_tokens) - held)

    def _free_after(self, cached: CacheLookup) -> int:
        """Free blocks once `cached`'s blocks are taken out of the free queue."""
        return len(self._free) - sum(1 for block in cached.block_ids if self._ref[block] == 0)

    def try_allocate(self, request_id: str, num_total_tokens: int,
                     cached: CacheLookup = NO_LOOKUP) -> list[int] | None:
        """Grow the request's blocks to hold `num_total_tokens`, a request without blocks sharing
        `cached`'s blocks first (from `lookup` this step); the blocks added, or None if the pool is
        short (then nothing changed)."""
        num_new = self._num_new(request_id, num_total_tokens, cached)
        if num_new > self._free_after(cached):
            return None
        held = self._blocks.setdefault(request_id, [])
        for block in cached.block_ids:
            self._touch(block)
        if cached.block_ids:                 # a request without blocks: its cached ones are hashed already
            held.extend(cached.block_ids)
            self._num_registered[request_id] = len(held)
        new = [self._take_free() for _ in range(num_new)]
        held.extend(new)
        if not held:
            del self._blocks[request_id]
        return list(cached.block_ids) + new

    def _touch(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
            self._num_cached_free -= 1
        self._ref[block] += 1

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._hash_of[block]
        if h is not None:
            self._num_cached_free -= 1
            self._evict(block, h)
        self._ref[block] = 1
        return block

    def _evict(self, block: int, h: bytes) -> None:
        now = self.clock()
        del self._cached[h]
        self._hash_of[block] = None
        root = self._root_of[block]
        if root == ROOT:                     # a first block: no longer a candidate for below_block
            self._first_blocks.discard(h)
        self._evicted[h] = now
        self._evicted.move_to_end(h)
        if len(self._evicted) > EVICTED_MEMORY:
            self._evicted.popitem(last=False)
        self._evictions.append(Eviction(block, prefix_id(root if root != ROOT else h), now))

    # -- caching computed blocks ----------------------------------------------------------------

    def cache_computed(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Make the request's full blocks of computed tokens findable (call after the forward pass that
        computed them). A block whose hash another block already holds stays unhashed."""
        if not self.enable_caching:
            return
        blocks = self._blocks.get(request_id)
        if blocks is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self._num_registered.get(request_id, 0)
        if num_full <= start:
            return
        hashes = self._chain(request_id, token_ids, num_full)
        root = hashes[0]
        added = 0
        for index in range(start, num_full):
            h, block = hashes[index], blocks[index]
            if h in self._cached or self._hash_of[block] is not None:
                continue
            self._cached[h] = block
            self._hash_of[block] = h
            self._root_of[block] = ROOT if index == 0 else root
            self._evicted.pop(h, None)
            if index == 0:
                self._first_blocks.add(h, token_ids)
            added += 1
        self._num_registered[request_id] = num_full
        if added:
            before = self._newly_cached.get(request_id)
            self._newly_cached[request_id] = CachedBlocks(request_id, prefix_id(root),
                                                          added + (before.num_blocks if before else 0))

    def take_evictions(self) -> list[Eviction]:
        """Blocks evicted since the last take, in order."""
        taken, self._evictions = self._evictions, []
        return taken

    def take_cached(self) -> list[CachedBlocks]:
        """Requests whose blocks became cached since the last take."""
        taken, self._newly_cached = list(self._newly_cached.values()), {}
        return taken

    # -- freeing ---------------------------------------------------------------------------

    def free(self, request_id: str) -> int:
        """Drop the request's hold on all its blocks, last block first (so a chain's tail is evicted
        before its head); the number it held."""
        blocks = self._blocks.pop(request_id, [])
        self._hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
                if self._hash_of[block] is not None:
                    self._num_cached_free += 1
        return len(blocks)

    def audit(self) -> list[str]:
        """What breaks exact accounting, in words (nothing, always): a reference count that does not
        match the holders, a block both held and free, a hash map that disagrees with the blocks,
        used + cached + empty != total."""
        problems = []
        holders: list[list[str]] = [[] for _ in range(self.num_blocks)]
        for request_id, blocks in self._blocks.items():
            if len(set(blocks)) != len(blocks):
                problems.append(f"{request_id} holds a block twice")
            for block in blocks:
                holders[block].append(request_id)
        if not self.enable_caching and any(len(ids) > 1 for ids in holders):
            problems.append("a block is shared with caching off")
        for block, (ids, ref) in enumerate(zip(holders, self._ref)):
            if len(ids) != ref:
                problems.append(f"block {block} is held by {', '.join(ids) or 'nobody'} but counted {ref}")
            if (ref == 0) != (block in self._free):
                where = "in" if block in self._free else "not in"
                problems.append(f"block {block} has {ref} holders and is {where} the free queue")
        if any(self._hash_of[block] != h for h, block in self._cached.items()):
            problems.append("the hash map and the blocks' hashes disagree")
        cached_free = sum(1 for block in self._free if self._hash_of[block] is not None)
        if cached_free != self._num_cached_free:
            problems.append(f"{cached_free} cached free blocks counted as {self._num_cached_free}")
        used, empty = sum(1 for ref in self._ref if ref > 0), len(self._free) - cached_free
        if used + cached_free + empty != self.num_blocks or used != self.num_used_blocks:
            problems.append(f"used {used} + cached {cached_free} + empty {empty} blocks do not make the "
                            f"{self.num_blocks}")
        return problems

    def holders(self) -> set[str]:
        """Request ids that hold at least one block."""
        return {request_id for request_id, blocks in self._blocks.items() if blocks}

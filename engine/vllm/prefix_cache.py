"""vLLM's prefix cache as batchtop's events tell it: at admission, the cached tokens and why the rest
missed; the cached blocks vLLM evicted to reuse them; the pool split into used / cached / free.

`PrefixCacheWatch` reads vLLM's KV cache manager and block pool and never changes them: a request's
`block_hashes` (vLLM hashes every full block of its tokens, chained to the parent's), its blocks
(`kv_cache_manager.get_blocks`), each block's `block_hash` and `ref_cnt`, the pool's hash-to-block map.
vLLM caches a block when it allocates it for tokens it schedules; a free block keeps its hash, and
vLLM drops the hash when it hands the block out again (an eviction). vLLM remembers no evicted hash, so
the watch does: it remembers which hash each block it saw held, and a block that comes back to a request
holding another (or none) was evicted. It follows vLLM's order within a step: the running requests'
blocks, then each admitted request (its lookup, then its own allocation's evictions and cachings).

One KV cache group (full attention) is read: a model with several groups reports group 0's blocks.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from batchtop.telemetry.first_blocks import FirstBlocks

EVICTED_MEMORY = 65536            # evicted hashes remembered, to tell `evicted` from `no_prefix`


class Admission:
    """RequestAdmitted's prefix-cache fields of one admitted request."""
    __slots__ = ("num_known_tokens", "num_cached_tokens", "num_full_blocks", "num_hit_blocks", "miss_reason",
                 "num_matched_tokens", "evicted_ago_s", "prefix_id")

    def __init__(self, num_known_tokens: int, num_cached_tokens: int, num_full_blocks: int,
                 num_hit_blocks: int, miss_reason: str, num_matched_tokens: int = 0,
                 evicted_ago_s: float = 0.0, prefix_id: str = ""):
        self.num_known_tokens = num_known_tokens
        self.num_cached_tokens = num_cached_tokens
        self.num_full_blocks = num_full_blocks
        self.num_hit_blocks = num_hit_blocks
        self.miss_reason = miss_reason
        self.num_matched_tokens = num_matched_tokens
        self.evicted_ago_s = evicted_ago_s
        self.prefix_id = prefix_id

    def fields(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


def prefix_id(block_hash: bytes) -> str:
    """A prefix's short name: its first block's hash in hex, as batchtop's engine names it."""
    return bytes(block_hash).hex()[:12]


class _Holder:
    """What the watch knows of one request's blocks."""
    __slots__ = ("num_cached", "block_ids", "prefix_id")

    def __init__(self):
        self.num_cached = 0           # leading blocks seen holding their hash
        self.block_ids: list[int] = []   # its blocks seen so far (freed with it, they may stay cached)
        self.prefix_id = ""


class PrefixCacheWatch:
    def __init__(self, kv_cache_manager, block_size: int, clock: Callable[[], float],
                 block_hash_of: Callable[[bytes], bytes]):
        """`block_hash_of(key)`: the block hash in a block's key (vLLM's `get_block_hash`)."""
        self._manager = kv_cache_manager
        self._block_hash = block_hash_of
        self._pool = kv_cache_manager.block_pool
        self.enabled = bool(kv_cache_manager.enable_caching)
        self.block_size = block_size
        self._clock = clock
        self._hash_of: dict[int, bytes] = {}            # block id -> the key it was last seen holding
        self._block_hash_of: dict[int, bytes] = {}      # ... and that key's block hash (a request's)
        self._root_of: dict[int, str] = {}              # block id -> the prefix its hash belongs to
        self._evicted: OrderedDict[bytes, float] = OrderedDict()   # vLLM BlockHash -> when it went
        self._first_blocks = FirstBlocks(block_size)               # cached first blocks' tokens
        self._holders: dict[str, _Holder] = {}
        self._free_cached: set[int] = set()             # free blocks that hold a hash (evictable)
        self._released: list[str] = []                  # preempted inside schedule(): freed after it
        self._evictions: list[tuple[int, str]] = []     # (block id, prefix id) since the last take
        self._cached_now: dict[str, tuple[str, int]] = {}   # request id -> (prefix id, new blocks)

    # -- the pool split --------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a hash: a later request may hit them until vLLM evicts them."""
        return len(self._free_cached)

    def prompt_blocks(self, request) -> tuple[str, ...]:
        """A new request's full prompt blocks, each by its hash's short name (vLLM hashed them as it
        made the request); none where caching is off."""
        if not self.enabled:
            return ()
        num_full = request.num_prompt_tokens // self.block_size
        return tuple(prefix_id(h) for h in request.block_hashes[:num_full])

    def free_queue(self) -> tuple[str, ...] | None:
        """vLLM's free blocks, the next one handed out first: a cached block by its hash's short name, an
        empty one as ""; None where caching is off."""
        if not self.enabled:
            return None
        return tuple("" if block.block_hash is None else prefix_id(self._block_hash(block.block_hash))
                     for block in self._pool.free_block_queue.get_all_free_blocks())

    def restored(self, block, prefix: str) -> None:
        """A free block given a hash by a run that starts from a snapshot (the harness): cached, of the
        prefix `prefix`."""
        self._hash_of[block.block_id] = block.block_hash
        self._block_hash_of[block.block_id] = self._block_hash(block.block_hash)
        self._root_of[block.block_id] = prefix
        self._free_cached.add(block.block_id)

    # -- one step ------------------------------------------------------------------------------

    def preempting(self, request_id: str) -> None:
        """Before vLLM frees a preempted request's blocks (inside `schedule()`)."""
        self._released.append(request_id)

    def scheduled(self, running_ids, admitted, requests) -> dict[str, Admission]:
        """After `schedule()`: `running_ids` the scheduled requests that were running, `admitted` the
        (request id, cached tokens) vLLM admitted, in order; `requests` its request table. The prefix-cache
        fields of each admission."""
        for request_id in self._released:
            self._release(request_id)
        self._released = []
        for request_id in running_ids:
            request = requests.get(request_id)
            if request is not None:
                self._follow(request)
        out = {}
        for request_id, num_cached in admitted:
            request = requests[request_id]
            self._holders.pop(request_id, None)       # a resumed request holds new blocks
            out[request_id] = self._admission(request, num_cached)
            self._follow(request)
        return out

    def take_evictions(self) -> list[tuple[int, str]]:
        taken, self._evictions = self._evictions, []
        return taken

    def take_cached(self) -> list[tuple[str, str, int]]:
        """(request id, prefix id, blocks newly cached) since the last take."""
        taken = [(request_id, pid, n) for request_id, (pid, n) in self._cached_now.items()]
        self._cached_now = {}
        return taken

    def retired(self, request_id: str) -> None:
        """After vLLM freed a request's blocks (finished or aborted)."""
        self._release(request_id)

    # -- admission -----------------------------------------------------------------------------

    def _admission(self, request, num_cached: int) -> Admission:
        """The lookup vLLM ran for `request`, read back: its full blocks before the last known token could
        hit (vLLM never looks up the last one: it must be computed to sample), `num_cached` tokens did."""
        num_known = request.num_tokens
        if not self.enabled or not self._manager.prefix_cache_lookup_enabled(request):
            return Admission(num_known, num_cached, 0, 0, "disabled")
        size = self.block_size
        num_full = (num_known - 1) // size
        hashes = request.block_hashes
        pid = prefix_id(hashes[0]) if num_full and hashes else ""
        num_hit = min(num_cached // size, num_full)
        found = Admission(num_known, num_cached, num_full, num_hit, "", prefix_id=pid)
        if num_hit >= num_full or num_hit >= len(hashes):
            return found
        missed = bytes(hashes[num_hit])
        if missed in self._evicted:
            found.miss_reason = "evicted"
            found.evicted_ago_s = max(0.0, self._clock() - self._evicted[missed])
        elif num_hit:
            found.miss_reason = "partial"
        else:
            matched = self._first_blocks.longest_match(request.all_token_ids[:size])
            found.miss_reason = "below_block" if matched else "no_prefix"
            found.num_matched_tokens = matched
        return found

    # -- blocks ----------------------------------------------------------------------------------

    def _follow(self, request) -> None:
        """The request's blocks since the last look: new ones that held another hash were evicted by
        vLLM to be handed out; leading ones that now hold their hash are cached."""
        if not self.enabled:
            return
        request_id = request.request_id
        holder = self._holders.get(request_id)
        if holder is None:
            holder = self._holders[request_id] = _Holder()
        blocks = self._manager.get_blocks(request_id).blocks[0]
        for block in blocks[len(holder.block_ids):]:
            seen = self._hash_of.get(block.block_id)
            if seen is not None and block.block_hash != seen:
                self._evict(block.block_id)
            holder.block_ids.append(block.block_id)
        for index in range(holder.num_cached, len(blocks)):
            block = blocks[index]
            if block.block_hash is None or block.is_null:
                break
            if block.ref_cnt > 0:
                self._free_cached.discard(block.block_id)
            if index == 0 and not holder.prefix_id:
                h = self._block_hash(block.block_hash)
                holder.prefix_id = prefix_id(h)
                if block.block_id not in self._hash_of:
                    self._first_blocks.add(h, request.all_token_ids)
            self._see(request_id, holder, block)
            holder.num_cached = index + 1

    def _see(self, request_id: str, holder: _Holder, block) -> None:
        """`block` of the request holds its hash: remember it (a hit, or one seen already, is known)."""
        block_id, key = block.block_id, block.block_hash
        if self._hash_of.get(block_id) == key:
            return
        h = self._block_hash(key)
        self._hash_of[block_id] = key
        self._block_hash_of[block_id] = h
        self._root_of[block_id] = holder.prefix_id
        self._evicted.pop(h, None)
        pid, before = self._cached_now.get(request_id, (holder.prefix_id, 0))
        self._cached_now[request_id] = (pid, before + 1)

    def _evict(self, block_id: int) -> None:
        self._free_cached.discard(block_id)
        del self._hash_of[block_id]
        h = self._block_hash_of.pop(block_id)
        pid = self._root_of.pop(block_id, "")
        self._first_blocks.discard(h)                   # a first block: no longer a below_block candidate
        self._evicted[h] = self._clock()
        self._evicted.move_to_end(h)
        if len(self._evicted) > EVICTED_MEMORY:
            self._evicted.popitem(last=False)
        self._evictions.append((block_id, pid))

    def _release(self, request_id: str) -> None:
        """The request's blocks were freed: those no one else holds and that keep their hash are cached."""
        holder = self._holders.pop(request_id, None)
        if holder is None:
            return
        blocks = self._pool.blocks
        for block_id in holder.block_ids:
            block = blocks[block_id]
            if block.ref_cnt == 0 and block.block_hash is not None and not block.is_null:
                self._see(request_id, holder, block)     # vLLM may cache a block as its output arrives
                self._free_cached.add(block_id)

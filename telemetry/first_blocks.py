"""The cached first blocks, indexed by their leading half block: how many leading tokens a prompt
shares with the closest of them. A prompt that misses its first block but shares at least half a block
with a cached one misses `below_block` (the shared part is shorter than a block, so nothing of it is
cached), else `no_prefix`; batchtop's engine (engine/core/kv_cache.py) and the vLLM guest
(engine/vllm/prefix_cache.py) count it with this one index."""
from __future__ import annotations


class FirstBlocks:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._tokens: dict[bytes, tuple[int, ...]] = {}         # block hash -> its tokens
        self._by_root: dict[tuple[int, ...], set[bytes]] = {}   # leading half block -> block hashes

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._tokens

    def _root(self, tokens) -> tuple[int, ...]:
        return tuple(tokens[: max(1, self.block_size // 2)])

    def add(self, block_hash: bytes, tokens) -> None:
        """A first block cached: `tokens`, the prompt it starts (its first block_size are kept)."""
        first = self._tokens[block_hash] = tuple(tokens[: self.block_size])
        self._by_root.setdefault(self._root(first), set()).add(block_hash)

    def discard(self, block_hash: bytes) -> None:
        """The block is evicted (or was never a first block): no longer a candidate."""
        first = self._tokens.pop(block_hash, None)
        if first is None:
            return
        key = self._root(first)
        hashes = self._by_root[key]
        hashes.discard(block_hash)
        if not hashes:
            del self._by_root[key]

    def longest_match(self, tokens) -> int:
        """Leading tokens shared with the closest cached first block, when at least half a block is
        shared (fewer, such as a common first token, count as no prefix); else 0."""
        if self.block_size < 2:
            return 0
        tokens = tokens[: self.block_size]
        best = 0
        for h in self._by_root.get(self._root(tokens), ()):
            cached, n = self._tokens[h], 0
            while n < len(tokens) and tokens[n] == cached[n]:
                n += 1
            best = max(best, n)
        return best

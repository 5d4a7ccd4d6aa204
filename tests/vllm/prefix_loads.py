"""The three prefix-cache loads of the vLLM tests, in tokens, for a block size and a pool of 5 usable
blocks: run one request at a time, each ends before the next arrives (nothing is preempted, so every
admission counts in vLLM's prefix-cache counters). Shared by the harness check (vLLM's interpreter) and
the server test; plain Python only.

- shared: one prefix of 3 blocks, then under a block of each request's own: the first request misses
  (no_prefix), the later ones hit the 3 blocks and miss nothing.
- below_block: a common prefix 8 tokens short of one block, then a block and a bit of each request's
  own: the first is no_prefix, the later ones hit nothing and miss below_block.
- eviction: 3 prefixes of 2 blocks, each request 3 blocks with its own tail, twice round: the second
  round finds each prefix evicted by the 2 requests between (vLLM frees a request's last block first,
  and hands out its unhashed blocks before its cached ones: 6 blocks through a pool of 5).
"""
from __future__ import annotations

import random

USABLE_BLOCKS = 5


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30_000) for _ in range(n)]


LOADS = ("shared", "below_block", "eviction")


def loads(block_size: int, seed: int) -> dict[str, list[list[int]]]:
    """{load name: its prompts in order}; prompts of one seed never share a first block across loads."""
    rng = random.Random(seed)
    bs = block_size
    prefix = _tokens(rng, 3 * bs)
    shared = [prefix + _tokens(rng, rng.randint(2, bs - 4)) for _ in range(3)]
    common = _tokens(rng, bs - 8)
    below = [common + _tokens(rng, bs + rng.randint(2, bs - 4)) for _ in range(3)]
    prefixes = [_tokens(rng, 2 * bs) for _ in range(3)]
    eviction = [p + _tokens(rng, rng.randint(2, bs // 2)) for _ in range(2) for p in prefixes]
    return {"shared": shared, "below_block": below, "eviction": eviction}


def expected_reasons(load: str) -> list[str]:
    """The miss reason of each admission of `load`, in order ("": nothing missed)."""
    if load == "shared":
        return ["no_prefix", "", ""]
    if load == "below_block":
        return ["no_prefix", "below_block", "below_block"]
    return ["no_prefix"] * 3 + ["evicted"] * 3

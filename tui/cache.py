"""The prefix cache as the dashboard shows it, folded from events: per prefix (its first block's hash)
the requests that shared it, the tokens they were spared, the blocks it holds in the cache and its
last use; the recent evictions; hit rates over a sliding window, by tokens and by requests.

`CacheView.feed_*` are called by `DashboardModel` for the events they name; everything is bounded.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from batchtop.telemetry.events import BlocksCached, BlocksEvicted, RequestAdmitted

MAX_PREFIXES = 512              # prefixes tracked; the least recently used go first
MAX_EVICTIONS = 64              # recent eviction events kept
HIT_WINDOW_S = 10.0             # hit rates over the admissions of the last 10 s


@dataclass(slots=True)
class PrefixView:
    prefix_id: str
    num_requests: int = 0          # admissions that started with it
    num_sharing: int = 0           # of them, those that hit at least one block
    tokens_saved: int = 0          # cached tokens handed to them
    num_blocks: int = 0            # blocks of it in the cache now (cached minus evicted)
    last_use_t: float = 0.0


@dataclass(frozen=True, slots=True)
class EvictionView:
    step: int
    t: float
    num_blocks: int
    prefix_ids: tuple[str, ...]    # distinct, in order of eviction


class CacheView:
    def __init__(self):
        self.prefixes: OrderedDict[str, PrefixView] = OrderedDict()
        self.evictions: deque[EvictionView] = deque(maxlen=MAX_EVICTIONS)
        self.num_evicted_blocks = 0
        self.num_queried_tokens = 0
        self.num_cached_tokens = 0
        self.misses: dict[str, int] = {}               # admissions by miss reason ("" : nothing missed)
        self._window: deque[tuple[float, int, int]] = deque()   # (t, known tokens, cached tokens)

    def _prefix(self, prefix_id: str) -> PrefixView:
        view = self.prefixes.get(prefix_id)
        if view is None:
            view = self.prefixes[prefix_id] = PrefixView(prefix_id)
            if len(self.prefixes) > MAX_PREFIXES:
                self.prefixes.popitem(last=False)
        else:
            self.prefixes.move_to_end(prefix_id)
        return view

    def feed_admitted(self, e: RequestAdmitted) -> None:
        if not e.num_known_tokens:         # a log older than prefix caching: nothing is known
            return
        self.num_queried_tokens += e.num_known_tokens
        self.num_cached_tokens += e.num_cached_tokens
        self.misses[e.miss_reason] = self.misses.get(e.miss_reason, 0) + 1
        self._window.append((e.t, e.num_known_tokens, e.num_cached_tokens))
        if e.prefix_id:
            view = self._prefix(e.prefix_id)
            view.num_requests += 1
            view.num_sharing += e.num_cached_tokens > 0
            view.tokens_saved += e.num_cached_tokens
            view.last_use_t = e.t

    def feed_cached(self, e: BlocksCached) -> None:
        view = self._prefix(e.prefix_id)
        view.num_blocks += e.num_new_blocks
        view.last_use_t = e.t

    def feed_evicted(self, e: BlocksEvicted) -> None:
        self.num_evicted_blocks += len(e.block_ids)
        for prefix_id in e.prefix_ids:
            view = self.prefixes.get(prefix_id)
            if view is not None:
                view.num_blocks = max(0, view.num_blocks - 1)
        self.evictions.append(EvictionView(e.step, e.t, len(e.block_ids), tuple(dict.fromkeys(e.prefix_ids))))

    def hit_rates(self, now: float) -> tuple[float | None, float | None]:
        """(token hit rate, request hit rate) over the admissions of the last HIT_WINDOW_S; None
        without admissions. A request hits when it got at least one cached block."""
        window = self._window
        while window and window[0][0] <= now - HIT_WINDOW_S:
            window.popleft()
        if not window:
            return None, None
        known = sum(k for _, k, _ in window)
        hits = sum(1 for _, _, c in window if c > 0)
        return (sum(c for _, _, c in window) / known if known else 0.0), hits / len(window)

    def top_prefixes(self, n: int) -> list[PrefixView]:
        """The most shared prefixes: by requests that hit them, then tokens saved."""
        ranked = sorted(self.prefixes.values(), key=lambda p: (-p.num_sharing, -p.tokens_saved, p.prefix_id))
        return ranked[:n]

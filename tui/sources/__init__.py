"""Where the dashboard's events come from, and where its commands go: one module per kind of source.

- `base`: `Source` (the interface), `Poll`, `SourceDescription` (what a source can do).
- `feed`: `FeedSource`, events pushed by the caller (tests, synthetic streams).
- `replay`: `ReplaySource`, a recorded log: play/pause, speed, step forward/back, seek.
- `pair`: `ReplayPair`, a recorded log with a second one beside it, both on one clock.
- `loading`: `LoadingSource`, shown while the real source is built.
- `engine`: `EngineSource`, the in-process engine (the only source that imports batchtop.engine).
- `remote`: `RemoteSource`, a server's event stream over HTTP (batchtop serve, batchtop inside vLLM).
- `scrape`: `MetricsSource`, a stock vLLM or SGLang through `/metrics` (no per-step events).

Import `engine`, `remote` and `scrape` from their modules: this package pulls in none of them.
"""
from .base import ABILITIES, Poll, Source, SourceDescription
from .feed import FeedSource
from .loading import LoadingSource
from .replay import ReplaySource

__all__ = ["ABILITIES", "FeedSource", "LoadingSource", "Poll", "ReplaySource", "Source", "SourceDescription"]

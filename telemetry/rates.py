"""Sliding-window rates for a live view ("output tok/s over the last 10 s")."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

from .events import Event, PrefillChunk, RequestPreempted, RequestRetired, RequestRetracted, StepFinished


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


@dataclass(frozen=True)
class WindowRates:
    """Rates over the last `span_s` seconds (<= the window while the run is younger)."""
    span_s: float
    steps_per_s: float
    output_tok_per_s: float
    prefill_tok_per_s: float     # PrefillChunk tokens, recompute included
    tokens_per_s: float          # StepFinished.num_tokens, static padding rows included
    finished_per_s: float
    preemptions_per_s: float     # preemptions + retractions
    batch_utilisation: float | None
    padded_token_share: float | None   # CUDA-graph padding / (tokens + that padding); None when no step ran


class WindowedRates:
    """Sliding-window rates for a live view: O(1) per step, pruned on read.

    `rates(now)`: `now` defaults to the newest event time; pass `time.monotonic()`
    only when the engine runs in this process (same clock), so rates decay to
    zero while it idles.
    """

    _SERIES = ("steps", "output", "prefill", "tokens", "padded", "rows", "finished", "preemptions")

    def __init__(self, window_s: float = 10.0):
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.first_t: float | None = None
        self.last_t: float | None = None
        self._points: dict[str, deque[tuple[float, int]]] = {k: deque() for k in self._SERIES}
        self._sums: dict[str, int] = dict.fromkeys(self._SERIES, 0)

    def _add(self, series: str, t: float, value: int) -> None:
        self._points[series].append((t, value))
        self._sums[series] += value

    def feed(self, events: Iterable[Event]) -> None:
        for e in events:
            t = e.t
            if self.first_t is None:
                self.first_t = t
            if self.last_t is None or t > self.last_t:
                self.last_t = t
            kind = type(e)
            if kind is StepFinished:
                self._add("steps", t, 1)
                self._add("output", t, len(e.sampled_request_ids))
                self._add("tokens", t, e.num_tokens)
                self._add("padded", t, e.num_padded_tokens)
                self._add("rows", t, e.num_rows)
            elif kind is PrefillChunk:
                self._add("prefill", t, e.num_tokens)
            elif kind is RequestRetired:
                self._add("finished", t, 1)
            elif kind is RequestPreempted or kind is RequestRetracted:
                self._add("preemptions", t, 1)

    def _prune(self, cutoff: float) -> None:
        for series, points in self._points.items():
            while points and points[0][0] <= cutoff:
                self._sums[series] -= points.popleft()[1]

    def rates(self, now: float | None = None) -> WindowRates:
        if now is None:
            now = self.last_t if self.last_t is not None else 0.0
        self._prune(now - self.window_s)
        span = min(self.window_s, now - self.first_t) if self.first_t is not None else 0.0
        s = self._sums
        per_s = (lambda n: n / span) if span > 0 else (lambda n: 0.0)
        return WindowRates(
            span_s=max(span, 0.0),
            steps_per_s=per_s(s["steps"]),
            output_tok_per_s=per_s(s["output"]),
            prefill_tok_per_s=per_s(s["prefill"]),
            tokens_per_s=per_s(s["tokens"]),
            finished_per_s=per_s(s["finished"]),
            preemptions_per_s=per_s(s["preemptions"]),
            batch_utilisation=_ratio(s["output"], s["rows"]),
            padded_token_share=_ratio(s["padded"], s["tokens"] + s["padded"]),
        )

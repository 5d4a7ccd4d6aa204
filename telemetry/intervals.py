"""What one engine did between two scrapes of its `/metrics`: counter and histogram deltas.

`derive(earlier, later, dt)` turns two `ScrapedEngine`s into an `Interval`: scheduler steps
and tokens per step (vLLM's iteration-tokens histogram), admissions (first tokens),
retirements by finish reason, preemptions, prompt / generation tokens per second, prefix-cache
hit rate, TTFT / ITL / E2E percentiles of the requests seen in the interval, and the gauges as
of the later scrape. A counter that went down means the server restarted: the interval is
marked `reset` and, as Prometheus' rate() does, counts what the new server counted since it
started (the later value), never a negative rate. A figure with no series is None.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .exposition import Histogram, ScrapedEngine


@dataclass(frozen=True)
class Interval:
    engine: str
    t: float                                   # the later scrape's time
    dt: float
    reset: bool = False                        # a counter went down: the server restarted
    steps: float | None = None
    tokens_per_step: float | None = None
    admitted: float | None = None
    retired: float | None = None
    retired_by_reason: dict[str, float] = field(default_factory=dict)
    preemptions: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    prefix_hit_rate: float | None = None       # hits / queries over the interval, in tokens
    # name -> (p50, p99) s
    latency: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    running: float | None = None
    waiting: float | None = None
    waiting_by_reason: dict[str, float] = field(default_factory=dict)
    kv_usage: float | None = None
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    block_size: int | None = None

    def per_s(self, value: float | None) -> float | None:
        return None if value is None or self.dt <= 0 else value / self.dt

    @property
    def prompt_tok_s(self) -> float | None:
        return self.per_s(self.prompt_tokens)

    @property
    def gen_tok_s(self) -> float | None:
        return self.per_s(self.generation_tokens)

    @property
    def steps_per_s(self) -> float | None:
        return self.per_s(self.steps)


class _Deltas:
    """Counter deltas that remember whether any went down."""

    def __init__(self) -> None:
        self.reset = False

    def counter(self, earlier: float | None, later: float | None) -> float | None:
        if earlier is None or later is None:
            return None
        if later < earlier:
            self.reset = True
            return later
        return later - earlier

    def histogram(self, earlier: Histogram | None, later: Histogram | None) -> Histogram | None:
        if earlier is None or later is None:
            return None
        since = later.minus(earlier)
        if since is None:
            self.reset = True
            return later
        return since


def derive(earlier: ScrapedEngine, later: ScrapedEngine, t: float, dt: float) -> Interval:
    d = _Deltas()
    counters = {name: d.counter(earlier.counters.get(name), later.counters.get(name))
                for name in later.counters.keys() | earlier.counters.keys()}
    hists = {name: d.histogram(earlier.histograms.get(name), later.histograms.get(name))
             for name in later.histograms}
    by_reason = {reason: d.counter(earlier.finished.get(reason, 0.0), value)
                 for reason, value in later.finished.items()}
    steps_hist, ttft = hists.get("step_tokens"), hists.get("ttft")
    retired = counters.get("retired")
    if retired is None and later.finished:
        retired = sum(by_reason.values())
    if "aborted" in counters and counters["aborted"] is not None:
        by_reason.setdefault("abort", counters["aborted"])
    queries, hits = counters.get("prefix_queries"), counters.get("prefix_hits")
    return Interval(
        engine=later.engine, t=t, dt=dt, reset=d.reset,
        steps=steps_hist.count if steps_hist else None,
        tokens_per_step=steps_hist.sum / steps_hist.count if steps_hist and steps_hist.count else None,
        admitted=ttft.count if ttft else None,
        retired=retired, retired_by_reason={k: v for k, v in by_reason.items() if v},
        preemptions=counters.get("preemptions"),
        prompt_tokens=counters.get("prompt_tokens"), generation_tokens=counters.get("generation_tokens"),
        prefix_hit_rate=hits / queries if queries and hits is not None else None,
        latency={name: (h.quantile(0.5), h.quantile(0.99)) for name, h in hists.items()
                 if h is not None and name != "step_tokens"},
        running=later.running, waiting=later.waiting, waiting_by_reason=dict(later.waiting_by_reason),
        kv_usage=later.kv_usage, kv_blocks_used=later.kv_blocks_used, kv_blocks_total=later.kv_blocks_total,
        block_size=later.block_size)

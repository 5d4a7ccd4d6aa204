"""A server's Prometheus `/metrics` text read into one snapshot per engine (vLLM or SGLang names).

`parse_exposition(text, t)` parses with prometheus_client's text parser and maps the series of
the server's flavour (`vllm:` or `sglang:` names, table `FLAVOURS`) onto the same fields. A
series the server does not export stays None (or absent from a dict): never a zero it did
not say. Series are grouped per engine by their identity labels (vLLM: model_name + engine;
SGLang: model_name); vLLM's `cache_config_info`, which has no model_name, joins by engine.
Deltas between two snapshots are `telemetry/intervals.py`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Flavour:
    """Where one server keeps each figure; names are sample names as exposed (counters end in _total)."""
    name: str
    prefix: str
    identity: tuple[str, ...]                  # labels that tell one engine from another
    running: str
    waiting: str
    kv_usage: tuple[str, ...]                  # 0..1; the first name present wins (old names after)
    counters: dict[str, tuple[str, ...]]       # field -> sample names, first present wins
    histograms: dict[str, tuple[str, ...]]     # field -> histogram base names
    finished: str | None = None                # counter with a finish-reason label
    finished_label: str = "finished_reason"
    waiting_by_reason: str | None = None
    cache_info: str | None = None              # info gauge with num_gpu_blocks and block_size labels
    kv_tokens_total: str | None = None         # gauge: pool size in tokens (SGLang)
    gen_throughput: str | None = None          # the server's own tok/s gauge (SGLang)
    ignore: dict[str, str] = field(default_factory=dict)   # label -> value kept (others dropped)


VLLM = Flavour(
    name="vllm", prefix="vllm:", identity=("model_name", "engine"),
    running="vllm:num_requests_running", waiting="vllm:num_requests_waiting",
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    counters={
        "prompt_tokens": ("vllm:prompt_tokens_total",),
        "generation_tokens": ("vllm:generation_tokens_total",),
        "preemptions": ("vllm:num_preemptions_total",),
        "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    },
    histograms={
        "step_tokens": ("vllm:iteration_tokens_total",),
        "ttft": ("vllm:time_to_first_token_seconds",),
        "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        "e2e": ("vllm:e2e_request_latency_seconds",),
    },
    finished="vllm:request_success_total", waiting_by_reason="vllm:num_requests_waiting_by_reason",
    cache_info="vllm:cache_config_info",
)

# SGLang (python/sglang/srt/metrics/collector.py). Scheduler series carry tp/pp/ep ranks, the
# tokenizer's only model_name: engines are told apart by model_name, and ranks other than 0
# (which repeat rank 0's batch) are dropped.
SGLANG = Flavour(
    name="sglang", prefix="sglang:", identity=("model_name",),
    running="sglang:num_running_reqs", waiting="sglang:num_queue_reqs", kv_usage=("sglang:token_usage",),
    counters={
        "prompt_tokens": ("sglang:prompt_tokens_total",),
        "generation_tokens": ("sglang:generation_tokens_total",),
        "preemptions": ("sglang:num_retracted_requests_total",),
        "prefix_queries": ("sglang:prompt_tokens_total",),
        "prefix_hits": ("sglang:cached_tokens_total",),
        "retired": ("sglang:num_requests_total",),
        "aborted": ("sglang:num_aborted_requests_total",),
    },
    histograms={
        "ttft": ("sglang:time_to_first_token_seconds",),
        "itl": ("sglang:inter_token_latency_seconds",),
        "e2e": ("sglang:e2e_request_latency_seconds",),
    },
    kv_tokens_total="sglang:max_total_num_tokens", gen_throughput="sglang:gen_throughput",
    ignore={"tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"},
)

FLAVOURS = (VLLM, SGLANG)


@dataclass(frozen=True)
class Histogram:
    """Cumulative buckets as exposed: (upper bound, observations ≤ bound), ascending, +Inf last."""
    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    def minus(self, earlier: Histogram) -> Histogram | None:
        """The observations made since `earlier`; None when the server restarted in between
        (a count went down) or the buckets changed."""
        if self.count < earlier.count or [b for b, _ in self.buckets] != [b for b, _ in earlier.buckets]:
            return None
        if any(now < then for (_, now), (_, then) in zip(self.buckets, earlier.buckets)):
            return None
        return Histogram(tuple((b, now - then) for (b, now), (_, then) in zip(self.buckets, earlier.buckets)),
                         self.count - earlier.count, self.sum - earlier.sum)

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket that holds rank q·count (as Prometheus'
        histogram_quantile); an answer in the +Inf bucket is the highest finite bound."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower_bound
                if cumulative == lower_count:
                    return bound
                return lower_bound + (bound - lower_bound) * (rank - lower_count) / (cumulative - lower_count)
            lower_bound, lower_count = bound, cumulative
        return lower_bound


@dataclass(frozen=True)
class ScrapedEngine:
    """One engine's figures in one scrape; None where the server exports no such series."""
    engine: str                                  # identity labels, e.g. "smollm2 engine=0"
    running: float | None = None
    waiting: float | None = None
    waiting_by_reason: dict[str, float] = field(default_factory=dict)
    kv_usage: float | None = None                # 0..1
    kv_blocks_total: int | None = None
    block_size: int | None = None                # tokens per block (1 where the pool is counted in tokens)
    gen_throughput: float | None = None
    counters: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)     # finish reason -> requests
    histograms: dict[str, Histogram] = field(default_factory=dict)

    @property
    def kv_blocks_used(self) -> int | None:
        if self.kv_usage is None or self.kv_blocks_total is None:
            return None
        return round(self.kv_usage * self.kv_blocks_total)


@dataclass(frozen=True)
class Scrape:
    t: float                                     # when it was read (the reader's monotonic clock)
    flavour: str | None                          # "vllm", "sglang", or None: neither kind of name
    engines: dict[str, ScrapedEngine]


def detect_flavour(text: str) -> str | None:
    """'vllm' or 'sglang' when the exposition has such series (ValueError when it is not Prometheus text)."""
    names = {family.name for family in text_string_to_metric_families(text)}
    for flavour in FLAVOURS:
        if any(name.startswith(flavour.prefix) for name in names):
            return flavour.name
    return None


def parse_exposition(text: str, t: float, flavour: str | None = None) -> Scrape:
    """The engines in `text` (ValueError on text prometheus_client cannot parse)."""
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    spec = _flavour(flavour, samples)
    if spec is None:
        return Scrape(t, None, {})
    return Scrape(t, spec.name, _Reader(spec, samples).engines())


def _flavour(name: str | None, samples: dict) -> Flavour | None:
    for spec in FLAVOURS:
        if spec.name == name or name is None and any(s.startswith(spec.prefix) for s in samples):
            return spec
    return None


class _Reader:
    """Groups one flavour's samples by engine and fills the snapshot fields."""

    def __init__(self, spec: Flavour, samples: dict[str, list[tuple[dict, float]]]):
        self.spec = spec
        self.samples = {name: [(labels, value) for labels, value in series if self._kept(labels)]
                        for name, series in samples.items()}

    def _kept(self, labels: dict) -> bool:
        return all(labels.get(k, v) == v for k, v in self.spec.ignore.items())

    def _key(self, labels: dict) -> str:
        return " ".join(f"{k}={labels[k]}" if k != "model_name" else labels[k]
                        for k in self.spec.identity if k in labels) or "server"

    def _per_engine(self, name: str, reduce_label: str | None = None) -> dict[str, dict[str, float]]:
        """engine -> {label value (or "") -> value} for sample `name`."""
        out: dict[str, dict[str, float]] = {}
        for labels, value in self.samples.get(name, ()):
            sub = labels.get(reduce_label, "") if reduce_label else ""
            bucket = out.setdefault(self._key(labels), {})
            bucket[sub] = bucket.get(sub, 0.0) + value
        return out

    def _first(self, names: tuple[str, ...]) -> dict[str, float]:
        for name in names:
            if name in self.samples:
                return {engine: values[""] for engine, values in self._per_engine(name).items()}
        return {}

    def engines(self) -> dict[str, ScrapedEngine]:
        spec = self.spec
        running, waiting = self._first((spec.running,)), self._first((spec.waiting,))
        kv_usage = self._first(spec.kv_usage)
        counters = {field_: self._first(names) for field_, names in spec.counters.items()}
        histograms = {field_: self._histograms(names) for field_, names in spec.histograms.items()}
        finished = self._per_engine(spec.finished, spec.finished_label) if spec.finished else {}
        by_reason = self._per_engine(spec.waiting_by_reason, "reason") if spec.waiting_by_reason else {}
        throughput = self._first((spec.gen_throughput,)) if spec.gen_throughput else {}
        keys = set(running) | set(waiting) | set(kv_usage) | set(finished)
        for values in (*counters.values(), *histograms.values()):
            keys |= set(values)
        pools = self._pools(keys)
        out = {}
        for key in sorted(keys):
            blocks, block_size = pools.get(key, (None, None))
            out[key] = ScrapedEngine(
                engine=key, running=running.get(key), waiting=waiting.get(key),
                waiting_by_reason=by_reason.get(key, {}), kv_usage=kv_usage.get(key),
                kv_blocks_total=blocks, block_size=block_size, gen_throughput=throughput.get(key),
                counters={f: v[key] for f, v in counters.items() if key in v},
                finished=finished.get(key, {}),
                histograms={f: v[key] for f, v in histograms.items() if key in v})
        return out

    def _pools(self, keys: set[str]) -> dict[str, tuple[int | None, int | None]]:
        """engine -> (pool blocks, tokens per block)."""
        spec, out = self.spec, {}
        if spec.cache_info:
            for labels, _ in self.samples.get(spec.cache_info, ()):
                blocks, size = _int(labels.get("num_gpu_blocks")), _int(labels.get("block_size"))
                for key in keys:              # no model_name on this series: join by engine
                    if labels.get("engine") is None or key.endswith(f"engine={labels['engine']}"):
                        out[key] = (blocks, size)
        if spec.kv_tokens_total:
            for key, tokens in self._first((spec.kv_tokens_total,)).items():
                out[key] = (int(tokens), 1)
        return out

    def _histograms(self, bases: tuple[str, ...]) -> dict[str, Histogram]:
        for base in bases:
            if f"{base}_count" not in self.samples:
                continue
            buckets: dict[str, list[tuple[float, float]]] = {}
            for labels, value in self.samples.get(f"{base}_bucket", ()):
                buckets.setdefault(self._key(labels), []).append((float(labels["le"]), value))
            counts = self._first((f"{base}_count",))
            sums = self._first((f"{base}_sum",))
            return {key: Histogram(tuple(sorted(buckets.get(key, []))), count, sums.get(key, 0.0))
                    for key, count in counts.items()}
        return {}


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text not in (None, "None") else None
    except ValueError:
        return None

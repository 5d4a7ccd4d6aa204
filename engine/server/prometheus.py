"""The server's Prometheus metrics, derived from telemetry events, in a prometheus_client registry.

batchtop's own names come first; the names a vLLM Grafana dashboard reads follow where the
meaning is the same (so `batchtop top --url` and vLLM dashboards read them alike). Gauges
(running, waiting, KV use) are as of the last step. Each server has a registry of its own:
two servers in one process (the tests) never share a series.
"""
from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from batchtop.telemetry import events as ev

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Family:
    """The same figure under batchtop's name and vLLM's: one call updates both."""

    def __init__(self, *metrics):
        self.metrics = metrics

    def inc(self, amount: float = 1.0) -> None:
        for metric in self.metrics:
            metric.inc(amount)

    def set(self, value: float) -> None:
        for metric in self.metrics:
            metric.set(value)

    def observe(self, value: float) -> None:
        for metric in self.metrics:
            metric.observe(value)


class ServerMetrics:
    """Fold events (in publication order) into counters, gauges and latency histograms."""

    def __init__(self, model_name: str, knobs: dict | None = None):
        self.model_name = model_name
        self.registry = registry = CollectorRegistry()
        model = {"model_name": model_name}

        def gauge(name, text, labels=()):
            return Gauge(name, text, ("model_name", *labels), registry=registry)

        def counter(name, text, labels=()):
            return Counter(name, text, ("model_name", *labels), registry=registry)

        def histogram(name, text, buckets):
            return Histogram(name, text, ("model_name",), buckets=buckets, registry=registry).labels(**model)

        self.running = _Family(gauge("batchtop_requests_running",
                                     "Requests in the running batch (as of the last "
                                     "step).").labels(**model),
                               gauge("vllm:num_requests_running", "Number of requests in model execution "
                                     "batches.").labels(**model))
        self.waiting = _Family(gauge("batchtop_requests_waiting",
                                     "Requests waiting for admission.").labels(**model),
                               gauge("vllm:num_requests_waiting", "Number of requests waiting to be "
                                     "processed.").labels(**model))
        self.kv_used = gauge("batchtop_kv_blocks_used", "KV cache blocks in use.").labels(**model)
        self.kv_total = gauge("batchtop_kv_blocks_total", "KV cache blocks in the pool.").labels(**model)
        # vLLM's *_perc gauges are fractions too
        self.kv_usage = _Family(*(gauge(name, text).labels(**model) for name, text in (
            ("batchtop_kv_cache_usage_ratio", "Fraction of the KV pool in use (0..1)."),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."))))
        self.steps = counter("batchtop_steps_total", "Engine steps run.").labels(**model)
        any_preemption = counter("vllm:num_preemptions_total",
                                 "Cumulative number of preemptions (retractions "
                                 "included).").labels(**model)
        self.preemptions = _Family(counter("batchtop_preemptions_total",
                                           "Recompute preemptions.").labels(**model),
                                   any_preemption)
        self.retractions = _Family(counter("batchtop_retractions_total", "Retractions.").labels(**model),
                                   any_preemption)
        self.prompt_tokens = _Family(
            counter("batchtop_prompt_tokens_total",
                    "Prompt tokens of requests that got a first token.").labels(**model),
            counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.").labels(**model))
        self.generation_tokens = _Family(
            counter("batchtop_generation_tokens_total", "Output tokens sampled.").labels(**model),
            counter("vllm:generation_tokens_total", "Number of generation tokens processed.").labels(**model))
        # vLLM's names and meaning: queried tokens at each first admission, of which cached
        self.prefix_queries = counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms "
                                      "of number of queried tokens.").labels(**model)
        self.prefix_hits = counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number "
                                   "of cached tokens.").labels(**model)
        self.events_dropped = counter("batchtop_events_dropped_total",
                                      "Telemetry events the server lost.").labels(**model)
        self.paused = gauge("batchtop_paused", "1 while the engine loop is paused.").labels(**model)
        self._finished = counter("batchtop_requests_finished_total",
                                 "Requests retired, by reason.", ("reason",))
        self._success = counter("vllm:request_success_total", "Count of successfully processed requests.",
                                ("finished_reason",))
        self._knob = gauge("batchtop_knob", "Numeric engine knobs.", ("name",))
        waited = counter("batchtop_request_waiting_seconds_total",
                         "Seconds requests spent in the waiting queue, by "
                         "what stopped admission (counted when each wait ends).", ("reason",))
        self._waited_s = {r: waited.labels(model_name=model_name, reason=r) for r in ev.WAIT_REASONS}
        blocked = gauge("batchtop_admission_blocked",
                        "1 for what stops admission at the head of the waiting queue "
                        "now (all 0 when nobody waits).", ("reason",))
        self._blocked = {r: blocked.labels(model_name=model_name, reason=r) for r in ev.WAIT_REASONS
                         if r != "next_step"}
        self.waiting_s = dict.fromkeys(ev.WAIT_REASONS, 0.0)   # request-seconds in the queue, by reason
        self.admission_blocked: str | None = None              # the reason, while anyone waits
        self.ttft = _Family(
            histogram("batchtop_time_to_first_token_seconds",
                      "Time to first token (from arrival).", TTFT_BUCKETS),
            histogram("vllm:time_to_first_token_seconds",
                      "Histogram of time to first token in seconds.", TTFT_BUCKETS))
        self.itl = _Family(
            histogram("batchtop_inter_token_latency_seconds", "Gap between consecutive tokens of a request.",
                      ITL_BUCKETS),
            histogram("vllm:inter_token_latency_seconds",
                      "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
            histogram("vllm:time_per_output_token_seconds",
                      "Histogram of time per output token in seconds (per "
                      "token, as vLLM's legacy metric).", ITL_BUCKETS))
        self.tpot = _Family(
            histogram("batchtop_time_per_output_token_seconds", "Per-request mean time per output token.",
                      ITL_BUCKETS),
            histogram("vllm:request_time_per_output_token_seconds",
                      "Histogram of time_per_output_token_seconds "
                      "per request.", ITL_BUCKETS))
        self.e2e = _Family(
            histogram("batchtop_e2e_request_latency_seconds", "Arrival to retirement.", E2E_BUCKETS),
            histogram("vllm:e2e_request_latency_seconds",
                      "Histogram of e2e request latency in seconds.", E2E_BUCKETS))
        self.finished: Tally = Tally()          # reason -> requests (the abort tests read it)
        self._arrival: dict[str, tuple[float, int]] = {}     # request id -> (t, prompt tokens)
        self._first: dict[str, float] = {}
        self._last_sample: dict[str, float] = {}
        self._num_waiting = 0
        for name, value in (knobs or {}).items():
            self._set_knob(name, value)

    def feed(self, events) -> None:
        for e in events:
            kind = type(e)
            if kind is ev.StepFinished:
                self._step(e)
            elif kind is ev.StepPlanned:
                self._queues(e.num_running, e.num_waiting, e.kv_blocks_used, e.kv_blocks_total)
                if not e.num_waiting:
                    self._set_blocked(None)
            elif kind is ev.RequestAdmitted:
                self._waited(e)
                if not e.resumed:                 # vLLM counts a preempted request's lookups apart
                    self.prefix_queries.inc(e.num_known_tokens)
                    self.prefix_hits.inc(e.num_cached_tokens)
            elif kind is ev.AdmissionBlocked:
                self._set_blocked(e.reason)
            elif kind is ev.RequestArrived:
                self._arrival[e.request_id] = (e.arrival_t, e.num_prompt_tokens)
                self._num_waiting += 1
                self.waiting.set(self._num_waiting)
            elif kind is ev.FirstToken:
                self._first[e.request_id] = e.t
                self.ttft.observe(e.ttft_s)
                arrival = self._arrival.get(e.request_id)
                if arrival is not None:
                    self.prompt_tokens.inc(arrival[1])
            elif kind is ev.RequestRetired:
                self._waited(e)
                self._retired(e)
            elif kind is ev.RequestPreempted:
                self.preemptions.inc()
            elif kind is ev.RequestRetracted:
                self.retractions.inc()
            elif kind is ev.KnobChanged:
                self._set_knob(e.name, e.new)
            elif kind is ev.EnginePaused or kind is ev.EngineResumed:
                self.paused.set(int(kind is ev.EnginePaused))
            elif kind is ev.EventsDropped:
                self.events_dropped.inc(e.count)

    def _queues(self, num_running: int, num_waiting: int, kv_used: int, kv_total: int) -> None:
        self._num_waiting = num_waiting
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_used.set(kv_used)
        self.kv_total.set(kv_total)
        self.kv_usage.set(kv_used / kv_total if kv_total else 0.0)

    def _set_knob(self, name: str, value) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self._knob.labels(model_name=self.model_name, name=name).set(value)

    def _waited(self, e: ev.RequestAdmitted | ev.RequestRetired) -> None:
        for reason, seconds in zip(e.wait_reasons, e.wait_s):
            self.waiting_s[reason] = self.waiting_s.get(reason, 0.0) + seconds
            self._waited_s[reason].inc(seconds)

    def _set_blocked(self, reason: str | None) -> None:
        if reason != self.admission_blocked:
            for name, gauge in self._blocked.items():
                gauge.set(int(name == reason))
            self.admission_blocked = reason

    def _step(self, e: ev.StepFinished) -> None:
        self.steps.inc()
        self._queues(e.num_running, e.num_waiting, e.kv_blocks_used, e.kv_blocks_total)
        ids = e.sampled_request_ids
        self.generation_tokens.inc(len(ids))
        last = self._last_sample
        for request_id in ids:
            before = last.get(request_id)
            if before is not None:
                self.itl.observe(e.t - before)
            last[request_id] = e.t

    def _retired(self, e: ev.RequestRetired) -> None:
        self.finished[e.reason] += 1
        self._finished.labels(model_name=self.model_name, reason=e.reason).inc()
        if e.reason != "abort":          # vLLM's success counter leaves aborts out
            self._success.labels(model_name=self.model_name, finished_reason=e.reason).inc()
        arrival = self._arrival.pop(e.request_id, None)
        first = self._first.pop(e.request_id, None)
        self._last_sample.pop(e.request_id, None)
        if arrival is not None:
            self.e2e.observe(e.t - arrival[0])
        if first is not None and e.num_output_tokens >= 2:
            self.tpot.observe((e.t - first) / (e.num_output_tokens - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

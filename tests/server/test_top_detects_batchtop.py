"""`batchtop top --url` finds batchtop's event stream first, though batchtop serve also exports vLLM's
names."""
from batchtop.tui.sources.scrape import detect


def test_detects_batchtop_serve_before_its_vllm_names(base_url):
    assert detect(base_url) == "events"


def test_batchtop_metrics_read_as_vllm_names(base_url):
    """prometheus_client writes batchtop's /metrics; the vLLM names in it parse as a vLLM engine would."""
    import httpx

    from batchtop.telemetry.exposition import parse_exposition
    text = httpx.get(base_url + "/metrics").text
    assert "# TYPE batchtop_steps_total counter" in text
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text
    (snapshot,) = parse_exposition(text, 0.0, "vllm").engines.values()
    assert snapshot.engine == "tiny" and snapshot.running is not None and snapshot.kv_usage is not None
    assert {"prompt_tokens", "generation_tokens", "preemptions"} <= set(snapshot.counters)
    assert {"ttft", "itl", "e2e"} <= set(snapshot.histograms)

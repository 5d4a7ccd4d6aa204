"""`batchtop top --url` finds batchtop's event stream first, though batchtop serve also exports vLLM's names."""
from batchtop.tui.metrics_source import detect


def test_detects_batchtop_serve_before_its_vllm_names(base_url):
    assert detect(base_url).kind == "events"

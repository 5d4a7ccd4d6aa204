"""Telemetry: the event schema, the bus, the recorder and the metrics derived from events.

Imports nothing else of batchtop. See docs/events.md.
"""
from .bus import EventBus, EventLog, Subscription
from .events import SCHEMA_VERSION, Event, event_from_dict
from .export import summary_text, to_chrome_trace, to_csv
from .rates import WindowedRates
from .recorder import (
    LogFormatError,
    LogReader,
    Recorder,
    decode_event,
    encode_event,
    iter_log,
    read_log,
)
from .run_stats import Metrics, MetricsSummary, percentile, summarize
from .state import BatchState, RequestState

__all__ = [
    "SCHEMA_VERSION", "Event", "event_from_dict",
    "EventBus", "EventLog", "Subscription",
    "Recorder", "LogReader", "LogFormatError", "read_log", "iter_log", "encode_event", "decode_event",
    "Metrics", "MetricsSummary", "WindowedRates", "percentile", "summarize", "BatchState", "RequestState",
    "to_chrome_trace", "to_csv", "summary_text",
]

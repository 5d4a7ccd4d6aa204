"""A fleet recording exported with its engines named: one Chrome/Perfetto trace where each engine is
its own pair of processes ("NAME: batch", "NAME: engine") on one time axis, a CSV with an `engine`
column, a summary per engine.
"""
from __future__ import annotations

from .events import Event
from .export import ENGINE_PID, summary_text, to_chrome_trace, to_csv

PIDS_PER_ENGINE = ENGINE_PID


def fleet_chrome_trace(header: dict, engines: dict[str, tuple[dict, list[Event]]]) -> dict:
    """Each engine's trace, its pids moved past the engines before it, on the earliest origin of all."""
    starts = [e.t for _, events in engines.values() for e in events[:1]]
    starts += [h["start_monotonic"] for h, _ in engines.values()
               if isinstance(h.get("start_monotonic"), (int, float))]
    origin = min(starts) if starts else 0.0
    out: list[dict] = []
    for i, (name, (own_header, events)) in enumerate(engines.items()):
        trace = to_chrome_trace({**own_header, "start_monotonic": origin}, events)
        for entry in trace["traceEvents"]:
            entry["pid"] += i * PIDS_PER_ENGINE
            if entry.get("ph") == "M" and entry.get("name") == "process_name":
                entry["args"] = {"name": f"{name}: {entry['args']['name']}"}
            elif entry.get("ph") == "M" and entry.get("name") == "process_sort_index":
                entry["args"] = {"sort_index": entry["args"]["sort_index"] + i * PIDS_PER_ENGINE}
            elif entry.get("ph") != "M":
                entry.setdefault("args", {})["engine"] = name
        out += trace["traceEvents"]
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"header": header}}


def fleet_csv(engines: dict[str, tuple[dict, list[Event]]]) -> str:
    """to_csv of every engine, one header line, each row led by its engine's name."""
    lines: list[str] = []
    for name, (_, events) in engines.items():
        head, *rows = to_csv(events).splitlines()
        if not lines:
            lines.append("engine," + head)
        lines += [_csv_cell(name) + "," + row for row in rows]
    return "\n".join(lines) + "\n"


def _csv_cell(text: str) -> str:
    return '"' + text.replace('"', '""') + '"' if any(c in text for c in ',"\n') else text


def fleet_summary(engines: dict[str, tuple[dict, list[Event]]]) -> str:
    return "\n".join(f"== engine {name} ({h.get('url', '?')}) ==\n{summary_text(h, events).rstrip()}\n"
                     for name, (h, events) in engines.items())

import csv
import io
import json

import pytest

from batchtop.telemetry.events import (
    FirstToken, KnobChanged, RequestAdmitted, RequestArrived, RequestPreempted, RequestRetired,
    RowMoved, StepFinished, StepPlanned,
)
from batchtop.telemetry.export import summary_text, to_chrome_trace, to_csv
from telemetry_samples import one_of_each, static_batch

HEADER = {"kind": "Header", "schema_version": 1, "model": "tiny", "knobs": {},
          "start_time": "2025-01-01T00:00:00+00:00", "start_monotonic": 0.5}


def finished(k, t, sampled, kv=5, running=3, waiting=1, tokens=12):
    return StepFinished(k, t, 3, tokens, tuple(sampled), running, waiting, kv, 64,
                        0.001, 0.002, 0.010, 0.003, 0.004)


def lifetimes():
    return [
        RequestArrived(0, 0.9, "a", 4, 8, 0),
        RequestArrived(0, 0.9, "b", 4, 8, 0),
        RequestArrived(0, 0.9, "c", 4, 8, 0),
        StepPlanned(1, 1.0, 8, 0, 2, 0, 0, 512, 2, 1, 2, 64),
        RequestAdmitted(1, 1.0, "a", 0, 0, False),
        RequestAdmitted(1, 1.0, "b", 1, 0, False),
        RequestAdmitted(2, 1.5, "c", 2, 0, False),
        finished(2, 1.6, ["a", "b"], kv=7),
        FirstToken(2, 1.6, "a", 0.7),
        FirstToken(2, 1.6, "b", 0.7),
        KnobChanged(3, 2.0, "max_num_seqs", 3, 4, "tui"),
        RequestRetired(4, 3.0, "a", "stop", 0, 4, 2),
        RowMoved(4, 3.0, "c", 2, 0, 1024),
        RequestPreempted(5, 3.5, "b", 1, 2, 5, "kv pool dry"),
        RequestAdmitted(6, 4.0, "b", 1, 0, True),
        RequestRetired(7, 5.0, "b", "length", 1, 4, 8),
        RequestArrived(7, 5.2, "d", 4, 8, 0),
        RequestAdmitted(8, 5.5, "d", 2, 0, False),
        RequestRetired(9, 6.0, "c", "stop", 0, 4, 3),
    ]


def slices(trace):
    return [(e["name"], e["tid"], e["ts"], e["dur"], e["args"]["end"])
            for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") == "request"]


def test_trace_is_json_with_a_named_track_per_slot():
    trace = json.loads(json.dumps(to_chrome_trace(HEADER, lifetimes())))
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    slot_tracks = {tid: name for (pid, tid), name in names.items() if pid == 1}
    assert slot_tracks == {1: "slot 0", 2: "slot 1", 3: "slot 2"}
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {1: "batch (tiny)", 2: "engine"}
    assert trace["otherData"]["header"]["model"] == "tiny"


def test_request_slices_follow_moves_and_preemptions():
    got = sorted(slices(to_chrome_trace(HEADER, lifetimes())), key=lambda s: (s[0], s[2]))
    expected = [   # µs since start_monotonic = 0.5
        ("a", 1, 0.5e6, 2.0e6, "retired:stop"),
        ("b", 2, 0.5e6, 2.5e6, "preempted"),
        ("b", 2, 3.5e6, 1.0e6, "retired:length"),
        ("c", 3, 1.0e6, 1.5e6, "moved to slot 0"),
        ("c", 1, 2.5e6, 3.0e6, "retired:stop"),
        ("d", 3, 5.0e6, 0.5e6, "open at end of log"),
    ]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g[:2] == e[:2] and g[4] == e[4]
        assert g[2] == pytest.approx(e[2]) and g[3] == pytest.approx(e[3])
    resumed = [e["args"]["resumed"] for e in to_chrome_trace(HEADER, lifetimes())["traceEvents"]
               if e.get("cat") == "request" and e["ph"] == "X" and e["name"] == "b"]
    assert sorted(resumed) == [False, True]


def test_counters_and_step_slices():
    trace = to_chrome_trace(HEADER, lifetimes())
    counters = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "C":
            counters.setdefault(e["name"], []).append(e["args"])
    assert counters["kv_blocks_used"] == [{"used": 7}]
    assert counters["running_rows"] == [{"running": 3}]
    assert counters["waiting_rows"] == [{"waiting": 1}]
    assert counters["tokens_per_step"] == [{"tokens": 12}]
    assert counters["scheduled_tokens"] == [{"prefill": 8, "decode": 0}]
    step = next(e for e in trace["traceEvents"] if e.get("cat") == "step")
    assert step["name"] == "step 2" and step["dur"] == pytest.approx(20_000)
    assert step["ts"] + step["dur"] == pytest.approx((1.6 - 0.5) * 1e6)
    phases = [e for e in trace["traceEvents"] if e.get("cat") == "phase"]
    assert [p["name"] for p in phases] == ["schedule", "prepare", "forward", "sample", "update"]
    assert phases[-1]["ts"] + phases[-1]["dur"] == pytest.approx(step["ts"] + step["dur"])
    knob = next(e for e in trace["traceEvents"] if e.get("cat") == "engine")
    assert knob["name"] == "max_num_seqs: 3 -> 4" and knob["ph"] == "i"


def test_trace_without_header_and_of_every_kind():
    trace = to_chrome_trace(None, one_of_each())
    json.loads(json.dumps(trace))
    assert min(e["ts"] for e in trace["traceEvents"] if e["ph"] != "M") >= 0
    assert to_chrome_trace(None, [])["traceEvents"]


def test_static_batch_trace_has_eight_slots():
    trace = to_chrome_trace(None, static_batch())
    got = slices(trace)
    assert sorted(s[1] for s in got) == list(range(1, 9))
    longest = max(got, key=lambda s: s[3])
    assert longest[0] == "r0" and longest[3] == pytest.approx(1024 * 0.01 * 1e6)


def test_csv_per_request():
    rows = list(csv.DictReader(io.StringIO(to_csv(lifetimes()))))
    assert [r["request_id"] for r in rows] == ["a", "b", "c", "d"]
    b = rows[1]
    assert float(b["arrival"]) == 0.0          # relative to the first event, t = 0.9
    assert float(b["admitted"]) == pytest.approx(0.1)
    assert float(b["first_token"]) == pytest.approx(0.7)
    assert float(b["finished"]) == pytest.approx(4.1)
    assert b["reason"] == "length"
    assert (b["prompt_tokens"], b["output_tokens"], b["preemptions"]) == ("4", "8", "1")
    assert float(b["ttft"]) == pytest.approx(0.7)
    assert float(b["tpot"]) == pytest.approx((5.0 - 1.6) / 7)
    d = rows[3]
    assert d["finished"] == "" and d["reason"] == "" and d["ttft"] == "" and d["tpot"] == ""
    raw = list(csv.DictReader(io.StringIO(to_csv(lifetimes(), t0=0.0))))
    assert float(raw[0]["arrival"]) == pytest.approx(0.9)


def test_summary_text_static_batch():
    text = summary_text(HEADER, static_batch())
    assert "steps             1024" in text
    assert "total 8192  useful 1968" in text
    assert "batch utilisation 0.240" in text
    for word in ("throughput", "TTFT", "TPOT", "p50", "p90", "p99", "preemptions",
                 "retractions", "recompute tax"):
        assert word in text
    assert "model tiny" in text


def test_summary_text_of_empty_run():
    text = summary_text(None, [])
    assert "batch utilisation n/a" in text and "TTFT   n/a" in text


def test_trace_survives_missing_ends():
    # the retirement of "x" was lost (a dropped-events gap): its slice ends where "y" takes the slot
    events = [
        RequestAdmitted(1, 1.0, "x", 0, 0, False),
        RequestAdmitted(5, 2.0, "y", 0, 0, False),
        RequestRetired(6, 3.0, "y", "stop", 0, 1, 1),
        RequestRetired(7, 4.0, "ghost", "abort", -1, 1, 0),     # never admitted: no slice
    ]
    got = sorted(slices(to_chrome_trace(None, events)))
    assert got == [("x", 1, 0.0, 1e6, "unknown"), ("y", 1, 1e6, 1e6, "retired:stop")]


def test_phase_slices_nest_inside_their_step():
    import random
    rng = random.Random(0)
    events = [StepFinished(k, 1000.0 + k * 0.0137, 1, 1, (), 0, 0, 0, 1,
                           *(rng.random() * 1e-3 for _ in range(5))) for k in range(1, 200)]
    trace = to_chrome_trace(None, events)
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    phases = [e for e in trace["traceEvents"] if e.get("cat") == "phase"]
    for i, step in enumerate(steps):
        for p in phases[5 * i: 5 * i + 5]:
            assert step["ts"] <= p["ts"] and p["ts"] + p["dur"] <= step["ts"] + step["dur"]

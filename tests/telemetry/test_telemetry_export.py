import csv
import io
import json

import pytest
from telemetry_samples import one_of_each, static_batch

from batchtop.telemetry.events import (
    FirstToken,
    KnobChanged,
    RequestAdmitted,
    RequestArrived,
    RequestPreempted,
    RequestRetired,
    RowMoved,
    StepFinished,
    StepPlanned,
)
from batchtop.telemetry.export import summary_text, to_chrome_trace, to_csv

HEADER = {"kind": "Header", "schema_version": 1, "model": "tiny", "knobs": {},
          "start_time": "2025-01-01T00:00:00+00:00", "start_monotonic": 0.5}


def finished(k, t, sampled, kv=5, running=3, waiting=1, tokens=12):
    return StepFinished(step=k, t=t, num_rows=3, num_tokens=tokens, sampled_request_ids=tuple(sampled),
                        num_running=running, num_waiting=waiting, kv_blocks_used=kv, kv_blocks_total=64,
                        schedule_s=0.001, prepare_s=0.002, forward_s=0.010, sample_s=0.003, update_s=0.004)


def lifetimes():
    return [
        RequestArrived(step=0, t=0.9, request_id="a", num_prompt_tokens=4, max_tokens=8, priority=0),
        RequestArrived(step=0, t=0.9, request_id="b", num_prompt_tokens=4, max_tokens=8, priority=0),
        RequestArrived(step=0, t=0.9, request_id="c", num_prompt_tokens=4, max_tokens=8, priority=0),
        StepPlanned(step=1, t=1.0, prefill_tokens=8, decode_tokens=0, num_prefill_rows=2, num_decode_rows=0,
                    num_padding_rows=0, token_budget=512, num_running=2, num_waiting=1, kv_blocks_used=2,
                    kv_blocks_total=64, recompute_tokens=0, num_recompute_rows=0),
        RequestAdmitted(step=1, t=1.0, request_id="a", slot=0, num_computed_tokens=0, resumed=False),
        RequestAdmitted(step=1, t=1.0, request_id="b", slot=1, num_computed_tokens=0, resumed=False),
        RequestAdmitted(step=2, t=1.5, request_id="c", slot=2, num_computed_tokens=0, resumed=False),
        finished(2, 1.6, ["a", "b"], kv=7),
        FirstToken(step=2, t=1.6, request_id="a", ttft_s=0.7),
        FirstToken(step=2, t=1.6, request_id="b", ttft_s=0.7),
        KnobChanged(step=3, t=2.0, name="max_num_seqs", old=3, new=4, source="tui"),
        RequestRetired(step=4, t=3.0, request_id="a", reason="stop", slot=0, num_prompt_tokens=4,
                       num_output_tokens=2),
        RowMoved(step=4, t=3.0, request_id="c", from_slot=2, to_slot=0, num_bytes=1024),
        RequestPreempted(step=5, t=3.5, request_id="b", slot=1, blocks_freed=2, tokens_to_recompute=5,
                         reason="kv pool dry"),
        RequestAdmitted(step=6, t=4.0, request_id="b", slot=1, num_computed_tokens=0, resumed=True),
        RequestRetired(step=7, t=5.0, request_id="b", reason="length", slot=1, num_prompt_tokens=4,
                       num_output_tokens=8),
        RequestArrived(step=7, t=5.2, request_id="d", num_prompt_tokens=4, max_tokens=8, priority=0),
        RequestAdmitted(step=8, t=5.5, request_id="d", slot=2, num_computed_tokens=0, resumed=False),
        RequestRetired(step=9, t=6.0, request_id="c", reason="stop", slot=0, num_prompt_tokens=4,
                       num_output_tokens=3),
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
    assert counters["scheduled_tokens"] == [{"prefill": 8, "recompute": 0, "decode": 0}]
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


def test_csv_and_summary_split_queue_time_by_reason():
    events = [
        RequestAdmitted(step=1, t=1.0, request_id="a", slot=0, num_computed_tokens=0, resumed=False,
                        wait_reasons=("max_num_seqs", "kv"), wait_s=(0.5, 1.75)),
        RequestAdmitted(step=5, t=3.0, request_id="a", slot=0, num_computed_tokens=0, resumed=True,
                        wait_reasons=("preemption",), wait_s=(0.25,)),
        RequestRetired(step=6, t=4.0, request_id="b", reason="abort", slot=-1, num_prompt_tokens=3,
                       num_output_tokens=0, wait_reasons=("kv",), wait_s=(2.0,)),
    ]
    rows = {r["request_id"]: r for r in csv.DictReader(io.StringIO(to_csv(events)))}
    a = rows["a"]
    assert float(a["queue"]) == pytest.approx(2.5)
    assert (float(a["wait_kv"]), float(a["wait_max_num_seqs"]),
            float(a["wait_preemption"])) == (1.75, 0.5, 0.25)
    assert a["wait_budget"] == ""
    assert float(rows["b"]["wait_kv"]) == 2.0
    text = summary_text(None, events)
    assert "queue time        4.5 s: 3.8 s kv, 500 ms max_num_seqs, 250 ms preemption" in text


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
        RequestAdmitted(step=1, t=1.0, request_id="x", slot=0, num_computed_tokens=0, resumed=False),
        RequestAdmitted(step=5, t=2.0, request_id="y", slot=0, num_computed_tokens=0, resumed=False),
        RequestRetired(step=6, t=3.0, request_id="y", reason="stop", slot=0, num_prompt_tokens=1,
                       num_output_tokens=1),
        RequestRetired(step=7, t=4.0, request_id="ghost", reason="abort", slot=-1, num_prompt_tokens=1,
                       num_output_tokens=0),     # never admitted: no slice
    ]
    got = sorted(slices(to_chrome_trace(None, events)))
    assert got == [("x", 1, 0.0, 1e6, "unknown"), ("y", 1, 1e6, 1e6, "retired:stop")]


def test_phase_slices_nest_inside_their_step():
    import random
    rng = random.Random(0)
    phases = ("schedule_s", "prepare_s", "forward_s", "sample_s", "update_s")
    events = [StepFinished(step=k, t=1000.0 + k * 0.0137, num_rows=1, num_tokens=1, sampled_request_ids=(),
                           num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_total=1,
                           **{p: rng.random() * 1e-3 for p in phases}) for k in range(1, 200)]
    trace = to_chrome_trace(None, events)
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    phases = [e for e in trace["traceEvents"] if e.get("cat") == "phase"]
    for i, step in enumerate(steps):
        for p in phases[5 * i: 5 * i + 5]:
            assert step["ts"] <= p["ts"] and p["ts"] + p["dur"] <= step["ts"] + step["dur"]

"""The batchtop-serve leg of the predicted-against-measured check (engine/bench/whatif_serve.py), run for
real at a small scale: `batchtop serve --model tiny` launched at the recorded knobs and at another budget,
the trace replayed by the HTTP client while the event stream is recorded; the recording reads back with
the server's set-up and the trace's requests, replays step for step, and every server is gone after.
The same check's recordings then re-priced at a scaled step time (engine/bench/whatif_sensitivity.py)."""
from __future__ import annotations

import json
import socket

import pytest

from batchtop.engine.bench import whatif_sensitivity, whatif_serve
from batchtop.engine.bench.whatif_check import format_value, make_trace
from batchtop.engine.vllm.launch import free_port
from batchtop.engine.whatif.grid import prepare
from batchtop.engine.whatif.recording import read_recording
from batchtop.engine.whatif.replay import replay_identity

NUM_REQUESTS = 24


def test_a_small_check_on_batchtop_serve_records_predicts_and_measures(tmp_path, capsys):
    port = free_port()
    argv = [*f"--model tiny --port {port} --requests {NUM_REQUESTS} --rate 40 --recorded 2".split(),
            "--values", "", "--budget", "32", "--repeats", "1", "--out", str(tmp_path),
            "--json", str(tmp_path / "points.json")]
    assert whatif_serve.main(argv) == 0
    saved = json.loads((tmp_path / "points.json").read_text())

    rec = read_recording(str(tmp_path / "round1.jsonl"))
    assert rec.setup.assumed == () and rec.setup.knobs["max_num_seqs"] == 2
    trace = make_trace(NUM_REQUESTS, 40, 25)
    assert sorted(r.num_prompt_tokens for r in rec.requests) == sorted(i.prompt_tokens for i in trace)
    assert sorted(r.num_output_tokens for r in rec.requests) == sorted(i.output_tokens for i in trace)
    [round1] = saved["rounds"]
    assert round1["matching"] == round1["identity_steps"] == round1["steps"] > 0   # step for step
    assert round1["client"]["completed"] == NUM_REQUESTS and round1["client"]["failed"] == 0
    # the client sends before the server's receipt and reads after the engine's token: a positive path
    assert 0 < round1["http_path_s"] < 1.0

    [point] = saved["points"]
    [measured], [predicted] = point["measured"], point["predicted"]
    assert point["knobs"] == {"max_num_batched_tokens": 32}
    assert measured["completed"] == NUM_REQUESTS and measured["failed"] == 0
    assert predicted["output_tok_s"] > 0 and measured["output_tok_s"] > 0
    assert 0 < measured["http_path_s"] < 1.0
    # the real run ran at the point's knobs: the server's own recording says so, and so do its steps
    real = read_recording(str(tmp_path / "round1-max_num_batched_tokens=32.jsonl"))
    assert real.setup.knobs["max_num_batched_tokens"] == 32 and real.setup.knobs["max_num_seqs"] == 2
    assert max(s.num_tokens for s in real.steps) <= 32 < max(s.num_tokens for s in rec.steps)

    with socket.socket() as s:                         # every server stopped, its port free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    section = capsys.readouterr().out
    assert "\n" + whatif_serve.SECTION + "\n" in section
    assert "| max_num_batched_tokens=32 | output tok/s |" in section
    assert "the engine's plus the HTTP path the recorded run measured" in section
    row = "| max_num_batched_tokens=32 | TTFT p50 | {} |"
    client_ttft = predicted["ttft_p50_s"] + round1["http_path_s"]       # the table's prediction of the client
    assert row.format(format_value(client_ttft, "ttft_p50_s")) in section
    assert row.format(format_value(predicted["ttft_p50_s"], "ttft_p50_s")) in section   # the engine's alone

    # re-priced at scaled step times: 1x is the check's own prediction, a slower step a longer run
    result = whatif_sensitivity.analyse(saved, (1.0, 1.5), seeds=1)
    [scaled] = result["points"]
    [same], [slower] = scaled["scaled"][1.0], scaled["scaled"][1.5]
    for key in ("ttft_p50_s", "itl_p50_s", "output_tok_s", "preemptions", "steps"):
        assert same[key] == predicted[key]
    assert slower["itl_p50_s"] > same["itl_p50_s"] and slower["span_s"] > same["span_s"]
    _, model = prepare(rec)                            # the forward alone is scaled, the other phases kept
    shape = replay_identity(rec).engine.shapes[-1]
    plain, scaled_phases = model.fresh()(shape), model.fresh(1.5)(shape)
    assert scaled_phases.forward_s == pytest.approx(1.5 * plain.forward_s) and plain.forward_s > 0
    assert (scaled_phases.schedule_s, scaled_phases.update_s) == (plain.schedule_s, plain.update_s)
    [ratio] = scaled["step_ratio"]                     # the real run against the recording's law
    assert 0.3 < ratio < 3
    table = whatif_sensitivity.report(whatif_sensitivity.make_parser().parse_args(["points.json"]), saved,
                                      result)
    assert table.startswith("## Sensitivity to step time: batchtop serve\n")
    assert "| max_num_batched_tokens=32 | preemptions | 0 (0-0) |" in table


def test_the_http_path_is_added_only_where_every_round_measured_one():
    from batchtop.engine.bench.whatif_vllm import with_http_path
    points = [{"knobs": {"max_num_seqs": 8}, "measured": [],
               "predicted": [{"ttft_p50_s": 0.02, "ttft_p99_s": 0.1, "itl_p50_s": 0.008, "e2e_p50_s": None},
                             {"ttft_p50_s": 0.03, "ttft_p99_s": 0.2, "itl_p50_s": 0.009, "e2e_p50_s": 0.5}]}]
    [shifted] = with_http_path(points, [{"http_path_s": 0.005}, {"http_path_s": 0.007}])
    assert [p["ttft_p50_s"] for p in shifted["predicted"]] == pytest.approx([0.025, 0.037])
    assert [p["ttft_p99_s"] for p in shifted["predicted"]] == pytest.approx([0.105, 0.207])
    assert [p["itl_p50_s"] for p in shifted["predicted"]] == [0.008, 0.009]        # a token gap: no path
    assert [p["e2e_p50_s"] for p in shifted["predicted"]] == [None, pytest.approx(0.507)]
    assert with_http_path(points, [{"http_path_s": 0.005}, {"http_path_s": None}]) == points
    assert points[0]["predicted"][0]["ttft_p50_s"] == 0.02                         # the input untouched

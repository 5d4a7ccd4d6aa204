"""The vLLM leg of the predicted-against-measured check (engine/bench/whatif_vllm.py) without a vLLM
server: a captured event stream written with the header built from a server's `/v1/knobs` reads back
as a recording of vLLM 0.32 whose harness set-up is the server's; the client's figures become the
what-if row's keys; the table's arithmetic and verdicts, and the what-if's caveats beside it."""
from __future__ import annotations

import dataclasses
import json
import shlex

import pytest
from whatif_helpers import linear_law, synthetic_recording

from batchtop.engine.bench import whatif_vllm
from batchtop.engine.bench.serving import RequestResult, summarize
from batchtop.engine.bench.whatif_check import comparison_table, make_trace
from batchtop.engine.whatif.grid import predict
from batchtop.engine.whatif.recording import read_recording
from batchtop.engine.whatif.replay import fit_steps, replay_identity
from batchtop.engine.whatif.vllm_replay import check_grid, harness_limits, harness_trace

# What batchtop's class inside vLLM 0.32 answers on GET /v1/knobs (the fields the header needs).
STATE = {"knobs": {"max_num_seqs": 4, "max_num_batched_tokens": 2048, "long_prefill_token_threshold": 0},
         "block_size": 128, "num_kv_blocks": 181, "max_model_len": 512, "model": "smollm2",
         "engine": "vllm 0.32.0", "scheduler": "BatchtopScheduler",
         "engine_setup": {"num_blocks": 182, "block_size": 128, "max_model_len": 512,
                          "enable_prefix_caching": False, "policy": "fcfs", "async_scheduling": False}}


def test_a_captured_stream_reads_back_as_a_vllm_recording_with_the_servers_setup(tmp_path):
    events = synthetic_recording(linear_law, num_requests=40).events
    path = whatif_vllm.write_recording(tmp_path / "round1.jsonl", whatif_vllm.vllm_header(STATE), events)
    rec = read_recording(str(path))
    assert rec.setup.vllm == {"num_blocks": 182, "block_size": 128, "max_model_len": 512,
                              "enable_prefix_caching": False, "policy": "fcfs", "async_scheduling": False,
                              "max_num_seqs": 4, "max_num_batched_tokens": 2048,
                              "long_prefill_token_threshold": 0, "version": "0.32"}
    assert rec.setup.assumed == ()
    assert rec.header["start_monotonic"] == events[0].t
    assert len(rec.requests) == 40
    check_grid({"max_num_seqs": [2, 8], "max_num_batched_tokens": [64]})
    assert harness_limits(rec, {"max_num_batched_tokens": 64})["max_num_batched_tokens"] == 64
    assert len(harness_trace(rec)) == 40


def test_the_trace_and_its_prompts_are_the_same_in_every_run():
    trace = make_trace(50, 3.0, 25)
    first, again = whatif_vllm.trace_requests(trace, 25), whatif_vllm.trace_requests(trace, 25)
    assert first == again
    assert [len(r.prompt) for r in first] == [item.prompt_tokens for item in trace]
    assert [r.output_len for r in first] == [item.output_tokens for item in trace]


def test_the_clients_figures_become_the_rows_keys_and_preemptions_come_from_the_events():
    results = []
    for i in range(4):
        r = RequestResult(success=True, prompt_len=8, output_tokens=3, ttft=0.1 * (i + 1), latency=0.5,
                          itl=[0.02, 0.04])
        results.append(r)
    row = whatif_vllm.measured_row(summarize(results, 2.0),
                                   synthetic_recording(linear_law, num_requests=20).events,
                                   {"preemptions": 0.0})
    assert abs(row["ttft_p50_s"] - 0.25) < 1e-9
    assert abs(row["itl_p50_s"] - 0.03) < 1e-9
    assert row["output_tok_s"] == 6.0
    assert row["preemptions"] == row["server"]["preemptions"]
    assert row["metrics_preemptions"] == 0.0


def test_the_table_gives_a_verdict_only_where_the_error_exceeds_the_measured_spread():
    point = {"knobs": {"max_num_seqs": 8},
             "predicted": [{"ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "itl_p50_s": 0.030, "output_tok_s": 100.0,
                            "preemptions": 10}] * 3,
             "measured": [{"ttft_p50_s": t, "ttft_p99_s": 1.9, "itl_p50_s": 0.020, "output_tok_s": 100.0,
                           "preemptions": p} for t, p in ((0.5, 30), (0.8, 40), (1.0, 50))]}
    rows = {line.split(" | ")[1]: line for line in comparison_table([point]) if line.startswith("| max")}
    # TTFT p50: +25% within a 62% spread; p99 +5% and ITL p50 +50% against no spread (within and beyond
    # the target); preemptions -30 beyond a spread of 20 and beyond +-10% or +-5
    assert "| +25% | within spread |" in rows["TTFT p50"]
    assert "| +5% | ok |" in rows["TTFT p99"]
    assert "| +50% | missed |" in rows["ITL p50"]
    assert "| -30 | missed |" in rows["preemptions"]


def test_the_table_carries_the_what_if_s_caveats_beside_the_points_it_marked():
    """Of three rounds' predictions at 2 rows, two from a recording whose 2-row steps lie in one part of
    its time (the queue's drain): the table names those rounds with the what-if's own words."""
    rec = synthetic_recording(linear_law, num_requests=150, max_num_seqs=6)
    model = fit_steps(rec, replay_identity(rec))
    drained = dataclasses.replace(model, rows_parts={**model.rows_parts, 2: 1})
    rows = [predict(rec, m.fresh(), {"max_num_seqs": 2}).row() for m in (model, drained, drained)]
    point = {"knobs": {"max_num_seqs": 2}, "predicted": rows, "measured": [ROW] * 3}
    caveats = [line for line in comparison_table([point]) if line.startswith("- ")]
    assert caveats == [f"- max_num_seqs=2 (round 2, 3 of 3): round 2: {rows[1]['extrapolated']}"]
    assert "2 rows: " in caveats[0] and "in 1 of 20" in caveats[0]
    unmarked = comparison_table([{**point, "predicted": rows[:1]}])
    assert not any(line.startswith("- ") for line in unmarked)
    assert any(line.startswith("No prediction was marked extrapolated") for line in unmarked)


ROW = {"ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "itl_p50_s": 0.03, "output_tok_s": 60.0, "preemptions": 0}
SERVER = {"ttft_p50_s": 0.8, "ttft_p99_s": 1.9, "itl_p50_s": 0.03}       # the server's events: no HTTP


def saved_round(startup_s: float) -> dict:
    """One round of a saved check: its recording's summary."""
    return {"steps": 100, "wall_s": 20.0, "matching": 100, "identity_steps": 100, "law": "tokens",
            "mape": 0.1, "slowdown": 1.0, "gap": "100 us", "output_tok_s": 50.0, "ttft_p50_s": 0.5,
            "startup_s": startup_s, "round_s": 600.0, "client": {"duration_s": 100.0}}


def test_the_report_renders_from_the_saved_points():
    args = whatif_vllm.make_parser().parse_args(
        "--requests 40 --recorded 4 --values 8 --repeats 1 --output-mean 100 --max-output 256".split())
    rnd, row = saved_round(60.0), ROW
    saved = {"seconds": 600, "command": "vllm ...", "rounds": [rnd], "load": [0.4, 1.9, 1.2],
             "points": [{"knobs": {"max_num_seqs": 8}, "predicted": [row],
                         "measured": [{**row, "output_tok_s": 58.0, "duration_s": 100.0, "startup_s": 30.0,
                                       "server": SERVER}],
                         "compute_s": [1.5]}]}
    text = whatif_vllm.report(args, saved)
    assert text.startswith("## Predicted against measured: vLLM 0.32\n")
    assert "| 1 | 100 | 20.0 s | 100 of 100 |" in text
    assert "--output-mean 100 --max-output 256 --repeats 1" in text
    assert "means 48 and 100 tokens, at most 256 and 256" in text and "load average 0.4-1.9 over" in text
    # 600 s, of which 200 s the two runs of 40 requests: 600 + 200 * (300 / 40 - 1) s for 300
    assert "each healthy in 30-60 s" in text and "the runs 33% of it" in text
    assert "would have taken about 0.5 h" in text
    assert "| max_num_seqs=8 | output tok/s | 60.0 | 0% | 58.0 | 0% | +3% | ok | 5% |" in text
    # the prediction against the server's own latencies, the client's beside them
    assert "| max_num_seqs=8 | TTFT p50 | 1.00 s | 800.0 ms | +25% | 1.00 s |" in text
    assert "| max_num_seqs=8 | TTFT p99 | 2.00 s | 1.90 s | +5% | 2.00 s |" in text
    assert "made again" not in text
    again = whatif_vllm.report(args, {**saved, "commit": "aaa111", "predicted_at": "bbb222"})
    assert "The real runs are those of commit aaa111; every prediction was made again from the same " \
           "recordings at commit bbb222" in again
    pool = whatif_vllm.make_parser().parse_args(
        "--requests 40 --values 8 --num-gpu-blocks 12 --block-size 32 --max-output 96".split())
    assert whatif_vllm.options(pool, "m", {}).max_model_len == 256 + 96
    assert ("--block-size", "32") == whatif_vllm.options(pool, "m", {}).extra_args[-2:]
    text = whatif_vllm.report(pool, saved)
    assert text.startswith("## Predicted against measured: vLLM 0.32, a pool of 12 blocks of 32 tokens\n")
    assert "a pool of 12 blocks of 32 tokens (vLLM's null block included)" in text
    assert "--num-gpu-blocks 12 --block-size 32 " in text


def test_render_writes_the_check_with_the_options_it_ran_with(tmp_path, capsys):
    ran = whatif_vllm.make_parser().parse_args(
        "--requests 40 --recorded 4 --values 8 --repeats 1 --num-gpu-blocks 7 --output-mean 100".split())
    rnd, row = saved_round(30.0), ROW
    saved = {"section": whatif_vllm.section(ran), "seconds": 600, "command": "vllm ...", "rounds": [rnd],
             "points": [{"knobs": {"max_num_seqs": 8}, "predicted": [row],
                         "measured": [{**row, "duration_s": 100.0, "startup_s": 30.0, "server": SERVER}],
                         "compute_s": [1.5]}]}
    path = tmp_path / "check.json"
    path.write_text(json.dumps({**saved, "args": whatif_vllm.check_args(ran)}))
    assert whatif_vllm.main(["--render", str(path)]) == 0          # no options: the saved ones
    text = capsys.readouterr().out
    assert text.startswith("## Predicted against measured: vLLM 0.32, a pool of 7 blocks\n")
    assert "--requests 40 --rate 3 --recorded 4 --values 8 --budget 64 --num-gpu-blocks 7 " in text
    # a file from before the options were kept, rendered with another check's options: refused
    path.write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="holds the check of '## Predicted against measured: vLLM 0.32, a "
                                         "pool of 7 blocks'"):
        whatif_vllm.main(["--render", str(path)])
    assert whatif_vllm.main(["--render", str(path), "--num-gpu-blocks", "7"]) == 0


def test_a_label_gives_the_check_a_section_of_its_own_that_its_command_writes_again(tmp_path, capsys):
    """--label: a check beside the published one (another rate) goes to its own section, and the command
    the section prints, run again, names the same section (the label quoted as a shell word)."""
    ran = whatif_vllm.make_parser().parse_args(
        ["--requests", "40", "--values", "8", "--repeats", "1", "--label", "a trace's rate near capacity"])
    assert whatif_vllm.section(ran) == whatif_vllm.SECTION + ", a trace's rate near capacity"
    rnd, row = saved_round(30.0), ROW
    saved = {"section": whatif_vllm.section(ran), "seconds": 600, "command": "vllm ...", "rounds": [rnd],
             "points": [{"knobs": {"max_num_seqs": 8}, "predicted": [row],
                         "measured": [{**row, "duration_s": 100.0, "startup_s": 30.0, "server": SERVER}],
                         "compute_s": [1.5]}],
             "args": whatif_vllm.check_args(ran)}
    path = tmp_path / "check.json"
    path.write_text(json.dumps(saved))
    assert whatif_vllm.main(["--render", str(path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(whatif_vllm.section(ran) + "\n")
    command = text.split("Command: `", 1)[1].split("`", 1)[0]
    again = whatif_vllm.make_parser().parse_args(shlex.split(command)[3:])
    assert again.label == "a trace's rate near capacity"
    assert whatif_vllm.section(again) == whatif_vllm.section(ran)
    unlabelled = whatif_vllm.make_parser().parse_args("--requests 40".split())
    assert whatif_vllm.section(unlabelled) == whatif_vllm.SECTION and whatif_vllm.label_flag(unlabelled) == ""

"""The command line: generate, record a trace, export the log."""
import json
import subprocess
import sys

BATCHTOP = [sys.executable, "-m", "batchtop.tui.cli"]


def batchtop(*args, check=True):
    return subprocess.run([*BATCHTOP, *args], capture_output=True, text=True, check=check, timeout=300)


def test_generate_json_prints_one_object_per_prompt_in_order():
    out = batchtop("generate", "--model", "tiny", "--prompt", "Hello", "--prompt",
                   "a much longer prompt here", "--max-tokens", "5", "--ignore-eos", "--json",
                   "--max-num-seqs", "1").stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [5, 5]
    assert [r["request_id"] for r in rows] == ["r0", "r1"]
    assert all(r["finish_reason"] == "length" and r["num_preemptions"] == 0 for r in rows)


def test_generate_rejects_a_prompt_beyond_the_context_with_the_lengths():
    result = batchtop("generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "5000", check=False)
    assert result.returncode == 2
    assert "max_tokens (5000)" in result.stderr and "context of 2048 tokens" in result.stderr


def test_record_a_trace_then_export_it(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_s": 0.0, "prompt_tokens": 8, "output_tokens": 12}\n'
                     '{"arrival_s": 0.0, "prompt": "Hello world", "output_tokens": 5}\n'
                     '{"arrival_s": 0.0, "prompt_tokens": 20, "output_tokens": 30}\n')
    log = tmp_path / "run.jsonl"
    batchtop("record", "--model", "tiny", "--trace", str(trace), "--out", str(log))
    summary = batchtop("export", str(log), "--format", "summary").stdout
    assert "requests          arrived 3  finished 3 (length 3)" in summary
    assert "out" in summary and "(47 output tokens)" in summary
    csv = batchtop("export", str(log), "--format", "csv").stdout.splitlines()
    assert [line.split(",")[7] for line in csv[1:]] == ["12", "5", "30"]
    chrome = json.loads(batchtop("export", str(log), "--format", "chrome").stdout)
    names = {e["args"]["name"] for e in chrome["traceEvents"] if e.get("name") == "thread_name"}
    assert {"slot 0", "slot 1", "slot 2"} <= names
    counters = {e["name"] for e in chrome["traceEvents"] if e["ph"] == "C"}
    assert {"kv_blocks_used", "running_rows", "waiting_rows", "tokens_per_step"} <= counters


def test_bad_trace_line_is_named(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_s": 0.0, "prompt_tokens": 8, "output_tokens": 12}\n{"arrival_s": 1, '
                     '"output_tokens": 0}\n')
    result = batchtop("record", "--model", "tiny", "--trace", str(trace), "--out", str(tmp_path / "x.jsonl"),
                      check=False)
    assert result.returncode == 2 and f"{trace}:2: bad trace line" in result.stderr
    result = batchtop("record", "--model", "tiny", "--trace", str(tmp_path / "missing"), "--out",
                      "x", check=False)
    assert result.returncode == 2 and "No such file" in result.stderr


def test_cuda_graphs_flag_reaches_the_engine_config():
    from batchtop.engine.flags import engine_config
    from batchtop.tui.cli import build_parser
    parser = build_parser()
    assert engine_config(parser.parse_args(["generate", "--prompt", "x"])).cuda_graphs == "off"
    assert engine_config(parser.parse_args(["generate", "--prompt", "x", "--cuda-graphs",
                                            "on"])).cuda_graphs == "on"

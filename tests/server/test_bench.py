"""`bench` against the server: every request completes and the token counts are the server's usage."""
from __future__ import annotations

import json
import math

import httpx
from server_helpers import wait_idle

from batchtop.engine.bench import serving as bs


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_bench_against_server_counts_match_usage(served, base_url):
    server, _ = served
    wait_idle(server)
    before = httpx.get(base_url + "/metrics").text
    requests = bs.random_dataset(12, input_len=24, output_len=10, range_ratio=0.5, seed=3)
    results, duration = bs.bench_server(base_url, "tiny", requests, request_rate=200.0, burstiness=0.5,
                                        max_concurrency=4, seed=3)
    summary = bs.summarize(results, duration, slos=bs.parse_goodput(["ttft:60000", "tpot:60000"]))
    assert summary["completed"] == len(requests) and summary["failed"] == 0
    for request, result in zip(requests, results):
        assert result.usage["prompt_tokens"] == request.prompt_len == result.prompt_len
        assert result.usage["completion_tokens"] == request.output_len == result.output_tokens
        assert result.num_chunks <= result.output_tokens and len(result.itl) == result.num_chunks - 1
    assert summary["total_input_tokens"] == sum(r.prompt_len for r in requests)
    assert summary["total_output_tokens"] == sum(r.output_len for r in requests)
    assert summary["request_goodput"] == summary["request_throughput"]
    wait_idle(server)
    after = httpx.get(base_url + "/metrics").text          # the server's own counters agree
    for name, expected in (("vllm:prompt_tokens_total", summary["total_input_tokens"]),
                           ("vllm:generation_tokens_total", summary["total_output_tokens"])):
        assert metric(after, name) - metric(before, name) == expected
    table = bs.format_table(summary)
    assert "Successful requests:" in table and "P99 TPOT (ms):" in table


def test_bench_embedded_and_sweep(engine_config, served, tmp_path):
    requests = bs.random_dataset(6, input_len=16, output_len=5, seed=1)
    loaded = served[0].engine.loaded
    results, duration, events = bs.bench_embedded(engine_config, requests, loaded=loaded, max_concurrency=3)
    assert [r.output_tokens for r in results] == [5] * 6 and all(r.success for r in results)
    points = bs.sweep(engine_config, requests, [1, 4], loaded=loaded)
    assert [p["max_num_seqs"] for p in points] == [1, 4]
    assert all(p["completed"] == 6 and p["preemptions"] == 0 for p in points)
    assert "max_num_seqs" in bs.sweep_table(points) and "max_num_seqs" in bs.sweep_plot(points)


def test_bench_cli_saves_result(base_url, tmp_path, capsys):
    from batchtop.tui.cli import main
    out = tmp_path / "result.json"
    code = main(["bench", "--base-url", base_url, "--num-prompts", "4", "--random-input-len", "8",
                 "--random-output-len", "4", "--max-concurrency", "2", "--save-result", str(out)])
    assert code == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["completed"] == 4 and saved["output_lens"] == [4, 4, 4, 4] and saved["model"] == "tiny"


def test_sharegpt_dataset_and_pacing(tmp_path, served):
    data = [{"conversations": [{"from": "human", "value": "Tell me about the sea and its many moods."},
                               {"from": "gpt",
                                "value": "The sea is calm, then wild, then calm again, always."}]},
            {"conversations": [{"from": "human", "value": "hi"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    requests = bs.sharegpt_dataset(str(path), 10, served[0].tokenizer)
    assert len(requests) == 1 and requests[0].prompt_len > 4 and requests[0].output_len > 4
    lengths = bs.random_dataset(200, 100, 50, range_ratio=0.2, seed=0)
    assert all(80 <= r.prompt_len <= 120 and 40 <= r.output_len <= 60 for r in lengths)
    assert not math.isnan(bs.summarize([], 1.0)["request_throughput"])

"""`tune --apply URL --verify N` against a live batchtop serve: the chosen knob is set on the running engine
and the verification report is read from the server's own event stream while requests are served."""
import json
import threading

import httpx
import pytest
from whatif_helpers import linear_law, synthetic_recording, write_recording

from batchtop.engine.core.config import EngineConfig
from batchtop.tui.cli import main


@pytest.fixture
def live(tiny):
    from batchtop.engine.server.app import ServerThread, build_server
    server = build_server(EngineConfig(model="tiny", num_kv_blocks=256, max_model_len=256, max_num_seqs=32,
                                       flight_recorder_steps=0), loaded=tiny)
    thread = ServerThread(server).start()
    yield thread.url
    thread.stop()
    server.loop.stop()


def test_apply_sets_the_knob_live_and_verify_reads_the_live_stream(tmp_path, live, capsys):
    rec = write_recording(tmp_path / "rec.jsonl", synthetic_recording(linear_law, num_requests=60, rate=60.0))
    stop = threading.Event()

    def load():
        with httpx.Client(base_url=live, timeout=30) as client:
            while not stop.is_set():
                client.post("/v1/completions", json={"model": "tiny", "prompt": "hello there",
                                                     "max_tokens": 6, "ignore_eos": True})

    clients = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for client in clients:
        client.start()
    try:
        code = main(["tune", rec, "--slo", "ttft_p99=10s", "--knob", "max_num_seqs=1..6", "--apply", live,
                     "--verify", "2", "--json"])
    finally:
        stop.set()
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    best = report["best"]["knobs"]["max_num_seqs"]
    assert httpx.get(live + "/v1/knobs").json()["knobs"]["max_num_seqs"] == best
    measured = report["measured"]
    assert measured["steps"] > 0 and measured["output_tok_s"] > 0
    assert measured["knobs"] == {"max_num_seqs": best}


def test_apply_reports_a_refusal_in_one_line(tmp_path, live, capsys):
    rec = write_recording(tmp_path / "rec.jsonl", synthetic_recording(linear_law, num_requests=30))
    assert main(["tune", rec, "--slo", "ttft_p99=10s", "--knob", "max_num_seqs=1..2",
                 "--apply", live.replace(live.rsplit(":", 1)[1], "9")]) == 2
    assert "cannot reach" in capsys.readouterr().err

"""The fleet's parts without a server: which engines the command line names, the pace of
data-parallel ranks, a fleet recording written (engines joining late, restarted, scraped), read back per
engine, replayed and exported."""
from __future__ import annotations

import json
import threading

import pytest
from command_helpers import error_lines

from batchtop.telemetry.events import PrefillChunk, RequestArrived, StepFinished, StepPlanned
from batchtop.telemetry.fleet_log import FleetRecorder, read_fleet_log
from batchtop.telemetry.recorder import LogFormatError, read_log
from batchtop.tui.cli import main
from batchtop.tui.fleet.pace import NOT_IN_LOCK_STEP, find_pacer, pace_status
from batchtop.tui.fleet.rows import StepRecord, StepStats
from batchtop.tui.fleet.targets import targets


def test_targets_from_urls_file_and_ranks(tmp_path):
    listing = tmp_path / "engines.txt"
    listing.write_text("# replicas\nhttp://10.0.0.1:8000/ east\n\nhttp://10.0.0.2:8000  # west, unnamed\n")
    found = targets(["http://127.0.0.1:9000"], str(listing), base_port=7000, ranks=2)
    assert [(t.name, t.url, t.rank) for t in found] == [
        ("127.0.0.1:9000", "http://127.0.0.1:9000", None), ("east", "http://10.0.0.1:8000", None),
        ("10.0.0.2:8000", "http://10.0.0.2:8000", None),
        ("rank 0", "http://127.0.0.1:7000", 0), ("rank 1", "http://127.0.0.1:7001", 1)]


@pytest.mark.parametrize("argv, says", [
    (["top"], "no engine to watch"),
    (["top", "--urls-file", "/no/such/file"], "cannot read the URLs file"),
    (["top", "--url", "ftp://x"], "not an engine URL"),
    (["top", "--ranks", "2"], "--base-port and --ranks go together"),
    (["top", "http://127.0.0.1:1", "http://127.0.0.1:2"], "none of the 2 engines answers"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    assert main(argv) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and says in errors[0], errors


def test_bad_urls_file_line(tmp_path, capsys):
    listing = tmp_path / "engines.txt"
    listing.write_text("http://127.0.0.1:8000\nnot a url at all\n")
    assert main(["top", "--urls-file", str(listing)]) == 2
    assert f"{listing}:2: want `URL [NAME] [key=VAR]`" in capsys.readouterr().err


def test_a_line_names_the_variable_that_holds_its_key(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAST_KEY", "k-east")
    listing = tmp_path / "engines.txt"
    listing.write_text("http://10.0.0.1:8000 east key=EAST_KEY\nhttp://10.0.0.2:8000 key=EAST_KEY\n"
                       "http://10.0.0.3:8000 west\n")
    found = targets([], str(listing))
    assert [(t.name, t.api_key) for t in found] == [("east", "k-east"), ("10.0.0.2:8000", "k-east"),
                                                    ("west", None)]
    assert [t.key("default") for t in found] == ["k-east", "k-east", "default"]
    url, want = "http://10.0.0.1:8000", "want `URL [NAME] [key=VAR]`"
    for line, says in (("east key=NO_SUCH_VAR", "NO_SUCH_VAR is not set"),
                       ("east key=not-a-name", "want the name of an environment variable"),
                       ("key=EAST_KEY east", want), ("east key=EAST_KEY key=EAST_KEY", want)):
        listing.write_text(f"{url} {line}\n")
        assert main(["top", "--urls-file", str(listing)]) == 2
        err = capsys.readouterr().err
        assert f"{listing}:1: " in err and says in err, err
        assert "k-east" not in err                       # a key is never printed


def _steps(durations_ms, start=100.0, period=0.2, chunk=None):
    out = []
    for i, ms in enumerate(durations_ms):
        t = start + i * period
        request, tokens = chunk[1] if chunk and chunk[0] == i else ("", 0)
        out.append(StepRecord(i, t, t + ms / 1000, request, tokens))
    return out


def test_the_rank_with_the_long_prefill_chunk_sets_the_pace():
    ranks = {"rank 0": _steps([20, 20, 20, 20, 20]),
             "rank 1": _steps([20, 20, 20, 90, 20], chunk=(3, ("r7", 512))),
             "rank 2": _steps([21, 19, 20, 22, 20])}
    pacer = find_pacer(ranks)
    assert (pacer.rank, pacer.step, pacer.request_id, pacer.chunk_tokens) == ("rank 1", 3, "r7", 512)
    assert "rank 1 set the pace at step 3" in pacer.text()
    assert "r7's prefill chunk of 512 tokens" in pacer.text()
    even = {name: _steps([20] * 5) for name in ranks}
    assert find_pacer(even) is None
    apart = {"rank 0": _steps([20] * 5), "rank 1": _steps([90] * 5, start=100.1)}   # not in lock step
    assert find_pacer(apart) is None
    assert pace_status(ranks) == pacer.text() and pace_status(even) is None
    assert pace_status(apart) == NOT_IN_LOCK_STEP
    assert pace_status({"rank 0": _steps([20] * 5), "rank 1": _steps([20] * 2)}) is None   # too few yet
    # the engines' word first: independent ranks that are both busy overlap, yet set no pace
    assert pace_status(ranks, lock_step=False) == NOT_IN_LOCK_STEP
    assert pace_status(ranks, lock_step=True) == pacer.text() and pace_status(apart, lock_step=True) is None


def test_step_stats_keep_each_steps_longest_chunk_and_the_token_gaps():
    stats = StepStats()
    common = dict(num_rows=2, num_tokens=9, num_running=2, num_waiting=0, kv_blocks_used=1,
                  kv_blocks_total=8, schedule_s=0, prepare_s=0, forward_s=0, sample_s=0, update_s=0)
    plan = dict(prefill_tokens=8, recompute_tokens=0, decode_tokens=1, num_prefill_rows=1,
                num_recompute_rows=0, num_decode_rows=1, num_padding_rows=0, token_budget=64, num_running=2,
                num_waiting=0, kv_blocks_used=1, kv_blocks_total=8)
    stats.feed([StepPlanned(step=1, t=1.0, **plan),
                PrefillChunk(step=1, t=1.0, request_id="a", num_tokens=8, num_computed_tokens=8,
                             num_known_tokens=8),
                StepFinished(step=1, t=1.25, sampled_request_ids=("a",), **common),
                StepPlanned(step=2, t=1.3, **plan),
                StepFinished(step=2, t=1.35, sampled_request_ids=("a",), **common)])
    assert list(stats.steps) == [StepRecord(1, 1.0, 1.25, "a", 8), StepRecord(2, 1.3, 1.35, "", 0)]
    assert [gap for _, gap in stats.itl] == [pytest.approx(0.1)]


def _arrived(step, t, request_id):
    return RequestArrived(step=step, t=t, request_id=request_id, num_prompt_tokens=4, max_tokens=2,
                          priority=0)


def test_fleet_recording_read_back_per_engine_replayed_and_exported(tmp_path, capsys):
    path = tmp_path / "fleet.jsonl"
    recorder = FleetRecorder(path, {"a": {"url": "http://a:1", "model": "tiny", "knobs": {"max_num_seqs": 4},
                                          "start_monotonic": 10.0},
                                    "b": {"url": "http://b:1", "model": "tiny", "knobs": {}}})
    recorder.write("a", [_arrived(0, 10.5, "x")])
    recorder.write("b", [_arrived(0, 11.0, "y"), _arrived(1, 11.5, "z")])
    recorder.close()
    assert json.loads(path.read_text().splitlines()[1])["engine"] == "a"
    header, events = read_log(path, "b")
    assert header["engine_name"] == "b" and header["url"] == "http://b:1" and "start_monotonic" not in header
    assert [e.request_id for e in events] == ["y", "z"]
    _, engines = read_fleet_log(path)
    assert {name: [e.request_id for e in evs] for name, (_, evs) in engines.items()} == {
        "a": ["x"], "b": ["y", "z"]}
    with pytest.raises(LogFormatError, match=r"records 2 engines \(a, b\): choose one with --engine NAME"):
        read_log(path)

    assert main(["replay", str(path)]) == 2                       # says how to choose, in one line
    assert "choose one with --engine NAME" in capsys.readouterr().err
    from batchtop.tui.sources import ReplaySource
    replay = ReplaySource.from_file(str(path), engine="a", clock=lambda: 0.0)
    assert replay.knobs == {"max_num_seqs": 4} and len(replay.events) == 1

    assert main(["export", str(path), "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("engine,request_id") and [line.split(",")[:2] for line in lines[1:]] == [
        ["a", "x"], ["b", "y"], ["b", "z"]]
    trace_path = tmp_path / "trace.json"
    assert main(["export", str(path), "--format", "chrome", "--out", str(trace_path)]) == 0
    trace = json.loads(trace_path.read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names == {"a: batch (tiny)", "a: engine", "b: batch (tiny)", "b: engine"}
    assert main(["export", str(path)]) == 0
    summary = capsys.readouterr().out
    assert "== engine a (http://a:1) ==" in summary and "== engine b (http://b:1) ==" in summary
    assert main(["export", str(path), "--engine", "b", "--format", "csv"]) == 0
    assert [line.split(",")[0] for line in capsys.readouterr().out.splitlines()[1:]] == ["y", "z"]


class _FakeStream:
    """What a member reads from an event engine: the batches handed to `poll` in turn."""

    def __init__(self, url):
        self.knobs, self.meta = {"max_num_seqs": 4}, {"model": "tiny", "device": "cpu", "url": url}
        self.connected, self.paused, self.last_error = True, False, None
        self.polls: list = []
        self.snapshots = threading.Event()       # a snapshot was asked for

    def request_snapshot(self):
        self.snapshots.set()

    def poll(self):
        from batchtop.tui.sources import Poll
        return self.polls.pop(0) if self.polls else Poll([])

    def now(self):
        return 100.0

    def status(self):
        return "live"

    def close(self):
        pass


def _member(name, flavour=None):
    from batchtop.tui.fleet.member import Member
    from batchtop.tui.fleet.targets import Target
    member = Member(Target(name, f"http://{name}:1"))
    if flavour is not None:
        member.flavour, member.source = flavour, _FakeStream(member.url)
    return member


def _feed(member, request_ids, step=0, reset=False):
    from batchtop.tui.sources import Poll
    member.source.polls.append(Poll([_arrived(step + i, 100.0 + i, r) for i, r in enumerate(request_ids)],
                                    reset))
    member.poll()


def test_the_fleet_recording_takes_engines_that_join_late_and_names_the_scraped(tmp_path):
    from batchtop.tui.fleet.screen import FleetScreen
    a, late, scraped = _member("a", "events"), _member("late"), _member("vllm", "vllm")
    _feed(a, ["before"], reset=True)                        # drained before `r`: not recorded
    screen = FleetScreen([a, late, scraped], tick_s=None)
    path = tmp_path / "fleet.jsonl"
    said = screen.start_recording(str(path))
    assert said == (f"recording 1 engines to {path} (1 more from when they stream; "
                    "1 without an event stream are not recorded)")
    assert a.source.snapshots.wait(5)                       # its part starts from the engine's state
    _feed(a, ["a1"], step=1)
    late.flavour, late.source = "events", _FakeStream(late.url)       # up after `r`: joins now
    _feed(late, ["l1", "l2"], reset=True)
    _feed(a, [], reset=True)                                # a's server restarted: a new run of its own
    _feed(a, ["a2"])
    assert screen.stop_recording().startswith(f"recording saved to {path} (4 events")

    header = json.loads(path.read_text().splitlines()[0])
    assert list(header["engines"]) == ["a"] and header["waiting"] == {"late": "http://late:1"}
    assert header["scraped"] == {"vllm": "http://vllm:1"}
    _, engines = read_fleet_log(path)
    assert {name: [e.request_id for e in evs] for name, (_, evs) in engines.items()} == {
        "a": ["a1"], "late": ["l1", "l2"], "a (restart 1)": ["a2"]}
    late_header, events = read_log(path, "late")
    assert late_header["url"] == "http://late:1" and late_header["engine_kind"] == "batchtop serve"
    assert late_header["engine_name"] == "late" and "waiting" not in late_header
    assert [e.request_id for e in events] == ["l1", "l2"]
    with pytest.raises(LogFormatError, match=r"records 3 engines \(a, late, a \(restart 1\)\)"):
        read_log(path)

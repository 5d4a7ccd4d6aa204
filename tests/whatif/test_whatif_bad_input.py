"""Bad input to whatif, diff and tune: one line saying what is wrong, exit code 2, no traceback; and the
commands on good input."""
import dataclasses
import json

import pytest
from command_helpers import error_lines
from whatif_helpers import linear_law, synthetic_recording, write_recording

from batchtop.engine.whatif.recording import read_recording
from batchtop.engine.whatif.replay import replay_identity
from batchtop.telemetry import events as ev
from batchtop.tui.cli import main


@pytest.fixture(scope="module")
def rec():
    return synthetic_recording(linear_law, num_requests=30)


@pytest.fixture
def good(tmp_path, rec):
    return write_recording(tmp_path / "good.jsonl", rec)


def fails(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_a_recording_without_step_timings(tmp_path, rec, capsys):
    untimed = [dataclasses.replace(e, forward_s=0.0) if isinstance(e, ev.StepFinished) else e
               for e in rec.events]
    path = write_recording(tmp_path / "untimed.jsonl", rec, untimed)
    assert "no timings" in fails(capsys, "whatif", path, "--set", "max_num_seqs=2")
    stepless = [e for e in rec.events if not isinstance(e, ev.StepFinished)]
    path = write_recording(tmp_path / "nosteps.jsonl", rec, stepless)
    assert "no StepFinished" in fails(capsys, "whatif", path)


def test_a_truncated_recording(tmp_path, good, capsys):
    text = open(good).read()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(text[: len(text) - 40])
    assert "truncated" in fails(capsys, "whatif", str(cut), "--set", "max_num_seqs=2")
    assert "truncated" in fails(capsys, "tune", str(cut), "--slo", "ttft_p99=1s",
                                "--knob", "max_num_seqs=1..4")


@pytest.mark.parametrize("setting,words", [("max_seqs=2", "unknown knob"),
                                           ("max_num_seqs=0", "max_num_seqs must be"),
                                           ("max_num_seqs=4096", "max_num_seqs must be"),
                                           ("batching_mode=fast", "batching_mode must be"),
                                           ("max_num_seqs", "--set")])
def test_an_unknown_knob_or_a_value_out_of_range(good, capsys, setting, words):
    assert words in fails(capsys, "whatif", good, "--set", setting)


@pytest.mark.parametrize("factors", ["0", "-1.1", "fast", "1,", "101"])
def test_a_step_time_factor_that_is_not_a_positive_number(good, capsys, factors):
    assert "--step-time" in fails(capsys, "whatif", good, "--set", "max_num_seqs=2", "--step-time", factors)


def test_tune_refuses_bad_slos_and_ranges(good, capsys):
    assert "--slo" in fails(capsys, "tune", good, "--slo", "latency=2s", "--knob", "max_num_seqs=1..4")
    assert "duration" in fails(capsys, "tune", good, "--slo", "ttft_p99=fast", "--knob", "max_num_seqs=1..4")
    assert "empty" in fails(capsys, "tune", good, "--slo", "ttft_p99=1s", "--knob", "max_num_seqs=8..4")
    assert "unknown knob" in fails(capsys, "tune", good, "--slo", "ttft_p99=1s", "--knob", "seqs=1..4")
    assert "--step-time" in fails(capsys, "tune", good, "--slo", "ttft_p99=1s", "--knob", "max_num_seqs=1..4",
                                  "--step-time", "0")


def test_diff_of_two_different_traces(tmp_path, good, capsys):
    other_trace = synthetic_recording(linear_law, num_requests=31, seed=4)
    other = write_recording(tmp_path / "other.jsonl", other_trace)
    assert "different traces" in fails(capsys, "diff", good, other)


def test_the_commands_work_on_good_input(tmp_path, good, capsys):
    out = tmp_path / "what.jsonl"
    assert main(["whatif", good, "--set", "max_num_seqs=2,8", "--record", str(out)]) == 0
    text = capsys.readouterr().out
    assert "scheduled as recorded (100.0%)" in text and "held-out MAPE" in text and "max_num_seqs=8" in text
    written = sorted(p.name for p in tmp_path.glob("what.*.jsonl"))
    assert written == ["what.max_num_seqs=2.jsonl", "what.max_num_seqs=8.jsonl"]
    # a what-if's recording is a recording: it reads back, and replays as itself step for step
    again = read_recording(str(tmp_path / "what.max_num_seqs=8.jsonl"))
    assert again.setup.knobs["max_num_seqs"] == 8 and replay_identity(again).match_share == 1.0
    assert main(["diff", good, str(tmp_path / "what.max_num_seqs=2.jsonl")]) == 0
    assert "residual 0 ns" in capsys.readouterr().out
    assert main(["tune", good, "--slo", "ttft_p99=10s", "--knob", "max_num_seqs=1..6"]) == 0
    assert "best: max_num_seqs=" in capsys.readouterr().out
    assert main(["tune", good, "--slo", "ttft_p99=10s", "--knob", "max_num_seqs=1..6",
                 "--step-time", "1.2"]) == 0
    assert "SLO ttft_p99 <= 10s at step times 1.2x" in capsys.readouterr().out


def test_step_time_runs_every_point_again_on_forward_times_scaled(tmp_path, good, capsys):
    """`--step-time 1,1.5`: each point once as fitted and once with every forward time 1.5x (the other
    phases as fitted); the 1x run is the run without the flag, the 1.5x one runs its first step 1.5x as
    long and takes longer in all."""
    assert main(["whatif", good, "--set", "max_num_seqs=2", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["runs"]
    out = tmp_path / "scaled.jsonl"
    assert main(["whatif", good, "--set", "max_num_seqs=2", "--step-time", "1,1.5", "--json",
                 "--record", str(out)]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [(r["run"], r["step_scale"]) for r in runs] == [
        ("recorded", 1.0), ("as recorded (fitted)", 1.0), ("as recorded (fitted) @1.5x", 1.5),
        ("max_num_seqs=2", 1.0), ("max_num_seqs=2 @1.5x", 1.5)]
    assert {**runs[3], "compute_s": 0} == {**plain[2], "compute_s": 0}
    assert runs[4]["span_s"] > runs[3]["span_s"] and runs[4]["itl_p50_s"] > runs[3]["itl_p50_s"]
    first = {}
    for name in ("max_num_seqs=2", "max_num_seqs=2-step_time=1.5"):
        again = read_recording(str(tmp_path / f"scaled.{name}.jsonl"))
        first[name] = again.steps[0]
        assert again.header["whatif"]["step_scale"] == (1.5 if "step_time" in name else 1.0)
    slow, fast = first["max_num_seqs=2-step_time=1.5"], first["max_num_seqs=2"]
    assert slow.forward_s == pytest.approx(1.5 * fast.forward_s) and slow.schedule_s == fast.schedule_s
    assert main(["whatif", good, "--step-time", "1.2"]) == 0       # the table names the factor
    assert "@F: the run again with every fitted forward time at F times (1.2x)" in capsys.readouterr().out


def test_a_max_num_seqs_above_the_batch_capacity_is_refused_in_the_library_too(rec):
    """The command checks the value against the recording's batch capacity; a caller of the library
    gets the same refusal in words (the persistent batch has no row for it)."""
    from batchtop.engine.whatif.grid import whatif
    with pytest.raises(ValueError, match=f"above the recorded engine's batch capacity of "
                                         f"{rec.setup.batch_capacity} rows"):
        whatif(rec, {"max_num_seqs": [rec.setup.batch_capacity + 1]})

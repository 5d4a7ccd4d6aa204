"""Crash logs: the flight recorder on a failing step and on signals; a `record` log survives kill -9."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.telemetry import events as ev
from batchtop.telemetry.bus import EventLog
from batchtop.telemetry.recorder import LogReader, read_log
from batchtop.tui.sources import ReplaySource

FAIL_AT_STEP = 12
KEPT_STEPS = 8


def test_fault_in_forward_at_step_k_leaves_a_log_that_replays_to_k(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHTOP_FLIGHT_DIR", str(tmp_path))
    log = EventLog(maxlen=None)
    engine = Engine(EngineConfig(model="tiny", num_kv_blocks=32, max_model_len=128,
                                 flight_recorder_steps=KEPT_STEPS), sink=log)
    forward = engine.runner.forward

    def faulty(inputs):
        if engine.step_count == FAIL_AT_STEP:
            raise RuntimeError("injected fault")
        return forward(inputs)
    engine.runner.forward = faulty
    for i in range(4):
        engine.add_request([1 + i] * 5, SamplingParams(max_tokens=40, ignore_eos=True))
    with pytest.raises(RuntimeError, match="injected fault"):
        while True:
            engine.step()
    assert engine.step_count == FAIL_AT_STEP
    [path] = engine.flight.paths
    header, events = read_log(path)
    assert header["model"] == "tiny" and header["knobs"] == engine.knobs()
    assert header["flight_recorder"]["reason"] == f"step {FAIL_AT_STEP} raised"
    assert header["flight_recorder"]["error"] == "RuntimeError: injected fault"
    assert header["flight_recorder"]["last_step"] == FAIL_AT_STEP
    # the ring's steps, the older ones said to be missing, the failing step marked last
    assert isinstance(events[0], ev.EventsDropped) and events[0].count > 0
    steps = sorted({e.step for e in events})
    assert steps == list(range(FAIL_AT_STEP - KEPT_STEPS + 1, FAIL_AT_STEP + 1))
    assert max(e.step for e in events if isinstance(e, ev.StepFinished)) == FAIL_AT_STEP - 1
    assert events[-1] == ev.StepFailed(step=FAIL_AT_STEP, t=events[-1].t,
                                       error="RuntimeError: injected fault")
    # the flight recorder saw what the engine's own sink saw, event for event
    assert events[1:] == [e for e in log.drain() if e.step >= steps[0]]
    # the loop retires the failed batch; the pool is whole again
    outputs = engine.fail_running()
    assert {o.finish_reason for o in outputs} == {"error"}
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    replay = ReplaySource.from_file(path, clock=lambda: 0.0)
    replay.poll()
    assert replay.paused and replay.at_end
    assert replay.status().endswith(f"step {FAIL_AT_STEP}/{FAIL_AT_STEP}")


def test_no_flight_recorder_when_configured_off():
    engine = Engine(EngineConfig(model="tiny", num_kv_blocks=8, max_model_len=64, flight_recorder_steps=0))
    assert engine.flight is None and engine._sink is None


def _record(tmp_path, *extra):
    out = tmp_path / "run.jsonl"
    env = {**os.environ, "BATCHTOP_FLIGHT_DIR": str(tmp_path / "flight")}
    process = subprocess.Popen(
        [sys.executable, "-m", "batchtop.tui.cli", "record", "--model", "tiny", "--out", str(out),
         "--duration", "120", "--rate", "40", "--prompt-mean", "16", "--output-mean", "16",
         "--num-kv-blocks", "24", "--threads", "1", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_sigint_as_from_a_terminal)
    return process, out


def _sigint_as_from_a_terminal() -> None:
    """A child inherits an ignored SIGINT (a pytest started as a shell's background job), and then neither
    Python nor the flight recorder acts on it: the recording would run on to its --duration. Ctrl+C is
    tested as it comes from a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_lines(process, out, num_lines: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= num_lines:
            return
        if process.poll() is not None:
            raise AssertionError(f"record ended early: {process.stderr.read()}")
        time.sleep(0.1)
    process.kill()
    raise AssertionError("record wrote too little in time")


def test_record_killed_with_sigkill_replays_to_its_last_complete_line(tmp_path):
    process, out = _record(tmp_path)
    try:
        _wait_for_lines(process, out, 400)
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    finally:
        process.kill()
    data = out.read_bytes()
    complete = data[:data.rfind(b"\n") + 1].count(b"\n")
    with LogReader(out) as reader:
        events = list(reader)
    assert reader.header["model"] == "tiny"
    assert len(events) == complete - 1                 # every complete line but the header
    assert reader.truncated == (not data.endswith(b"\n"))
    assert any(isinstance(e, ev.StepFinished) for e in events)
    replay = ReplaySource(reader.header, events, clock=lambda: 0.0)
    assert replay.seek(10**9) is None and replay.poll().events


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_record_on_a_signal_writes_the_flight_log_and_says_where(tmp_path, signum):
    process, out = _record(tmp_path)
    try:
        _wait_for_lines(process, out, 200)
        process.send_signal(signum)
        _, err = process.communicate(timeout=60)       # acted on: far within the run's 120 s
    finally:
        process.kill()
    assert process.returncode == (-signum if signum == signal.SIGTERM else 0)
    [path] = os.listdir(tmp_path / "flight")
    path = str(tmp_path / "flight" / path)
    assert f"flight recorder (signal {signal.Signals(signum).name})" in err and path in err
    header, events = read_log(path)
    assert header["flight_recorder"]["reason"] == f"signal {signal.Signals(signum).name}"
    assert any(isinstance(e, ev.StepFinished) for e in events)
    if signum == signal.SIGINT:                        # Ctrl+C still ends the recording cleanly
        with LogReader(out) as reader:
            assert list(reader) and not reader.truncated
        assert "recorded" in err


def test_a_signal_the_process_was_started_ignoring_stays_ignored():
    """nohup and a shell's background job start a process with SIGINT ignored: the handlers leave it so (the
    signal does not end the process, so it is no reason for a flight log), and take a signal at its
    default."""
    code = ("import signal; from batchtop.telemetry import flight; flight.install_signal_handlers(); "
            "print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN, "
            "signal.getsignal(signal.SIGTERM) is flight._on_signal)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert done.stdout.split() == ["True", "True"], done.stderr


def test_batchtop_exiting_with_an_error_writes_the_flight_log(tmp_path, monkeypatch, capsys):
    from batchtop.tui.cli import main
    monkeypatch.setenv("BATCHTOP_FLIGHT_DIR", str(tmp_path))
    engine = Engine(EngineConfig(model="tiny", num_kv_blocks=8, max_model_len=64))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert main(["export", str(tmp_path / "missing.jsonl")]) == 2
    [path] = engine.flight.paths
    err = capsys.readouterr().err
    assert "cannot" in err or "No such file" in err
    assert path in err
    header, events = read_log(path)
    assert header["flight_recorder"]["reason"] == "batchtop export exited with an error"
    assert [type(e) for e in events if isinstance(e, ev.RequestRetired)] == [ev.RequestRetired]

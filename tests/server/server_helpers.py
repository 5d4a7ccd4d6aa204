"""What the server tests share (a module of its own name: several test folders have a conftest)."""
from __future__ import annotations

import time

NUM_KV_BLOCKS = 64
MAX_MODEL_LEN = 256
API_KEY = "test-key-123"


def wait_idle(server, timeout: float = 20.0) -> None:
    """Until the engine has nothing to do and every KV block is back in the pool."""
    engine = server.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.has_unfinished() and engine.kv.num_used_blocks == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: unfinished={engine.has_unfinished()} "
                         f"used blocks={engine.kv.num_used_blocks}")

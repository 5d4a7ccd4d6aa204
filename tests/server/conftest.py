"""One tiny-model engine for the whole session, served over real HTTP on free ports."""
from __future__ import annotations

import pytest
from server_helpers import API_KEY, MAX_MODEL_LEN, NUM_KV_BLOCKS

from batchtop.engine.core.config import EngineConfig


@pytest.fixture(scope="session")
def engine_config():
    return EngineConfig(model="tiny", num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN,
                        max_num_seqs=32)


@pytest.fixture(scope="session")
def served(engine_config):
    """(BatchtopServer, ServerThread) without an API key, on 127.0.0.1."""
    from batchtop.engine.server.app import ServerThread, build_server
    server = build_server(engine_config)
    thread = ServerThread(server).start()
    yield server, thread
    thread.stop()
    server.loop.stop()


@pytest.fixture(scope="session")
def base_url(served):
    return served[1].url


@pytest.fixture(scope="session")
def keyed(served):
    """A second HTTP front (with --api-key) over the same running engine loop."""
    from batchtop.engine.server.app import ServerThread
    from batchtop.engine.server.host import BatchtopServer
    server, _ = served
    keyed_server = BatchtopServer(server.loop, _bus_of(server), api_key=API_KEY)
    thread = ServerThread(keyed_server).start()
    yield keyed_server, thread
    thread.stop()


def _bus_of(server):
    return server.subscription._bus

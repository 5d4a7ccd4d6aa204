"""The server soak, bounded: concurrent streams, client cuts and control aborts; no 5xx, nothing kept."""
from __future__ import annotations

from batchtop.engine.reliability.soak_server import ServerSoak

NUM_REQUESTS = 240
CONCURRENCY = 24


def test_bounded_server_soak(keyed):
    report = ServerSoak(NUM_REQUESTS, CONCURRENCY, seed=3, sample_every=60, served=keyed).run()
    print(report.text())
    assert report.violations == [] and report.num_5xx == 0
    assert report.requests == NUM_REQUESTS
    assert sum(report.outcomes.values()) == NUM_REQUESTS
    assert min(report.outcomes["cut"], report.outcomes["aborted"], report.outcomes["plain"]) >= 10
    # in flight at most what the clients have open; nothing kept once they are done
    assert all(num_requests <= CONCURRENCY and pending <= CONCURRENCY for _, _, num_requests, pending,
               _ in report.samples)
    assert report.samples[-1][2:4] == (0, 0)
    engine = keyed[0].engine
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.requests

"""The engine's thread runs with the only OpenMP team: its workers spin between a step's parallel
regions instead of sleeping (engine/core/openmp.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# In a fresh process (no other test's threads): the tiny model, 2 rows decoding through EngineLoop; the
# process's sleeps per step (1) built and started on this thread, (2) built on a worker thread that
# lives on (as the dashboard builds it) and started here, (3) as (1) with a parallel op run on this
# thread after the start: a second team, which the check must see.
SCRIPT = """
import json
from concurrent.futures import ThreadPoolExecutor
from batchtop.engine.bench.openmp_teams import build, drive, run
from batchtop.engine.core import openmp
from batchtop.engine.model.loading import load_model
loaded = load_model("tiny")
released = openmp.release_workers()
here = [run(loaded, 2, 60, second_team=False)[1] for _ in range(2)]
worker, events = ThreadPoolExecutor(1), []
engine = worker.submit(lambda: build(load_model("tiny"), 2, events)).result()
on_worker = drive(engine, events, 2, 60)[1]
two = [run(loaded, 2, 60, second_team=True)[1] for _ in range(2)]
print(json.dumps({"released": released, "here": here, "on_worker": on_worker, "two": two}))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two OpenMP threads need two CPUs to fit as one team")
def test_the_engine_thread_keeps_its_openmp_workers_spinning():
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.splitlines()[-1])
    print(result)
    assert result["released"]
    # one team: ~0.4 sleeps a step; two: ~23 (C++ kernels) to ~43 (torch ops), one per parallel region
    assert max(result["here"]) < 5
    assert result["on_worker"] < 5
    assert min(result["two"]) > 10

"""Fixed seeded runs of the embedded engine on the `tiny` model, written as event traces (not a test).

    BATCHTOP_CPU_KERNEL=0 .venv/bin/python -m batchtop.engine.bench.traces OUTDIR

One JSONL file per run in OUTDIR and one line per run on stdout: its name, its events and the sha256
of its trace. Compare two commits by running this file with each commit's venv (it also runs by path,
`python engine/bench/traces.py OUTDIR`, against an older tree installed in that venv) and `cmp` the
files: a difference is a line of the JSONL, an event and its field.

The runs cover continuous, dynamic and static batching, the three batch layouts, recompute and
retract preemption, chunked prefill, aborts, live knob changes and priorities. Requests arrive by
step, never by wall time, and dynamic batching's timeout is 0 or out of reach, so the schedule does
not depend on speed. A trace is the engine's events in order with, after each step's events, one
`Output` line per request output (its new token ids); the wall-time valued fields are dropped
(`is_wall`). Digests of the traces at ee7c39b: tests/engine/test_golden_traces.py.
BATCHTOP_CPU_KERNEL=0 keeps the forward in torch alone (on one thread): the traces do not depend on
whether batchtop's C++ kernels build on a CPU or which products they route where.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model.loading import load_model

# Fields whose values are wall time: `t` (every event's monotonic time), the other `*_s` fields:
# StepFinished's phase timings (schedule_s, prepare_s, forward_s, sample_s, update_s), FirstToken's
# ttft_s, RequestAdmitted's and RequestRetired's wait_s (seconds per wait reason; the reasons stay),
# RequestAdmitted's evicted_ago_s, AdmissionBlocked's wait_more_s, RequestArrived's since_arrival_s and
# input_s.
# Everything else stays.
WALL = "t"


def is_wall(key: str) -> bool:
    return key == WALL or key.endswith("_s")


@dataclass
class Arrival:
    step: int                        # added before this engine step (0: before the first)
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    priority: int = 0


@dataclass
class Run:
    name: str
    config: dict
    arrivals: list[Arrival]
    # before step N: ("abort", i) aborts the i-th request added, ("knob", name, value) sets a knob
    actions: dict[int, list[tuple]] = field(default_factory=dict)


def _prompt(seed: int, length: int, shared: int = 0) -> list[int]:
    """Deterministic token ids; the first `shared` are the same in every prompt (a shared prefix)."""
    head = [1000 + i for i in range(shared)]
    return head + [(seed * 7919 + i * 104729) % 30000 + 200 for i in range(length - shared)]


def _mixed(count: int, every: int = 1, prompt: int = 12, out: int = 10, shared: int = 0,
           sampled: bool = True) -> list[Arrival]:
    """`count` requests, one every `every` steps, lengths varied by index, every third one sampled."""
    arrivals = []
    for i in range(count):
        hot = sampled and i % 3 == 2
        arrivals.append(Arrival(step=i * every, prompt=_prompt(i, prompt + (i * 5) % 17, shared),
                                max_tokens=out + (i * 3) % 11, temperature=0.8 if hot else 0.0,
                                seed=i if hot else None))
    return arrivals


def runs() -> list[Run]:
    return [
        Run("continuous_condense", dict(max_num_seqs=4, layout="condense"), _mixed(10, shared=16)),
        Run("continuous_indexmap", dict(max_num_seqs=4, layout="indexmap"), _mixed(10, shared=16)),
        Run("continuous_gather", dict(max_num_seqs=4, layout="gather"), _mixed(10, shared=16)),
        Run("static", dict(batching_mode="static", static_batch_size=4, max_num_seqs=4), _mixed(8)),
        Run("dynamic_timeout_0", dict(batching_mode="dynamic", static_batch_size=4, max_num_seqs=4,
                                      dynamic_timeout_s=0.0), _mixed(7, every=3)),
        Run("dynamic_full_batches", dict(batching_mode="dynamic", static_batch_size=3, max_num_seqs=3,
                                         dynamic_timeout_s=60.0), _mixed(9, every=2)),
        Run("preempt_recompute", dict(max_num_seqs=6, num_kv_blocks=18, block_size=4,
                                      preemption_mode="recompute", enable_prefix_caching=False),
            _mixed(8, out=14)),
        Run("preempt_retract", dict(max_num_seqs=6, num_kv_blocks=18, block_size=4,
                                    preemption_mode="retract", enable_prefix_caching=False),
            _mixed(8, out=14)),
        Run("chunked_prefill", dict(max_num_seqs=4, max_num_batched_tokens=24,
                                    long_prefill_token_threshold=10),
            [Arrival(0, _prompt(1, 70), 6), Arrival(0, _prompt(2, 45), 5), Arrival(2, _prompt(3, 9), 8),
             Arrival(5, _prompt(4, 60), 4, temperature=0.7, seed=4)]),
        Run("aborts", dict(max_num_seqs=3), _mixed(6, out=20),
            actions={4: [("abort", 0)], 6: [("abort", 5)], 9: [("abort", 3)], 30: [("abort", 1)]}),
        Run("knob_changes", dict(max_num_seqs=4), _mixed(12, out=12),
            actions={3: [("knob", "max_num_seqs", 2)], 8: [("knob", "max_num_batched_tokens", 16)],
                     12: [("knob", "preemption_mode", "retract"), ("knob", "max_num_seqs", 5)],
                     16: [("knob", "batching_mode", "static")],
                     30: [("knob", "batching_mode", "continuous")]}),
        Run("priorities", dict(max_num_seqs=2, policy="priority"),
            [Arrival(i // 2, _prompt(i, 10 + i), 6 + i % 4, priority=(i * 5) % 3) for i in range(8)]),
    ]


def trace(run: Run, loaded) -> list[dict]:
    """The run's events and outputs, in order, wall-time fields dropped."""
    lines: list[dict] = []
    sink = (lambda event: lines.append(event.to_dict()))
    config = {"num_kv_blocks": 64, **run.config}
    # a commit older than the prefix cache has no enable_prefix_caching: its engine never caches
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    engine = Engine(EngineConfig(model="tiny", **{k: v for k, v in config.items() if k in known}),
                    sink=sink, loaded=loaded)
    ids: list[str] = []
    pending = sorted(run.arrivals, key=lambda a: a.step)
    step = 0
    while pending or engine.has_unfinished() or any(s >= step for s in run.actions):
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            sampling = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed,
                                      ignore_eos=True)
            ids.append(engine.add_request(list(a.prompt), sampling, priority=a.priority,
                                          request_id=f"r{len(ids)}"))
        for action in run.actions.get(step, ()):
            if action[0] == "abort" and action[1] < len(ids):
                engine.abort(ids[action[1]])
            elif action[0] == "knob":
                engine.set_knob(action[1], action[2], source="trace")
        for out in engine.step():
            lines.append({"kind": "Output", "request_id": out.request_id,
                          "new_token_ids": list(out.new_token_ids), "finished": out.finished,
                          "finish_reason": out.finish_reason})
        step += 1
    return [{k: v for k, v in line.items() if not is_wall(k)} for line in lines]


def encode(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines).encode()


def digest(lines: list[dict]) -> str:
    return hashlib.sha256(encode(lines)).hexdigest()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: traces.py OUTDIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    loaded = load_model("tiny")
    for run in runs():
        lines = trace(run, loaded)
        (out / f"{run.name}.jsonl").write_bytes(encode(lines))
        events = sum(1 for line in lines if line["kind"] != "Output")
        print(f"{run.name} {events} {digest(lines)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What must hold of an engine between steps, named: the soak's checks (engine/reliability/soak.py).

`INVARIANTS` is the one list of what the soak checks, in the order docs/reliability.md lists them;
every violation names one of them. `check_invariants(engine)` checks the engine's state between
steps; the checks on the step's events, on aborts, on knobs and after the drain are the soak's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchtop.engine.core.request import Status

if TYPE_CHECKING:
    from batchtop.engine.core.engine import Engine

INVARIANTS = {
    # between steps (check_invariants)
    "pool accounting": ("every block's reference count equals its holders (a block prefix caching "
                        "shares is held by as many requests as its count); no request holds a block "
                        "twice; a block is free exactly when its count is 0; used + cached + empty = total"),
    "stray blocks": "blocks are held only by running requests and static padding rows",
    "queued twice": "no request is twice in the waiting queue or twice in the running list",
    "waiting and running": "no request is both waiting and running",
    "padding queued": "a static padding row is neither waiting nor running",
    "queue status": "a running request has status running; a waiting one waiting or preempted",
    "batch capacity": "running + padding rows fit the persistent batch",
    "slot map": "every slot of the persistent batch holds the request the slot map says, and no other",
    # the step's events
    "budget": "prefill + recompute + decode tokens of a step (StepPlanned) within its token budget",
    "admission cap": "a step that admits leaves at most max_num_seqs running (static, dynamic: the batch "
                     "size); a lowered cap drains, it does not preempt",
    "step raised": "no step raises (StepFailed)",
    "livelock": "a token, a first admission or a retirement (not an abort) at least every `stall_rounds` "
                "rounds",
    # aborts and knobs
    "abort": "aborting an unfinished request is accepted and frees its blocks at once",
    "double abort": "aborting it again is refused and changes nothing",
    "knob validation": "an invalid knob value is refused and leaves every knob as it was",
    # after the drain
    "pool whole": "after the drain every block is free",
    "requests kept": "after the drain the engine keeps no request",
    "retired twice": "no request retires more than once",
    "starved": "every request that arrived retired (stop, length or abort)",
}


@dataclass(frozen=True)
class Violation:
    invariant: str               # a key of INVARIANTS
    detail: str

    def __post_init__(self):
        if self.invariant not in INVARIANTS:
            raise ValueError(f"unknown invariant {self.invariant!r}")

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


def check_invariants(engine: Engine) -> list[Violation]:
    """Everything that must hold between steps, as a list of what does not (empty: all holds)."""
    scheduler, kv, batch = engine.scheduler, engine.kv, engine.batch
    problems = [Violation("pool accounting", p) for p in kv.audit()]
    running, waiting, padding = scheduler.running, list(scheduler.waiting), scheduler.padding
    running_ids = {r.request_id for r in running}
    waiting_ids = {r.request_id for r in waiting}
    padding_ids = {r.request_id for r in padding}
    if len(running_ids) != len(running) or len(waiting_ids) != len(waiting):
        problems.append(Violation("queued twice", f"{len(waiting)} waiting ({len(waiting_ids)} ids), "
                                                  f"{len(running)} running ({len(running_ids)} ids)"))
    if running_ids & waiting_ids:
        problems.append(Violation("waiting and running", f"{sorted(running_ids & waiting_ids)}"))
    if (running_ids | waiting_ids) & padding_ids:
        problems.append(Violation("padding queued", f"{sorted((running_ids | waiting_ids) & padding_ids)}"))
    problems += [Violation("queue status", f"{r.request_id} is running with status {r.status.value}")
                 for r in running if r.status is not Status.RUNNING]
    problems += [Violation("queue status", f"{r.request_id} is waiting with status {r.status.value}")
                 for r in waiting if r.status not in (Status.WAITING, Status.PREEMPTED)]
    # blocks belong to running requests, or to static padding rows until their batch ends (by design)
    stray = kv.holders() - running_ids - padding_ids
    if stray:
        problems.append(Violation("stray blocks", f"held by requests neither running nor padding: "
                                                  f"{sorted(stray)[:5]}"))
    if len(running) + len(padding) > batch.capacity:
        problems.append(Violation("batch capacity", f"{len(running) + len(padding)} rows exceed the batch "
                                                    f"capacity {batch.capacity}"))
    for request_id, slot in batch.slot_of.items():
        if batch.request_ids[slot] != request_id:
            problems.append(Violation("slot map", f"slot {slot} holds {batch.request_ids[slot]}, "
                                                  f"not {request_id}"))
    filled = sum(1 for request_id in batch.request_ids if request_id is not None)
    if filled != len(batch.slot_of):
        problems.append(Violation("slot map", f"{filled} slots filled, {len(batch.slot_of)} in the slot map"))
    return problems

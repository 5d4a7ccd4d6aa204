"""The embedded engine's live knobs: one table of `Knob` rows (telemetry/protocol/knob.py).

Everything else reads it: `SchedulerKnobs` (config.py: the values the scheduler reads) is generated from it,
EngineConfig checks its fields of these names at start, Engine.validate_knob checks every change
(so the HTTP API, the dashboard and scenarios get the same refusals and messages), the command-line
flags take their help from it, the dashboard its keys, prompt and header labels, and docs/server.md's
knob table is `markdown_table()`. A knob whose upper bound is None is checked against the persistent
batch's capacity the engine was built with. No torch here: the dashboard imports this module.
"""
from __future__ import annotations

import dataclasses

from batchtop.engine.workload.arrivals import DISTRIBUTIONS, MAX_RATE
from batchtop.telemetry.protocol.knob import NEXT_BATCH, SCHEDULER_KNOBS, Knob, lookup

BATCHING_MODES = ("continuous", "static", "dynamic")
PREEMPTION_MODES = ("recompute", "retract")
POLICIES = ("fcfs", "priority")
MAX_BATCHED_TOKENS_LIMIT = 65536

KNOBS: dict[str, Knob] = {knob.name: knob for knob in (
    SCHEDULER_KNOBS["max_num_seqs"],                                 # up to the batch capacity
    dataclasses.replace(SCHEDULER_KNOBS["max_num_batched_tokens"], high=MAX_BATCHED_TOKENS_LIMIT),
    dataclasses.replace(SCHEDULER_KNOBS["long_prefill_token_threshold"], high=MAX_BATCHED_TOKENS_LIMIT),
    Knob("batching_mode", str, "continuous, or batches formed whole (static) or when full or late "
         "(dynamic); a change applies at the next batch boundary", "mode", choices=BATCHING_MODES,
         applies=NEXT_BATCH, dashboard=True),
    Knob("static_batch_size", int, "B of static and dynamic batching", "B", low=1),
    Knob("dynamic_timeout_s", float, "dynamic: form a partial batch once the oldest request waited this "
         "long", "timeout", high=60),
    Knob("preemption_mode", str, "who gives way when the KV pool runs dry", "preempt",
         choices=PREEMPTION_MODES),
)}
DASHBOARD_KNOBS = tuple(name for name, knob in KNOBS.items() if knob.dashboard)
# The built-in load's knobs (EngineLoop.set_load_knob checks them through arrivals.check_load_knob).
LOAD_KNOB_ROWS: dict[str, Knob] = {knob.name: knob for knob in (
    Knob("load_rate", float, "requests per second of the built-in load", "rate", high=MAX_RATE,
         dashboard=True),
    Knob("length_dist", str, "prompt and output length distribution of the built-in load", "dist",
         choices=DISTRIBUTIONS, dashboard=True),
)}
LABELS = {k.name: k.label for k in (*KNOBS.values(), *LOAD_KNOB_ROWS.values())}


AT_START = "engine start"    # a START_KNOBS row's `applies`: no live change
# Settings fixed when the engine starts (EngineConfig fields and flags), listed in the same table.
START_KNOBS: dict[str, Knob] = {knob.name: knob for knob in (
    Knob("enable_prefix_caching", str, "full blocks of computed tokens are cached and shared by later "
         "requests with the same prefix (--enable-prefix-caching / --no-enable-prefix-caching)", "prefix",
         choices=("true", "false"), applies=AT_START),
)}


def knob(name: str) -> Knob:
    """The live knob called `name`; ValueError listing the knobs otherwise."""
    if name in START_KNOBS:
        raise ValueError(f"{name} is set when the engine starts, not live")
    return lookup(KNOBS, name)


def markdown_table() -> str:
    """The knob table of docs/server.md."""
    rows = ["| knob | label | values | applies | dashboard | meaning |", "|---|---|---|---|---|---|"]
    rows += [f"| `{k.name}` | {k.label} | {k.describe()} | {k.applies} | {'yes' if k.dashboard else 'no'} | "
             f"{k.help} |" for k in (*KNOBS.values(), *START_KNOBS.values())]
    return "\n".join(rows)

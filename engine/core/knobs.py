"""The live knobs: each one's name, type, allowed values, help, and who sets it, defined once.

EngineConfig checks its fields of these names here at start, Engine.validate_knob checks every
change here (so the HTTP API, the dashboard and scenarios get the same refusals and messages), and
the dashboard's keys and docs/server.md's knob table read the same rows. The knobs' values live in
SchedulerKnobs; a knob whose upper bound is the persistent batch's capacity is checked against the
capacity the engine was built with. No torch here: the dashboard imports this module.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

BATCHING_MODES = ("continuous", "static", "dynamic")
PREEMPTION_MODES = ("recompute", "retract")
POLICIES = ("fcfs", "priority")
MAX_BATCHED_TOKENS_LIMIT = 65536


@dataclass(frozen=True)
class Knob:
    name: str
    type: type                        # int, float or str (a str knob has choices)
    help: str
    low: float = 0
    high: float | None = None         # None: the persistent batch's capacity
    choices: tuple[str, ...] = ()
    # the dashboard's keys and knob prompt may set it (the API sets every knob)
    dashboard: bool = False

    def upper(self, capacity: int) -> float:
        return capacity if self.high is None else self.high

    def describe(self, capacity: int | None = None) -> str:
        """The allowed values as the error messages state them."""
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        high = "batch_capacity" if self.high is None and capacity is None else _number(self.upper(capacity))
        return f"{'an integer' if self.type is int else 'a number'} in [{_number(self.low)}, {high}]"

    def check(self, value, capacity: int):
        """`value` when allowed as it is; ValueError naming the allowed values otherwise."""
        if not self._allows(value, capacity):
            raise ValueError(f"{self.name} must be {self.describe(capacity)}, got {value!r}")
        return value

    def parse(self, value, capacity: int):
        """A typed-in or sent value (ints and numbers as strings too) checked and converted."""
        if self.type is int and isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
            value = int(value)
        elif self.type is float and not isinstance(value, (int, float)):
            try:
                value = float(value)
            except (TypeError, ValueError):
                pass
        value = self.check(value, capacity)
        return float(value) if self.type is float else value

    def _allows(self, value, capacity: int) -> bool:
        if self.choices:
            return value in self.choices
        number_types = (int,) if self.type is int else (int, float)
        if isinstance(value, bool) and self.type is int or not isinstance(value, number_types):
            return False
        return math.isfinite(value) and self.low <= value <= self.upper(capacity)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


KNOBS: dict[str, Knob] = {knob.name: knob for knob in (
    Knob("max_num_seqs", int, "rows a step may run", low=1, dashboard=True),
    Knob("max_num_batched_tokens", int, "the token budget of a step", low=1, high=MAX_BATCHED_TOKENS_LIMIT,
         dashboard=True),
    Knob("long_prefill_token_threshold", int, "the most tokens one request takes in a step (0: no cap)",
         high=MAX_BATCHED_TOKENS_LIMIT, dashboard=True),
    Knob("batching_mode", str, "continuous, or batches formed whole (static) or when full or late (dynamic); "
         "a change applies at the next batch boundary", choices=BATCHING_MODES, dashboard=True),
    Knob("static_batch_size", int, "B of static and dynamic batching", low=1),
    Knob("dynamic_timeout_s", float, "dynamic: form a partial batch once the oldest request waited this long",
         high=60),
    Knob("preemption_mode", str, "who gives way when the KV pool runs dry", choices=PREEMPTION_MODES),
)}
DASHBOARD_KNOBS = tuple(name for name, knob in KNOBS.items() if knob.dashboard)


def knob(name: str) -> Knob:
    """The knob called `name`; ValueError listing the knobs otherwise."""
    if name not in KNOBS:
        raise ValueError(f"unknown knob {name!r}; knobs: {', '.join(KNOBS)}")
    return KNOBS[name]


def ranges(capacity: int) -> dict[str, str]:
    """Each knob's allowed values for an engine of this batch capacity (GET /v1/knobs)."""
    return {name: k.describe(capacity) for name, k in KNOBS.items()}


def markdown_table() -> str:
    """The knob table of docs/server.md."""
    rows = ["| knob | values | dashboard | meaning |", "|---|---|---|---|"]
    rows += [f"| `{k.name}` | {k.describe()} | {'yes' if k.dashboard else 'no'} | {k.help} |"
             for k in KNOBS.values()]
    return "\n".join(rows)

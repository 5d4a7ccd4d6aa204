"""A live knob: name, type, allowed values, short label, when it applies; one check for every reader.

A host (the embedded engine, batchtop's scheduler inside vLLM) declares its knobs as `Knob`s; the
server validates through `Knob.parse`, the dashboard takes its keys, prompt and header labels from
the rows a host describes (`describe_knobs`). A vLLM knob is a `Knob` whose upper limit is the value
vLLM started with. No torch, no FastAPI: the dashboard and the vLLM guest import this module.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

NEXT_STEP = "next step"
NEXT_BATCH = "next batch boundary"


@dataclass(frozen=True)
class Knob:
    name: str
    type: type                        # int, float or str (a str knob has choices)
    help: str
    label: str                        # the dashboard header's short name ("seqs", "tok", "chunk")
    low: float = 0
    high: float | None = None         # None: the host's capacity (the embedded engine's batch rows)
    choices: tuple[str, ...] = ()
    applies: str = NEXT_STEP          # when a change takes effect: NEXT_STEP or NEXT_BATCH
    dashboard: bool = False           # the dashboard's keys and prompt offer it (the API sets every knob)
    high_note: str = ""               # why the upper limit is what it is, said when a value goes past it

    def upper(self, capacity: int | None = None) -> float | None:
        return capacity if self.high is None else self.high

    def limits(self, capacity: int | None = None) -> list | None:
        """[low, high] of a numeric knob (what a hello's `knob_limits` carries), None for a choice."""
        if self.choices:
            return None
        high = self.upper(capacity)
        return [_plain(self.low), None if high is None else _plain(high)]

    def describe(self, capacity: int | None = None) -> str:
        """The allowed values as the error messages state them."""
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        high = self.upper(capacity)
        high_text = "batch_capacity" if high is None else number_text(high)
        return f"{'an integer' if self.type is int else 'a number'} in [{number_text(self.low)}, {high_text}]"

    def check(self, value, capacity: int | None = None):
        """`value` when allowed as it is; ValueError naming the allowed values otherwise."""
        if not self._allows(value, capacity):
            high = self.upper(capacity)
            above = self.high_note and isinstance(value, (int, float)) and high is not None and value > high
            note = f"; {number_text(high)} {self.high_note}" if above else ""
            raise ValueError(f"{self.name} must be {self.describe(capacity)}, got {value!r}{note}")
        return value

    def parse(self, value, capacity: int | None = None):
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

    def row(self, capacity: int | None = None) -> dict:
        """This knob as a host describes it over the wire (GET /v1/knobs, the stream's hello)."""
        return {"name": self.name, "type": self.type.__name__, "label": self.label, "help": self.help,
                "limits": self.limits(capacity), "choices": list(self.choices), "applies": self.applies,
                "dashboard": self.dashboard}

    def _allows(self, value, capacity: int | None) -> bool:
        if self.choices:
            return value in self.choices
        number_types = (int,) if self.type is int else (int, float)
        if isinstance(value, bool) and self.type is int or not isinstance(value, number_types):
            return False
        high = self.upper(capacity)
        return math.isfinite(value) and self.low <= value and (high is None or value <= high)


def number_text(x: float) -> str:
    """A limit as people write it: 8, not 8.0."""
    return str(int(x)) if float(x).is_integer() else str(x)


def _plain(x: float):
    return int(x) if float(x).is_integer() else x


def lookup(knobs: dict[str, Knob], name: str, where: str = "") -> Knob:
    """The knob called `name`; ValueError listing the knobs otherwise."""
    if name not in knobs:
        raise ValueError(f"unknown knob {name!r}{where}; knobs: {', '.join(knobs)}")
    return knobs[name]


def describe_knobs(knobs: dict[str, Knob], capacity: int | None = None) -> dict:
    """What GET /v1/knobs and the hello say about a host's knobs besides their values."""
    return {"ranges": {name: k.describe(capacity) for name, k in knobs.items()},
            "knob_limits": {name: k.limits(capacity) for name, k in knobs.items() if not k.choices},
            "knob_table": [k.row(capacity) for k in knobs.values()]}


# The knobs every scheduler batchtop drives has (the names are vLLM's): a host takes these rows and
# sets their limits (`dataclasses.replace(row, high=...)`), so the labels and help are spelled once.
SCHEDULER_KNOBS: dict[str, Knob] = {knob.name: knob for knob in (
    Knob("max_num_seqs", int, "rows a step may run (the admission cap)", "seqs", low=1, dashboard=True),
    Knob("max_num_batched_tokens", int, "the token budget of a step", "tok", low=1, dashboard=True),
    Knob("long_prefill_token_threshold", int, "the most tokens one request takes in a step (0: no cap)",
         "chunk", dashboard=True),
)}

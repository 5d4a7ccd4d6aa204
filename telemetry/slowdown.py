"""A recording's measured forward time over a fitted law's, drawn per predicted step.

`batchtop whatif` fits a law of the forward time on what each recorded step computed
(engine/whatif/steptime.py); the rest of each step's time is the machine's: a factor per number of
rows (where the law misfits a batch size) and the load of the moment. A predicted step takes its
rows' factor times the load of a recorded step near its start, so a what-if keeps a run's moments of
load where they were. Both schedulers' what-ifs draw from it: batchtop's in this process, vLLM's in
the harness inside vLLM's interpreter (which imports only this leaf of batchtop), from the same
fields and seed.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field

# a step's load is drawn from this many recorded steps either side: few, since a wider window borrows
# fast steps into the start of a slow stretch (more time) than slow ones into a fast one
LOAD_WINDOW_STEPS = 4


@dataclass(frozen=True)
class Slowdown:
    """`by_rows[n]`: the factor of n rows over the machine's load; `load[k]`: the rest of recorded step
    k's ratio (its ratio / `by_rows` of its rows), the steps in the order of their `starts` (seconds
    since the recording's first event)."""
    by_rows: dict[int, float]
    starts: tuple[float, ...]
    load: tuple[float, ...]
    mean: float                      # the mean ratio over every step
    # a row count the recording never ran: the factor of the nearest one it did (filled as asked)
    _nearest_rows: dict[int, float] = field(default_factory=dict, compare=False, repr=False)

    def draw(self, rng: random.Random, num_rows: int, start_s: float) -> float:
        """A step of `num_rows` rows starting at `start_s`: its rows' factor times the load of a recorded
        step near that moment (any recorded step past the recording's end)."""
        if not self.load:
            return 1.0
        factor = self.by_rows.get(num_rows)
        if factor is None:
            factor = self._nearest_rows.get(num_rows)
            if factor is None:
                factor = self.by_rows[min(self.by_rows, key=lambda rows: abs(rows - num_rows))]
                self._nearest_rows[num_rows] = factor
        if start_s > self.starts[-1]:
            return factor * self.load[rng.randrange(len(self.load))]
        k = bisect.bisect_left(self.starts, start_s)
        lo, hi = max(0, k - LOAD_WINDOW_STEPS), min(len(self.load), k + LOAD_WINDOW_STEPS)
        return factor * self.load[rng.randrange(lo, hi)]

    def to_dict(self) -> dict:
        return {"by_rows": {str(rows): f for rows, f in self.by_rows.items()}, "starts": list(self.starts),
                "load": list(self.load), "mean": self.mean}

    @classmethod
    def from_dict(cls, raw: dict) -> Slowdown:
        return cls({int(rows): float(f) for rows, f in raw["by_rows"].items()},
                   tuple(map(float, raw["starts"])), tuple(map(float, raw["load"])), float(raw["mean"]))

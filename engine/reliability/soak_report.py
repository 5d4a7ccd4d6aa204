"""The soak's report: its counts, its violations by invariant, and its section of docs/reliability.md."""
from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchtop.engine.bench.figures import cpu_name

from .invariants import INVARIANTS, Violation

if TYPE_CHECKING:
    from .soak import SoakConfig


@dataclass
class SoakReport:
    requests: int = 0
    steps: int = 0
    aborts: Counter = field(default_factory=Counter)      # waiting | prefill | decode | finished (must fail)
    finished: Counter = field(default_factory=Counter)    # by reason
    knob_changes: int = 0
    knobs_refused: int = 0
    mode_switches: int = 0                                 # batching_mode and preemption_mode changes applied
    preemptions: int = 0
    retractions: int = 0
    violations: list[Violation] = field(default_factory=list)
    stopped: str = ""                                      # why the run stopped before its drain
    longest_wait_steps: int = 0                            # arrival to first admission
    longest_wait_s: float = 0.0
    longest_life_steps: int = 0                            # arrival to retirement
    drain_steps: int = 0
    elapsed_s: float = 0.0

    def by_invariant(self) -> Counter:
        """Violations per invariant, every invariant present (0 where it held)."""
        counts = Counter(dict.fromkeys(INVARIANTS, 0))
        counts.update(v.invariant for v in self.violations)
        return counts

    def of(self, invariant: str) -> list[Violation]:
        return [v for v in self.violations if v.invariant == invariant]

    def text(self) -> str:
        aborts = sum(n for kind, n in self.aborts.items() if kind != "finished")
        lines = [
            f"requests {self.requests}  steps {self.steps}  in {self.elapsed_s:.1f} s",
            f"finished {dict(sorted(self.finished.items()))}",
            f"aborts {aborts} (waiting {self.aborts['waiting']}, mid-prefill {self.aborts['prefill']}, "
            f"mid-decode {self.aborts['decode']}; aborts of finished requests refused "
            f"{self.aborts['finished']})",
            f"knob changes {self.knob_changes} (mode switches {self.mode_switches}), invalid knobs refused "
            f"{self.knobs_refused}",
            f"preemptions {self.preemptions}  retractions {self.retractions}",
            f"longest wait {self.longest_wait_steps} steps ({self.longest_wait_s:.2f} s) arrival to "
            f"admission; longest life {self.longest_life_steps} steps; drain {self.drain_steps} steps",
            f"violations {len(self.violations)}" + (f" (stopped: {self.stopped})" if self.stopped else ""),
        ]
        lines += [f"  {v}" for v in self.violations[:20]]
        return "\n".join(lines)


SECTION = "## Soak: figures"


def section(report: SoakReport, config: SoakConfig, at: str) -> str:
    """docs/reliability.md's soak figures: the command, where and when, the counts, violations by
    invariant."""
    command = (f"python -m batchtop.engine.reliability.soak --requests {config.num_requests} "
               f"--seed {config.seed} --kv-blocks {config.num_kv_blocks}")
    aborts = report.aborts
    rows = [
        ("requests", f"{report.requests:,}"),
        ("steps", f"{report.steps:,}"),
        ("finished: " + " / ".join(sorted(report.finished)),
         " / ".join(f"{report.finished[k]:,}" for k in sorted(report.finished))),
        ("aborts: waiting / mid-prefill / mid-decode",
         f"{aborts['waiting']:,} / {aborts['prefill']:,} / {aborts['decode']:,}"),
        ("second aborts of the same request, refused", f"{aborts['finished']:,}"),
        ("knob changes applied (of which batching- or preemption-mode switches)",
         f"{report.knob_changes:,} ({report.mode_switches:,})"),
        ("invalid knob values refused", f"{report.knobs_refused:,}"),
        ("preemptions (recompute) / retractions", f"{report.preemptions:,} / {report.retractions:,}"),
        ("**violations**", f"**{len(report.violations)}**"),
        ("longest wait, arrival to first admission",
         f"{report.longest_wait_steps:,} steps ({report.longest_wait_s:.1f} s)"),
        ("longest life, arrival to retirement", f"{report.longest_life_steps:,} steps"),
        ("drain after the last arrival", f"{report.drain_steps:,} steps"),
        ("wall time", f"{report.elapsed_s:,.0f} s"),
    ]
    lines = [SECTION, "",
             f"`{command}` (written by it), commit {at}, {time.strftime('%Y-%m-%d')}, "
             f"{cpu_name()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end:", "",
             "| | |", "|---|---:|", *[f"| {name} | {value} |" for name, value in rows], "",
             "Violations by invariant (engine/reliability/invariants.py):", "",
             "| invariant | what must hold | violations |", "|---|---|---:|",
             *[f"| {name} | {INVARIANTS[name]} | {n} |" for name, n in report.by_invariant().items()]]
    if report.stopped:
        lines += ["", f"The run stopped early: {report.stopped}."]
    lines += [f"- {v}" for v in report.violations[:20]]
    return "\n".join(lines) + "\n"

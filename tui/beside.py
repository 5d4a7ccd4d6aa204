"""The recording replayed beside the main one (`batchtop replay A --beside B`), as the dashboard keeps it:
its own view model, folded from its own events on the pair's clock, and the key line that names the
two runs over the plots."""
from __future__ import annotations

import os

from rich.markup import escape

from .model import DashboardModel
from .plots import Beside
from .sources.pair import ReplayPair

RUN_GLYPHS = ("⠤⠤", "••")      # how the plots draw each run's lines (plots.RUN_MARKERS)


class BesideRun:
    """The second recording of `pair`: `update()` once per tick, after the pair's own poll."""

    def __init__(self, pair: ReplayPair):
        self.pair = pair
        self.model = self._new_model()

    def _new_model(self) -> DashboardModel:
        return DashboardModel(knobs=dict(self.pair.beside.knobs))

    def update(self) -> bool:
        """Fold the second recording's new events; True when something moved."""
        poll = self.pair.beside.poll()
        if poll.reset:
            self.model = self._new_model()
        if poll.events:
            self.model.feed(poll.events)
        now = self.pair.beside.now()
        if now is not None:
            self.model.advance(now)
        return bool(poll.events or poll.reset)

    def plotted(self) -> Beside:
        return Beside(self.model, self.pair.beside_shift)

    def key(self) -> str:
        """The plots' key line: each run's marker, file, and the start knobs in which the two differ."""
        pair = self.pair
        knobs = knob_differences(pair.main.knobs, pair.beside.knobs)
        names = (pair.main_name + _whatif_of(pair.main.header),
                 pair.beside_name + _whatif_of(pair.beside.header))
        return "   ".join(f"[b]{tag}[/] {glyph} {escape(name)}" + (f": {text}" if text else "")
                          for tag, glyph, name, text in zip("AB", RUN_GLYPHS, names, knobs))


def _whatif_of(header: dict) -> str:
    """" (what-if of REC)" for a what-if's output (`batchtop whatif --record`), else nothing."""
    whatif = header.get("whatif") or {}
    return f" (what-if of {os.path.basename(whatif['recording'])})" if whatif.get("recording") else ""


def knob_differences(a: dict, b: dict) -> tuple[str, str]:
    """`name=value` of each knob both recordings name with different values, for each of them."""
    names = [name for name in a if name in b and a[name] != b[name]]
    return tuple(", ".join(f"{name}={knobs[name]}" for name in names) for knobs in (a, b))

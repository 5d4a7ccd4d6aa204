"""LoadingSource: stands in while the real source is built (a model load), so the screen shows progress."""
from __future__ import annotations

import sys
import time

from .base import Source, SourceDescription


class LoadingSource(Source):
    """Says what is loading and for how long; every command waits for the real source."""

    kind = "loading"

    def __init__(self, what: str):
        super().__init__()
        self.what = what
        self.started = time.monotonic()
        self.error: str | None = None
        self.meta = {"model": what}

    def describe(self) -> SourceDescription:
        return SourceDescription(self.kind, why_not={"knobs": f"still loading {self.what}"})

    def status(self) -> str:
        if self.error:
            return f"failed: {self.error}"
        cpu = sys.modules.get("batchtop.kernels.cpu")     # imported by the load: never import torch here
        doing = (cpu.build_note() if cpu is not None else None) or f"loading {self.what}"
        return f"{doing} {time.monotonic() - self.started:.0f}s"

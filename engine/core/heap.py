"""What is alive when the engine starts, out of the cycle collector's way.

CPython's cycle collector holds the GIL while it scans, so every thread waits for it, the engine's
step included. Its oldest generation holds what the process imported and loaded (torch,
transformers, the model: about 364k objects once the tiny model is loaded), and a full collection
comes once enough newer objects have outlived the younger generations (a run's events, say):
measured at the engine's start, a full collection took 112-139 ms; inside runs of the what-if
check, one 265 ms collection stalled a step of a run at 8 rows, which no other step of that run
came near (docs/whatif.md). Objects frozen stay where they are and are freed by their reference
counts as before; only a reference cycle among them would outlive its last use. vLLM's engine
freezes its start-up heap the same way.
"""
from __future__ import annotations

import gc


def freeze() -> None:
    """Collect, then move every object alive into the permanent generation."""
    gc.collect()
    gc.freeze()

"""A row of a persistent batch moving to another slot: what a `RowMoved` event records.

The embedded engine's batch (engine/core/batch.py) and the mirror of vLLM's worker-side batch
(engine/vllm/slots.py) both hand out `RowMove`s; the vLLM guest may import telemetry only, so
the type lives here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowMove:
    request_id: str
    from_slot: int
    to_slot: int
    num_bytes: int

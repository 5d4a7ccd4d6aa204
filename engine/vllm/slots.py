"""vLLM's persistent batch, mirrored by request id in the scheduler's process.

vLLM V1's worker keeps the running requests in a persistent input batch (`InputBatch` in
vllm/v1/worker/gpu_input_batch.py) whose rows the scheduler cannot see. Its rules are
deterministic, so replaying them on each `SchedulerOutput` gives the same rows:

1. finished requests leave their rows (`finished_req_ids`);
2. requests in the batch that this step does not schedule leave too (preempted, or left
   out by the token budget): unscheduled = in batch - (scheduled - resumed);
3. new requests, then scheduled cached requests not in the batch (resumed, or back after a
   step left out), each take the lowest empty row, else the next row at the end;
4. condense: while an empty row lies below the highest live row, that row slides down into
   the lowest empty one.

Not mirrored: a reorder that some attention backends ask for after condense (decode rows
first); vLLM's CPU and FlashAttention backends do not reorder.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from batchtop.telemetry.rows import RowMove

TOKEN_ID_BYTES = 4          # the worker's token-id rows are int32


@dataclass
class BatchUpdate:
    added: list[tuple[str, int]] = field(default_factory=list)     # (request id, slot)
    left: dict[str, int] = field(default_factory=dict)              # request id -> the slot it left
    moves: list[RowMove] = field(default_factory=list)
    num_removed: int = 0
    num_kept: int = 0


class InputBatchMirror:
    def __init__(self):
        self.slot_of: dict[str, int] = {}
        self._rows: dict[int, str] = {}          # slot -> request id; dense 0..n-1 after every update

    def __len__(self) -> int:
        return len(self.slot_of)

    def place(self, request_id: str, slot: int) -> None:
        """A running request in its row as a snapshot found it (a run that starts from one)."""
        self.slot_of[request_id] = slot
        self._rows[slot] = request_id

    def fill_holes(self) -> None:
        """After `place`: a row below the highest placed one that no placed request holds was a request's
        that finished in the step before the snapshot (the worker frees its row at the next update); a
        stand-in holds it, and leaves at the next update as a row that step does not schedule."""
        for slot in range(max(self._rows, default=-1)):
            if slot not in self._rows:
                self.place(f"<finished row {slot}>", slot)

    def update(self, finished: set[str], scheduled: set[str], resumed: set[str], to_add: list[str],
               num_tokens_of) -> BatchUpdate:
        """Apply one step's changes in the worker's order. `to_add` lists the new requests, then the
        scheduled cached ones, in `SchedulerOutput` order (those already in the batch are skipped);
        `num_tokens_of(request_id)` gives a row's token count (the bytes a move copies)."""
        out = BatchUpdate()
        leaving = [r for r in finished if r in self.slot_of]
        leaving += [r for r in self.slot_of if r not in finished and (r not in scheduled or r in resumed)]
        for request_id in set(leaving):
            out.left[request_id] = slot = self.slot_of.pop(request_id)
            del self._rows[slot]
        empty = sorted(out.left.values())
        out.num_removed = len(empty)
        out.num_kept = len(self.slot_of)
        for request_id in to_add:
            if request_id in self.slot_of:
                continue
            slot = empty.pop(0) if empty else len(self.slot_of)
            self.slot_of[request_id] = slot
            self._rows[slot] = request_id
            out.added.append((request_id, slot))
        out.moves = self._condense(empty, num_tokens_of)
        return out

    def _condense(self, empty: list[int], num_tokens_of) -> list[RowMove]:
        moves = []
        last = len(self.slot_of) + len(empty) - 1
        holes = set(empty)
        while empty:
            while last in holes:
                last -= 1
            hole = empty[0]
            if hole >= last:
                break
            empty.pop(0)
            holes.discard(hole)
            request_id = self._rows.pop(last)
            self._rows[hole] = request_id
            self.slot_of[request_id] = hole
            moves.append(RowMove(request_id, last, hole, num_tokens_of(request_id) * TOKEN_ID_BYTES))
            last -= 1
        return moves

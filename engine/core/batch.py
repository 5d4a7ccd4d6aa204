"""The persistent batch: the worker's slot-indexed mirror of the running set.

Per-slot state (token ids, block table row, lengths) lives in preallocated arrays of
`capacity` rows, so admitting a request writes one row and nothing is reallocated.
Three layouts keep the mirror in three ways and each reports what it paid per step:

- condense: lowest free slot first; after removals, slide the highest row down into the
  lowest hole until the rows are a dense prefix, copying only the live token prefix.
- indexmap: a free list; holes are never repaired; the step's batch-position→slot map is
  built fresh (decode rows before prefill rows).
- gather: the rows are rebuilt every step as fresh arrays by filter (kept rows) and merge
  (added rows) — the membership change costs a copy of every kept row.

Each step `apply` follows the scheduler's plan (vLLM's `_update_states`) and hands back the
step's rows in the layout's batch order, as the arrays the runner's `prepare` takes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from batchtop.telemetry.rows import RowMove

if TYPE_CHECKING:
    from .kv_cache import KVCacheManager
    from .request import Request
    from .scheduler_output import Row, SchedulerOutput

LAYOUTS = ("condense", "indexmap", "gather")
TOKEN_BYTES = 4
BLOCK_ID_BYTES = 4


@dataclass
class Update:
    """What one step's membership change cost: the numbers of a BatchRebuilt event."""
    rows_kept: int = 0
    rows_added: int = 0
    rows_removed: int = 0
    moves: tuple[RowMove, ...] = ()       # condense: rows slid into holes
    renumbered: tuple[RowMove, ...] = ()  # gather: kept rows that landed at a new index in the rebuilt arrays
    num_bytes: int = 0


@dataclass
class BatchStep:
    """The persistent batch's side of one step: the membership change and the rows to compute."""
    update: Update
    left_slots: list[int]                 # the slot of each of the plan's `left` before it left (-1: none)
    grown: list[tuple[str, int, int]]     # (request_id, new blocks, blocks held) of rows whose blocks grew
    rows: list[Row]                       # the plan's rows in batch order
    slots: np.ndarray                     # per row of `rows`: its slot, first position, query length,
    starts: np.ndarray                    # and whether it samples
    query_lens: np.ndarray
    samples: np.ndarray


class PersistentBatch:
    def __init__(self, layout: str, capacity: int, max_model_len: int, max_blocks_per_seq: int):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.layout = layout
        self.capacity = capacity
        self.token_ids = np.zeros((capacity, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(capacity, dtype=np.int64)
        self.block_table = np.zeros((capacity, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(capacity, dtype=np.int64)
        self.request_ids: list[str | None] = [None] * capacity
        self.slot_of: dict[str, int] = {}
        self._holes: list[int] = []          # condense: slots freed since the last condense

    @property
    def num_rows(self) -> int:
        return len(self.slot_of)

    # -- membership -------------------------------------------------------------------

    def update(self, removed: list[str], added: list[tuple[str, list[int]]]) -> Update:
        """Apply one step's membership change: removals first, then adds, then the layout's repair.

        `added` holds (request_id, known token ids). Returns the cost of the change.
        """
        kept = self.num_rows - sum(1 for rid in removed if rid in self.slot_of)
        for request_id in removed:
            self._remove(request_id)
        for request_id, token_ids in added:
            self._add(request_id, token_ids)
        update = Update(rows_kept=kept, rows_added=len(added), rows_removed=len(removed))
        if self.layout == "condense":
            update.moves = tuple(self._condense())
            update.num_bytes = sum(m.num_bytes for m in update.moves)
        elif self.layout == "gather" and (removed or added):
            update.num_bytes, update.renumbered = self._regather()
        return update

    def _add(self, request_id: str, token_ids: list[int]) -> int:
        slot = self._free_slot()
        self.place(request_id, slot, token_ids)
        return slot

    def place(self, request_id: str, slot: int, token_ids: list[int]) -> None:
        """A request put back in the row it held (a replay that starts from an engine's snapshot)."""
        if self.request_ids[slot] is not None:
            raise ValueError(f"row {slot} holds {self.request_ids[slot]}, not free for {request_id}")
        self.request_ids[slot] = request_id
        self.slot_of[request_id] = slot
        self.token_ids[slot, : len(token_ids)] = token_ids
        self.num_tokens[slot] = len(token_ids)
        self.num_blocks[slot] = 0

    def _free_slot(self) -> int:
        if self.layout == "condense" and self._holes:
            self._holes.sort()
            return self._holes.pop(0)
        # indexmap and gather: lowest free slot; condense without holes: the end of the dense prefix
        return self.request_ids.index(None)

    def _remove(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is None:
            return
        self.request_ids[slot] = None
        self.num_tokens[slot] = 0
        self.num_blocks[slot] = 0
        if self.layout == "condense":
            self._holes.append(slot)

    def _condense(self) -> list[RowMove]:
        """Slide the highest rows into the lowest holes; early return when adds refilled every hole."""
        moves = []
        holes = sorted(self._holes)
        self._holes = []
        last = self.num_rows + len(holes) - 1
        for hole in holes:
            while last >= 0 and self.request_ids[last] is None:
                last -= 1
            if hole >= last:
                break
            moves.append(self._move(last, hole))
            last -= 1
        return moves

    def _move(self, src: int, dst: int) -> RowMove:
        """Copy the live prefix of row `src` into row `dst` (tokens and block ids, nothing past them)."""
        request_id = self.request_ids[src]
        num_tokens = int(self.num_tokens[src])
        num_blocks = int(self.num_blocks[src])
        self.token_ids[dst, :num_tokens] = self.token_ids[src, :num_tokens]
        self.block_table[dst, :num_blocks] = self.block_table[src, :num_blocks]
        self.num_tokens[dst], self.num_blocks[dst] = num_tokens, num_blocks
        self.request_ids[dst], self.request_ids[src] = request_id, None
        self.num_tokens[src] = self.num_blocks[src] = 0
        self.slot_of[request_id] = dst
        return RowMove(request_id, src, dst, num_tokens * TOKEN_BYTES + num_blocks * BLOCK_ID_BYTES)

    def _regather(self) -> tuple[int, tuple[RowMove, ...]]:
        """gather: rebuild the rows as fresh arrays in request order — filter kept rows, merge added ones.
        The bytes copied and the rows whose index changed."""
        slots = sorted(self.slot_of.values())
        bytes_copied = 0
        renumbered = []
        token_ids = np.zeros_like(self.token_ids)
        block_table = np.zeros_like(self.block_table)
        for new_slot, old_slot in enumerate(slots):
            n, b = int(self.num_tokens[old_slot]), int(self.num_blocks[old_slot])
            token_ids[new_slot, :n] = self.token_ids[old_slot, :n]
            block_table[new_slot, :b] = self.block_table[old_slot, :b]
            row_bytes = n * TOKEN_BYTES + b * BLOCK_ID_BYTES
            bytes_copied += row_bytes
            if new_slot != old_slot:
                renumbered.append(RowMove(self.request_ids[old_slot], old_slot, new_slot, row_bytes))
        request_ids = [self.request_ids[s] for s in slots]
        num_tokens, num_blocks = self.num_tokens[slots], self.num_blocks[slots]
        self.token_ids, self.block_table = token_ids, block_table
        self.request_ids = request_ids + [None] * (self.capacity - len(slots))
        self.num_tokens = np.zeros(self.capacity, dtype=np.int64)
        self.num_blocks = np.zeros(self.capacity, dtype=np.int64)
        self.num_tokens[: len(slots)], self.num_blocks[: len(slots)] = num_tokens, num_blocks
        self.slot_of = {rid: i for i, rid in enumerate(request_ids)}
        return bytes_copied, tuple(renumbered)

    # -- one step -------------------------------------------------------------------------

    def apply(self, plan: SchedulerOutput, kv: KVCacheManager) -> BatchStep:
        """Follow one plan: the rows in `plan.left` leave, the admitted join, the layout repairs; then the
        block tables of the plan's rows (and of admitted requests without a row, which may hold cached
        blocks) catch up with `kv`, and the rows are put in batch order."""
        slot_of = self.slot_of
        left_slots = [slot_of.get(gone.request.request_id, -1) for gone in plan.left]
        update = self.update([gone.request.request_id for gone in plan.left],
                             [(r.request_id, r.prompt_token_ids + r.output_token_ids) for r in plan.admitted])
        with_rows = {id(row.request) for row in plan.rows}
        grown = self._sync_block_tables([row.request for row in plan.rows]
                                        + [r for r in plan.admitted if id(r) not in with_rows], kv)
        return BatchStep(update, left_slots, grown, *self._batch_order(plan.rows))

    def _sync_block_tables(self, requests: list[Request], kv: KVCacheManager) -> list[tuple[str, int, int]]:
        grown = []
        for request in requests:
            request_id = request.request_id
            block_ids = kv.block_ids(request_id)
            num_new = self.sync_blocks(request_id, block_ids)
            if num_new:
                grown.append((request_id, num_new, len(block_ids)))
        return grown

    def _batch_order(self, rows: list[Row]) -> tuple[list[Row], np.ndarray, np.ndarray,
                                                     np.ndarray, np.ndarray]:
        """The rows in the layout's batch order, with their slots, starts, query lengths and samples.
        Every row's `kind` is read here, before the step updates its request."""
        slot_of = self.slot_of
        slots = [slot_of[r.request.request_id] for r in rows]
        is_decode = [r.kind == "decode" for r in rows]
        # a step has few rows: Python lists, one array each at the end, cost less than numpy per row
        if self.layout == "indexmap":
            order = self.order(np.array(slots, dtype=np.int64), np.array(is_decode, dtype=bool)).tolist()
        else:
            order = sorted(slots)
        if order != slots:
            position = {slot: i for i, slot in enumerate(slots)}
            rows = [rows[position[s]] for s in order]
        return (rows, np.array(order, dtype=np.int64), np.array([r.start for r in rows], dtype=np.int64),
                np.array([r.num_tokens for r in rows], dtype=np.int64),
                np.array([r.samples for r in rows], dtype=bool))

    # -- per-step row state -------------------------------------------------------------

    def append_tokens(self, rows: list[Row], token_ids: list[int]) -> None:
        """Write each sampling row's new token after its known tokens."""
        slot_of = self.slot_of
        for row, token_id in zip(rows, token_ids):
            slot = slot_of[row.request.request_id]
            self.token_ids[slot, self.num_tokens[slot]] = token_id
            self.num_tokens[slot] += 1

    def sync_blocks(self, request_id: str, block_ids: list[int]) -> int:
        """Append the blocks the KV manager gave the request since the last sync; how many."""
        slot = self.slot_of[request_id]
        held = int(self.num_blocks[slot])
        if len(block_ids) == held:
            return 0
        self.block_table[slot, held : len(block_ids)] = block_ids[held:]
        self.num_blocks[slot] = len(block_ids)
        return len(block_ids) - held

    def order(self, slots: np.ndarray, is_decode: np.ndarray) -> np.ndarray:
        """The step's batch-position→slot map: slot order, except indexmap puts decode rows first."""
        if self.layout == "indexmap":
            return slots[np.lexsort((slots, ~is_decode))]
        return np.sort(slots)

"""Decode steps replayed from CUDA graphs: one graph per captured batch size, over persistent buffers.

A decode-only step (every row computes one token) of n rows runs as the graph captured for the
smallest size >= n. Its rows are written in place into input buffers allocated once; rows n to
the size are padding: each is a short sequence of its own in padding blocks that no request ever
holds, so it writes and reads K/V nobody else sees, and its logits are dropped. The host knows
every length, so nothing in the step reads the device back; the sampler's tokens at its end are
the step's one device-to-host copy. Steps with prefill rows, or more rows than the largest size,
run eagerly (runner.py).

Built with `capture=False`, the same buffers and padding run through the eager forward where a
replay would be: how the tests check bucket choice, padding and buffer updates on the CPU, and a
way to tell a capture bug from a padding bug on a GPU (`--cuda-graphs eager`).
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .step_inputs import StepInputs

if TYPE_CHECKING:
    from .runner import Runner

log = logging.getLogger(__name__)


def capture_sizes(max_rows: int) -> tuple[int, ...]:
    """1, 2, 4, then every 8 rows up to 64, every 32 beyond, and `max_rows` itself: a decode step
    pads at most 7 rows up to 64 rows and 31 beyond (17 graphs for 256 rows)."""
    candidates = [1, 2, 4, *range(8, 65, 8), *range(96, max_rows, 32)]
    return tuple(size for size in candidates if size < max_rows) + (max_rows,)


def num_padding_blocks(sizes: tuple[int, ...], block_size: int) -> int:
    """KV blocks the padding rows of the largest graph need: one slot each."""
    return -(-max(sizes, default=0) // block_size)


@dataclass(frozen=True)
class GraphCapture:
    """What capturing cost at start."""
    sizes: tuple[int, ...]
    memory_bytes: int            # device memory taken while capturing (free memory before - after)
    seconds: float

    @property
    def summary(self) -> str:
        return (f"{len(self.sizes)} CUDA graphs for {self.sizes[0]}-{self.sizes[-1]} rows, "
                f"{self.memory_bytes / 2**20:.0f} MiB, {self.seconds:.1f} s")


class StepBuffers:
    """The graphs' inputs at the largest size, allocated once and written in place every step.

    The host writes a step into pinned staging arrays, then copies them to the device without
    waiting; the next step's write first waits for that copy (long finished: a step ends by reading
    its sampled tokens back).
    """

    def __init__(self, max_rows: int, max_blocks_per_seq: int, block_size: int, first_padding_block: int,
                 device: torch.device):
        self.block_size = block_size
        self.device = device
        pinned = device.type == "cuda"
        # input ids, positions, slot mapping: one array so that one copy moves them
        self.tokens = torch.zeros(3, max_rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # one token a row
        self.row_index = torch.arange(max_rows, device=device)
        self._host_tokens = torch.zeros(3, max_rows, dtype=torch.int64, pin_memory=pinned)
        self._host_seq_lens = torch.ones(max_rows, dtype=torch.int32, pin_memory=pinned)
        self._host_block_table = torch.zeros(max_rows, max_blocks_per_seq, dtype=torch.int32,
                                             pin_memory=pinned)
        self._copied = None                      # the event after the last copy (CUDA only)
        # padding row j: position j % block_size of padding block j // block_size, so every one has
        # its own slot
        rows = np.arange(max_rows)
        self.padding_blocks = (first_padding_block + rows // block_size).astype(np.int32)
        self.padding_positions = rows % block_size
        self.padding_slots = self.padding_blocks.astype(np.int64) * block_size + self.padding_positions

    def write(self, token_ids: np.ndarray, block_table: np.ndarray, slots: np.ndarray, starts: np.ndarray,
              size: int) -> None:
        """Rows `slots` of the persistent batch, each computing its token at `starts`, then padding up to
        `size`."""
        self._wait_for_last_copy()
        num_rows, block_size = len(slots), self.block_size
        input_ids, positions, slot_mapping = self._host_tokens.numpy()
        input_ids[:num_rows] = token_ids[slots, starts]
        positions[:num_rows] = starts
        slot_mapping[:num_rows] = block_table[slots, starts // block_size].astype(np.int64) * block_size \
            + starts % block_size
        self._host_seq_lens.numpy()[:num_rows] = starts + 1
        max_blocks = int(starts.max()) // block_size + 1
        self._host_block_table.numpy()[:num_rows, :max_blocks] = block_table[slots, :max_blocks]
        self._pad_and_copy(num_rows, size)

    def write_padding(self, size: int) -> None:
        """`size` rows of padding alone: the batch a graph is captured over."""
        self._wait_for_last_copy()
        self._pad_and_copy(0, size)

    def _pad_and_copy(self, num_rows: int, size: int) -> None:
        input_ids, positions, slot_mapping = self._host_tokens.numpy()
        padding = slice(num_rows, size)
        input_ids[padding] = 0
        positions[padding] = self.padding_positions[padding]
        slot_mapping[padding] = self.padding_slots[padding]
        self._host_seq_lens.numpy()[padding] = self.padding_positions[padding] + 1
        self._host_block_table.numpy()[padding, 0] = self.padding_blocks[padding]
        self.tokens.copy_(self._host_tokens, non_blocking=True)
        self.seq_lens.copy_(self._host_seq_lens, non_blocking=True)
        self.block_table[:size].copy_(self._host_block_table[:size], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _wait_for_last_copy(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def inputs(self, size: int, num_rows: int, logits_indices: torch.Tensor, max_seq_len: int) -> StepInputs:
        """The step as views of the buffers at `size` rows: the same tensors (shapes, addresses) every
        time."""
        return StepInputs(
            input_ids=self.tokens[0, :size], positions=self.tokens[1, :size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size], slot_mapping=self.tokens[2, :size],
            logits_indices=logits_indices, max_query_len=1, max_seq_len=max_seq_len,
            num_actual_tokens=num_rows, graph_size=size)


class DecodeGraphs:
    """`try_prepare` a decode-only step into the buffers (None when it does not fit); `run` it."""

    def __init__(self, runner: Runner, sizes: tuple[int, ...], max_blocks_per_seq: int,
                 first_padding_block: int, capture: bool):
        self.runner = runner
        self.sizes = tuple(sorted(sizes))
        self.max_seq_len = max_blocks_per_seq * runner.block_size    # an upper bound; no kernel reads it here
        self.buffers = StepBuffers(self.sizes[-1], max_blocks_per_seq, runner.block_size, first_padding_block,
                                   runner.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}        # each graph's output, overwritten by its replay
        self.capture = self._capture() if capture else None

    def size_for(self, num_rows: int) -> int | None:
        """The smallest captured size that holds `num_rows` rows, None above the largest."""
        index = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[index] if index < len(self.sizes) else None

    def try_prepare(self, token_ids: np.ndarray, block_table: np.ndarray, slots: np.ndarray,
                    starts: np.ndarray, query_lens: np.ndarray, samples: np.ndarray) -> StepInputs | None:
        """The step in the buffers, padded to its size; None (nothing written) unless every row computes one
        token and the rows fit the largest graph."""
        size = self.size_for(len(slots))
        if size is None or not len(slots) or not (query_lens == 1).all():
            return None
        self.buffers.write(token_ids, block_table, slots, starts, size)
        if samples.all():
            logits_indices = self.buffers.row_index[:len(slots)]
        else:
            logits_indices = self.runner.to_device(np.flatnonzero(samples))
        return self.buffers.inputs(size, len(slots), logits_indices, self.max_seq_len)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits `[num_sampling_rows, vocab]` of a step from `try_prepare`."""
        graph = self.graphs.get(inputs.graph_size)
        if graph is None:
            logits = self._forward(inputs)
        else:
            graph.replay()
            logits = self.logits[inputs.graph_size]
        return logits[inputs.logits_indices]

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Every row's logits, padding included: the work a graph holds."""
        return self.runner.flat_forward.logits(self.runner.hidden_states(inputs))

    @torch.inference_mode()
    def _capture(self) -> GraphCapture:
        """One graph per size, largest first, sharing one memory pool (one graph replays at a time)."""
        device = self.runner.device
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
            start = time.perf_counter()
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):
                self.buffers.write_padding(size)
                inputs = self.buffers.inputs(size, 0, self.buffers.row_index[:size], self.max_seq_len)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    # compiles and autotunes this size's kernels outside the capture
                    self._forward(inputs)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[size] = self._forward(inputs)
                self.graphs[size] = graph
            torch.cuda.synchronize()
            report = GraphCapture(self.sizes, free_before - torch.cuda.mem_get_info()[0],
                                  time.perf_counter() - start)
        log.info("decode steps: %s (sizes %s)", report.summary, ", ".join(map(str, report.sizes)))
        return report

"""The runner: one step's rows to one flat ragged batch, through the model, to logits.

Every op but attention runs on the flat `[sum N_i, d]` token axis; attention gets the
offsets (`query_start_loc`, `seq_lens`, `block_table`, `slot_mapping`) and the paged KV
cache. Llama models run through forward.py (transformers' modules, fused and packed
projections); any other architecture runs transformers' own forward with the paged attention
registered in its attention-function registry. Decode-only steps on CUDA replay captured graphs
(graphs.py); on a GPU nothing in a step reads the device back but the sampled tokens.
"""
from __future__ import annotations

import ctypes
import logging
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from batchtop import kernels
from batchtop.kernels import cpu

from . import CUDA_GRAPH_MODES
from .dims import ModelDims
from .forward import FlatForward, supports
from .graphs import DecodeGraphs, capture_sizes, num_padding_blocks
from .step_inputs import StepInputs

ATTENTION_NAME = "batchtop_paged"
# longest query of a step whose attention runs as one decode-kernel row per token
TOKEN_ROWS_MAX_QUERY = 128

log = logging.getLogger(__name__)


@dataclass
class _ForwardContext:
    """One step's attention state, handed to every layer's attention call."""
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor
    metadata: object

    def attend(self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """One layer's paged attention on `[tokens, heads, head_dim]`: store the new K/V, attend."""
        k_cache, v_cache = self.kv_caches[layer_index]
        kernels.write_kv_cache(key, value, k_cache, v_cache, self.slot_mapping)
        return kernels.paged_attention(query, k_cache, v_cache, self.metadata, scale)


def _paged_attention_forward(module, query, key, value, attention_mask, scaling=None, batchtop=None, **_):
    # transformers hands [1, heads, tokens, head_dim]; the kernels want [tokens, heads, head_dim]
    out = batchtop.attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                          value[0].transpose(0, 1), scaling)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, _paged_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, lambda *args, **kwargs: None)   # the offsets are the mask


def _keep_freed_memory_in_the_heap() -> None:
    """glibc returns every large freed block to the OS, so each op on the flat batch that allocates
    a fresh output (megabytes, during prefill) pays page faults to get it back; with these
    thresholds freed memory stays in the heap and is reused. Measured: a 2048-token prefill step
    of SmolLM2 went from 4.2 s to 3.5 s. No-op where glibc's mallopt is absent."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        pass


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # glibc's mallopt parameters


_flat_forwards: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> its packed FlatForward


def flat_forward_for(model) -> FlatForward:
    """The model's FlatForward, built once per model (packing copies the weights) and again if it moved."""
    flat = _flat_forwards.get(model)
    if flat is None or flat.placement != (model.device, model.dtype):
        flat = _flat_forwards[model] = FlatForward(model)
    return flat


class Runner:
    """`prepare` a step's rows, then `forward` them. With `cuda_graphs` on (on CUDA) or eager, decode-only
    steps of up to `max_rows` rows go through `decode_graphs`; the KV caches then hold padding blocks
    after the pool's `num_blocks`."""

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype, *,
                 cuda_graphs: str = "off", max_rows: int = 0, max_blocks_per_seq: int = 0):
        _keep_freed_memory_in_the_heap()
        self.model = model
        self.device = model.device
        self.block_size = block_size
        # build the CPU kernels now (once per machine), not mid-step
        self.decode_kernel = self.device.type == "cpu" and dtype == torch.float32 and cpu.available()
        if supports(model):
            self.flat_forward = flat_forward_for(model)
        else:
            self.flat_forward = None
            model.set_attn_implementation(ATTENTION_NAME)
        dims = ModelDims.of(model.config)
        graph_sizes = self._graph_sizes(cuda_graphs, max_rows)
        shape = (num_blocks + num_padding_blocks(graph_sizes, block_size), block_size, dims.num_kv_heads,
                 dims.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=self.device),
                           torch.zeros(shape, dtype=dtype, device=self.device))
                          for _ in range(dims.num_layers)]
        self.decode_graphs = DecodeGraphs(self, graph_sizes, max_blocks_per_seq, num_blocks,
                                          capture=cuda_graphs == "on") if graph_sizes else None

    def _graph_sizes(self, mode: str, max_rows: int) -> tuple[int, ...]:
        """The batch sizes decode steps are padded to; none where they run eagerly."""
        if mode not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPH_MODES)}, got {mode!r}")
        if mode == "off" or (mode == "on" and self.device.type != "cuda") or max_rows < 1:
            return ()
        if self.flat_forward is None:
            log.warning("CUDA graphs off: %s runs through transformers' forward",
                        self.model.config.model_type)
            return ()
        if mode == "on" and kernels.resolve_backend(self.device) != "triton":
            log.warning("CUDA graphs off: the torch attention backend reads the step's lengths back to the "
                        "host")
            return ()
        return capture_sizes(max_rows)

    def prepare(self, token_ids: np.ndarray, block_table: np.ndarray, slots: np.ndarray,
                starts: np.ndarray, query_lens: np.ndarray, samples: np.ndarray) -> StepInputs:
        """Flatten rows into one ragged batch, vectorised over rows.

        Row i reads tokens `starts[i] : starts[i] + query_lens[i]` of persistent-batch row
        `slots[i]`; `samples[i]` says whether its last token's logits are needed. A decode-only step
        that a graph holds is written into its buffers instead.
        """
        if self.decode_graphs is not None:
            inputs = self.decode_graphs.try_prepare(token_ids, block_table, slots, starts,
                                                    query_lens, samples)
            if inputs is not None:
                return inputs
        query_start_loc = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        row_of_token = np.repeat(np.arange(len(slots)), query_lens)
        positions = np.arange(num_tokens) - query_start_loc[row_of_token] + starts[row_of_token]
        token_slots = slots[row_of_token]
        seq_lens = starts + query_lens
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        step_block_table = block_table[slots, :max_blocks]
        slot_mapping = (block_table[token_slots,
                                    positions // self.block_size].astype(np.int64) * self.block_size
                        + positions % self.block_size)
        tensor = self.to_device
        return StepInputs(
            input_ids=tensor(token_ids[token_slots, positions].astype(np.int64)),
            positions=tensor(positions),
            query_start_loc=tensor(query_start_loc.astype(np.int32)),
            seq_lens=tensor(seq_lens.astype(np.int32)),
            block_table=tensor(np.ascontiguousarray(step_block_table)),
            slot_mapping=tensor(slot_mapping),
            logits_indices=tensor(query_start_loc[1:][samples] - 1),
            max_query_len=int(query_lens.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            num_actual_tokens=num_tokens,
        )

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """`array` on the runner's device: no copy on the CPU; on a GPU through pinned memory, without
        waiting."""
        if self.device.type == "cpu":
            return torch.from_numpy(array)
        return torch.from_numpy(array).pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits `[num_sampling_rows, vocab]` for the rows that sample, in row order."""
        if inputs.graph_size:
            return self.decode_graphs.run(inputs)
        if self.flat_forward is None:
            return self._transformers_forward(inputs)
        # The LM head is a large GEMM: run it only on the tokens whose logits are sampled.
        return self.flat_forward.logits(self.hidden_states(inputs)[inputs.logits_indices])

    def hidden_states(self, inputs: StepInputs) -> torch.Tensor:
        """The last layer's normed hidden states of every token `[num_tokens, hidden]` (FlatForward only)."""
        return self.flat_forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.slot_mapping,
                                 self._attention(inputs))

    def _attention(self, inputs: StepInputs):
        """The step's attention over K/V already in the caches, `attend(layer_index, query, scale)`."""
        caches = self.kv_caches
        if (self.decode_kernel and kernels.resolve_backend(inputs.block_table.device) == "torch"
                and inputs.max_query_len <= TOKEN_ROWS_MAX_QUERY):
            # The CPU decode kernel serves the whole step: every token is a query row over its own causal
            # prefix (a prompt token's positions up to its own; a decode row's whole sequence), its
            # sequence's block table row beside it. Up to 128 tokens of a sequence this beats SDPA a
            # sequence at a time; beyond, each token's re-reading of its prefix costs more (docs/kernels.md).
            if len(inputs.input_ids) == len(inputs.seq_lens):
                block_table, seq_lens = inputs.block_table, inputs.seq_lens
            else:
                block_table = inputs.block_table.repeat_interleave(inputs.query_start_loc.diff(), dim=0)
                seq_lens = (inputs.positions + 1).to(torch.int32)
            return lambda index, query, scale: cpu.paged_decode(query, *caches[index], block_table,
                                                                seq_lens, scale)
        if kernels.resolve_backend(inputs.block_table.device) == "triton":
            # the lengths the host already knows: nothing read back, so no sync, and capturable in a graph
            metadata = kernels.attention_metadata_from_lengths(
                inputs.query_start_loc, inputs.seq_lens, inputs.block_table, self.block_size,
                num_tokens=len(inputs.input_ids), max_query_len=inputs.max_query_len,
                max_seq_len=inputs.max_seq_len)
        else:
            metadata = kernels.build_attention_metadata(
                inputs.query_start_loc, inputs.seq_lens, inputs.block_table, self.block_size)
        return lambda index, query, scale: kernels.paged_attention(query, *caches[index], metadata, scale)

    def _transformers_forward(self, inputs: StepInputs) -> torch.Tensor:
        metadata = kernels.build_attention_metadata(
            inputs.query_start_loc, inputs.seq_lens, inputs.block_table, self.block_size)
        context = _ForwardContext(self.kv_caches, inputs.slot_mapping, metadata)
        hidden = self.model.model(
            input_ids=inputs.input_ids.unsqueeze(0),
            position_ids=inputs.positions.unsqueeze(0),
            use_cache=False,
            batchtop=context,
        ).last_hidden_state[0]
        return self.model.lm_head(hidden[inputs.logits_indices])

"""One step's flat ragged batch as tensors on the model's device: what the runner hands the model."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepInputs:
    input_ids: torch.Tensor          # [num_tokens]
    positions: torch.Tensor          # [num_tokens]
    query_start_loc: torch.Tensor    # [num_rows + 1], exclusive prefix sum of query lengths
    seq_lens: torch.Tensor           # [num_rows]
    block_table: torch.Tensor        # [num_rows, max_blocks]
    slot_mapping: torch.Tensor       # [num_tokens]
    logits_indices: torch.Tensor     # flat index of the last token of every row that samples
    max_query_len: int               # the longest row's number of tokens
    max_seq_len: int                 # the longest row's KV length (an upper bound in a graph's inputs)
    num_actual_tokens: int           # the rows' tokens; the tensors above hold padding beyond them in a graph
    graph_size: int = 0              # the captured batch size this step replays; 0: it runs eagerly

    @property
    def num_padded_tokens(self) -> int:
        """Tokens computed only to fill a graph's captured size (one per padding row)."""
        return self.graph_size - self.num_actual_tokens if self.graph_size else 0

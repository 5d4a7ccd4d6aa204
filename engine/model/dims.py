"""A model's derived dimensions, read once from its transformers config."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> ModelDims:
        """A config without `head_dim` (most Llamas) splits the hidden size evenly over the heads."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, head_dim)

    def kv_bytes_per_token(self, dtype) -> int:
        """A token's K and V in every layer's cache, for a torch dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

"""A model's weight products as a recording's header carries them (the `engine` entry's `weight_macs`):
what the step-time law "products" prices. Here, not in the engine, because batchtop's scheduler inside
vLLM writes them too, and imports nothing of batchtop but telemetry."""
from __future__ import annotations


def weight_macs(config) -> tuple[int, int]:
    """A Llama's weight products in multiply-adds, from its transformers config: per token through every
    layer (the attention's four projections and the gated MLP's three), and per row through the LM head
    (a row's last token, where the engine computes its logits). SmolLM2-135M: 106,168,320 and
    28,311,552."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads    # most Llamas split the hidden size
    attention = hidden * head_dim * (2 * heads + 2 * config.num_key_value_heads)
    mlp = 3 * hidden * config.intermediate_size
    return config.num_hidden_layers * (attention + mlp), hidden * config.vocab_size

"""The model's forward over one step's flat token axis, for Llama models.

transformers' own modules supply the architecture's parts: the embedding, the RMSNorms, the
rotary embedding, the MLP's activation, and the weights; this runs them on `[num_tokens, hidden]`
in the decoder's order. What it adds is speed at the few rows of a decode step, where
transformers' per-layer Python and small ops and MKL's small-M sgemm cost more than streaming the
weights: q/k/v and gate/up run as one GEMM each, every projection goes through the CPU kernel's
packed weights, and each layer's elementwise steps are one fused call each (kernels/cpu.py).
Without the C++ build, off the CPU or off fp32, the same loop runs on transformers' modules op by op
(`TransformersOps`) and one `F.linear` per fused weight. Other architectures run through
transformers' forward with the attention registered by name (runner.py).
"""
from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from batchtop import kernels
from batchtop.kernels import cpu

from .dims import ModelDims

ARCHITECTURES = ("llama",)

# attend(layer_index, query [T, Hq, D], scale) -> [T, Hq, D], over K/V already in that layer's cache
Attend = Callable[[int, torch.Tensor, float], torch.Tensor]


def supports(model) -> bool:
    return model.config.model_type in ARCHITECTURES


class FusedLinear:
    """Linears that read the same input, as one GEMM whose output holds theirs side by side: on the
    packed weights, or torch's fp32 matmul (always unpacked; with packed weights, from
    `torch_from_rows` rows, over the linears' own weights: no second copy)."""

    def __init__(self, *linears: torch.nn.Linear, packed: bool, torch_from_rows: int | None = None):
        weight = torch.cat([linear.weight.detach() for linear in linears])
        self.out_features = weight.shape[0]
        biases = [linear.bias for linear in linears]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else weight.new_zeros(linear.out_features)
             for b, linear in zip(biases, linears)])
        self.packed = cpu.pack_linear(weight) if packed else None
        self.weight = None if packed else weight
        self.torch_from_rows = torch_from_rows if packed else None
        self.linears = linears if self.torch_from_rows else ()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self.torch_from_rows and x.shape[0] >= self.torch_from_rows:
            outs = [F.linear(x, linear.weight, linear.bias) for linear in self.linears]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        out = cpu.packed_linear(x, self.packed)
        return out if self.bias is None else out.add_(self.bias)


class Layer(NamedTuple):
    """A decoder layer's parts in the order the forward uses them (transformers' modules and values,
    read once here rather than through nn.Module attribute lookups at every step)."""

    input_norm: torch.nn.Module
    qkv: FusedLinear
    scaling: float
    o: FusedLinear
    post_norm: torch.nn.Module
    gate_up: FusedLinear
    act_fn: Callable
    down: FusedLinear

    @property
    def linears(self) -> tuple[FusedLinear, ...]:
        return self.qkv, self.o, self.gate_up, self.down


class TransformersOps:
    """A layer's elementwise steps op by op, on transformers' modules (the reference)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def add_rms_norm(self, hidden, delta, norm):
        if delta is not None:
            hidden += delta
        return norm(hidden)

    def rope_and_cache(self, qkv, cos, sin, k_cache, v_cache, slot_mapping):
        heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        q, k, v = (t.view(len(qkv), n, self.head_dim)
                   for t, n in zip(qkv.split([n * self.head_dim for n in heads], dim=-1), heads))
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        kernels.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        return q

    def silu_mul(self, gate_up, act_fn):
        gate, up = gate_up.chunk(2, dim=-1)
        return act_fn(gate) * up


class FusedCpuOps(TransformersOps):
    """The same steps as one C++ call each (kernels/cpu.py); Llama's SiLU MLP, fp32."""

    def add_rms_norm(self, hidden, delta, norm):
        return cpu.add_rms_norm(hidden, delta, norm.weight, norm.variance_epsilon)

    def rope_and_cache(self, qkv, cos, sin, k_cache, v_cache, slot_mapping):
        return cpu.rope_and_cache(qkv, cos, sin, self.num_heads, self.num_kv_heads, k_cache,
                                  v_cache, slot_mapping)

    def silu_mul(self, gate_up, act_fn):
        return cpu.silu_mul(gate_up)


class FlatForward:
    """`hidden = forward(input_ids, positions, kv_caches, slot_mapping, attend)`; `logits(hidden)`."""

    def __init__(self, model, packed: bool | None = None):
        """`packed`: the products on the CPU kernel's packed weights (default: where they beat torch's)."""
        self.model = model.model
        self.placement = (model.device, model.dtype)      # what the fused weights below were made for
        config = model.config
        dims = ModelDims.of(config)
        fused = (model.device.type == "cpu" and model.dtype == torch.float32 and config.hidden_act == "silu"
                 and cpu.available())
        ops = FusedCpuOps if fused else TransformersOps
        self.ops = ops(dims.num_heads, dims.num_kv_heads, dims.head_dim)
        packed = fused and (cpu.products_pay() if packed is None else packed)
        # the step-time law's unit of product work (engine/whatif/steptime.py); None: torch's products
        self.product_tile_rows = cpu.product_tile_rows() if packed else None
        torch_from_rows = cpu.torch_products_from_rows() if packed else None
        linear = partial(FusedLinear, packed=packed, torch_from_rows=torch_from_rows)
        self.layers = [Layer(layer.input_layernorm,
                             linear(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                             layer.self_attn.scaling,
                             linear(layer.self_attn.o_proj),
                             layer.post_attention_layernorm,
                             linear(layer.mlp.gate_proj, layer.mlp.up_proj),
                             layer.mlp.act_fn,
                             linear(layer.mlp.down_proj))
                       for layer in self.model.layers]
        self.lm_head = linear(model.lm_head)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor,
                 attend: Attend) -> torch.Tensor:
        ops, num_tokens = self.ops, input_ids.shape[0]
        hidden = self.model.embed_tokens(input_ids)
        # [T, head_dim], once per step
        cos, sin = (t[0] for t in self.model.rotary_emb(hidden, positions[None]))
        delta = None                       # what the last block adds to the residual stream, added lazily
        for index, layer in enumerate(self.layers):
            x = ops.add_rms_norm(hidden, delta, layer.input_norm)
            query = ops.rope_and_cache(layer.qkv(x), cos, sin, *kv_caches[index], slot_mapping)
            delta = layer.o(attend(index, query, layer.scaling).view(num_tokens, -1))
            x = ops.add_rms_norm(hidden, delta, layer.post_norm)
            delta = layer.down(ops.silu_mul(layer.gate_up(x), layer.act_fn))
        return ops.add_rms_norm(hidden, delta, self.model.norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

"""The CPU's linear method for weights kept in a GGUF file's blocks (cbgen.models.quantized):
each segment (a fused layer's q, k, v or gate, up tensor, each in its own type) packed once
into a cbgen.cpu.quant.PackedWeight; x is quantized per row to 8 bits once for all segments,
as llama.cpp runs them.
"""

from __future__ import annotations

import torch
from torch import nn

from cbgen.cpu import quant
from cbgen.models.base import TORCH_LINEAR, CausalLM, Linear
from cbgen.models.quantized import DequantizingLinear, QuantizedEmbedding, QuantizedWeight


def quantized_types() -> frozenset[int]:
    """The ggml types the kernels here run in their blocks (none without the kernels)."""
    return frozenset(quant.TYPES.values()) if quant.isa() is not None else frozenset()


class QuantLinear:
    """A quantized weight as packed segments (a method per layer: it holds that layer's)."""

    name = "cpu-gguf"

    def __init__(self, packed: quant.PackedWeight) -> None:
        self.packed = packed
        self.k = packed.k
        self.n = packed.n

    @classmethod
    def pack(cls, weight: QuantizedWeight) -> QuantLinear | None:
        """None where a segment's type or shape has no kernel (the layer is then dequantized)."""
        packed = []
        for seg in weight.segments:
            p = quant.pack(seg.type_id, seg.blocks, seg.rows, weight.k)
            if p is None:
                return None
            packed.append((seg.type_id, p, seg.rows))
        return cls(quant.PackedWeight(packed, weight.k))

    @property
    def types(self) -> list[int]:
        return self.packed.types

    def apply(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = self.packed.gemm(rows.float(), bias)
        if y is None:
            raise RuntimeError("quantized matmul: no memory for the activations' 8-bit copy")
        return y.to(x.dtype).reshape(*x.shape[:-1], self.n)


def pack_quantized(model_layers: list[Linear]) -> dict[str, int]:
    """Each layer holding GGUF blocks (DequantizingLinear) gets its QuantLinear, or, where a
    segment has no kernel, its float weight dequantized. Returns how many tensors of each type
    run in their blocks ("Q4_1": 210, ...) and how many were dequantized ("dequantized Q6_K")."""
    names = {v: k for k, v in quant.TYPES.items()}
    counts: dict[str, int] = {}
    for layer in model_layers:
        method = layer.method
        if not isinstance(method, DequantizingLinear):
            continue
        q = QuantLinear.pack(method.weight)
        if q is not None:
            layer.method = q
            for t in q.types:
                counts[names[t]] = counts.get(names[t], 0) + 1
            continue
        layer.weight.data = method.weight.dequantize().to(layer.weight.dtype)
        layer.method = type(layer).method  # the class's: the float reference
        for seg in method.weight.segments:
            key = f"dequantized {_type_name(seg.type_id)}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def pack_quantized_embedding(model: CausalLM) -> dict[str, int]:
    """The token embedding and the LM head kept in their blocks, packed: the embedding's rows
    read from the panels (cbgen_q_rows), and a tied head multiplying by the same panels, so
    the vocabulary's weights are held once; where the shape has no kernel, dequantized to
    float (the float head is then packed as any other). Counts as pack_quantized's."""
    counts: dict[str, int] = {}

    def count(type_id: int, ran: bool) -> None:
        key = _type_name(type_id) if ran else f"dequantized {_type_name(type_id)}"
        counts[key] = counts.get(key, 0) + 1

    tied = model.config.tie_word_embeddings
    embed = model.embed_tokens
    if isinstance(embed, QuantizedEmbedding) and embed.segment is not None:
        seg = embed.segment
        method = QuantLinear.pack(QuantizedWeight(embed.hidden, [seg]))
        if method is None:
            model.embed_tokens = nn.Embedding.from_pretrained(seg.dequantize(), freeze=True)
            if tied:
                model.head_method = TORCH_LINEAR
        else:
            embed.rows = method.packed.rows
            embed.segment = None
            if tied:
                model.head_method = method
        count(seg.type_id, method is not None)
    head = model.head_method
    if not tied and isinstance(head, DequantizingLinear):
        method = QuantLinear.pack(head.weight)
        if method is None:
            model.lm_head_weight.data = head.weight.dequantize()
            model.head_method = TORCH_LINEAR
        else:
            model.head_method = method
        count(head.weight.segments[0].type_id, method is not None)
    return counts


def _type_name(type_id: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(type_id).name

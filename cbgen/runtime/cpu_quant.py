"""The CPU's linear method for weights kept in a GGUF file's blocks (cbgen.models.quantized):
each segment (a fused layer's q, k, v or gate, up tensor, each in its own type) packed once
into a cbgen.cpu.quant.PackedWeight; x is quantized per row to 8 bits once for all segments,
as llama.cpp runs them.
"""

from __future__ import annotations

import torch

from cbgen.cpu import quant
from cbgen.models.base import Linear
from cbgen.models.quantized import DequantizingLinear, QuantizedWeight


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


def _type_name(type_id: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(type_id).name

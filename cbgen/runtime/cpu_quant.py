"""The CPU's linear method for weights kept in a GGUF file's blocks (cbgen.models.quantized):
each segment (a fused layer's q, k, v or gate, up tensor, each in its own type) packed once for
cbgen.cpu.quant.q_gemm, x quantized per row to 8 bits inside the call, as llama.cpp runs them.
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

    def __init__(self, k: int, segments: list[tuple[int, torch.Tensor, int]]) -> None:
        self.k = k
        self.segments = segments
        """(type id, packed bytes, rows), in output-row order."""
        self.n = sum(rows for _, _, rows in segments)

    @classmethod
    def pack(cls, weight: QuantizedWeight) -> QuantLinear | None:
        """None where a segment's type or shape has no kernel (the layer is then dequantized)."""
        packed = []
        for seg in weight.segments:
            p = quant.pack(seg.type_id, seg.blocks, seg.rows, weight.k)
            if p is None:
                return None
            packed.append((seg.type_id, p, seg.rows))
        return cls(weight.k, packed)

    @property
    def types(self) -> list[int]:
        return [t for t, _, _ in self.segments]

    def apply(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if len(self.segments) == 1:
            t, p, n = self.segments[0]
            y = quant.q_gemm(t, rows.float(), p, n, bias)
        else:
            parts, start = [], 0
            for t, p, n in self.segments:
                b = None if bias is None else bias[start : start + n]
                parts.append(quant.q_gemm(t, rows.float(), p, n, b))
                start += n
            y = None if any(part is None for part in parts) else torch.cat(parts, dim=1)  # type: ignore[arg-type]
        if y is None:
            raise RuntimeError("quantized matmul: the kernel could not run (out of memory?)")
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

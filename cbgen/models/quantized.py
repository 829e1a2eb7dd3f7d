"""Linear weights kept in a GGUF file's own quantized blocks (issue 33's quantized execution).

A linear layer whose tensors the loader keeps quantized holds a QuantizedWeight: the file's rows
of blocks (views of the memory-mapped file, or copies where Llama's q/k rows are un-interleaved),
one segment per tensor the layer fuses (q, k, v into qkv_proj: their types may differ, as in
Q4_K_M files), and its float weight holds no storage. The runtime packs the segments into a
method that runs them in their blocks (cbgen.runtime.cpu_quant) and drops the segments; until
then, or where no runtime takes them, DequantizingLinear is the reference: the float32 matmul
on the dequantized weight, the values the float path (--dequantize) loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class QuantSegment:
    type_id: int
    """ggml type id (gguf.GGMLQuantizationType)."""
    blocks: torch.Tensor
    """uint8 [rows, row bytes]: the file's rows of blocks, in the layer's row order."""

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, k], as the float path loads it (gguf's dequantization)."""
        import gguf

        arr = gguf.quants.dequantize(self.blocks.numpy(), gguf.GGMLQuantizationType(self.type_id))
        return torch.from_numpy(np.array(arr, dtype=np.float32))


@dataclass
class QuantizedWeight:
    k: int
    """Input features."""
    segments: list[QuantSegment]
    """Stacked in output-row order, they are the layer's weight [sum of rows, k]."""

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(s.blocks.numel() for s in self.segments)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([s.dequantize() for s in self.segments])


class DequantizingLinear:
    """The reference method of a quantized layer: float32 matmul on its weight dequantized
    anew at every call (slow; the runtime replaces it)."""

    name = "gguf-dequantize"

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight

    def apply(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return F.linear(x, self.weight.dequantize().to(x.dtype), bias)

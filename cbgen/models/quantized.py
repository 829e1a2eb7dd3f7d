"""Linear weights kept in a GGUF file's own quantized blocks (issue 33's quantized execution).

A linear layer whose tensors the loader keeps quantized holds a QuantizedWeight: the file's rows
of blocks (views of the memory-mapped file, or copies where Llama's q/k rows are un-interleaved),
one segment per tensor the layer fuses (q, k, v into qkv_proj: their types may differ, as in
Q4_K_M files), and its float weight holds no storage. The runtime packs the segments into a
method that runs them in their blocks (cbgen.runtime.cpu_quant) and drops the segments; until
then, or where no runtime takes them, DequantizingLinear is the reference: the float32 matmul
on the dequantized weight, the values the float path (--dequantize) loads. The token embedding
and the LM head may stay in their blocks too (QuantizedEmbedding; the head as a QuantizedWeight
under the model's head_method), so the weights take about the file's bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class QuantSegment:
    type_id: int
    """ggml type id (gguf.GGMLQuantizationType)."""
    blocks: torch.Tensor
    """uint8 [rows, row bytes]: the file's rows of blocks, in the layer's row order."""

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [rows, k] (or those rows only), as the float path loads it (gguf's
        dequantization)."""
        import gguf

        blocks = self.blocks.numpy() if rows is None else self.blocks.numpy()[rows.numpy()]
        arr = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(self.type_id))
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


class QuantizedEmbedding(nn.Module):
    """A token embedding kept in the file's blocks: each row looked up is dequantized (the
    float path's values). Until a runtime packs it (then `rows` reads the packed blocks, and a
    tied LM head multiplies by them), the segment's rows are dequantized by the gguf package.
    Its `weight` holds no storage: float32, the activations' dtype."""

    def __init__(self, segment: QuantSegment, hidden: int) -> None:
        super().__init__()
        self.segment: QuantSegment | None = segment
        self.hidden = hidden
        self.num_embeddings = segment.rows
        self.weight = torch.empty(0, dtype=torch.float32)
        self.rows: Callable[[torch.Tensor], torch.Tensor] | None = None
        """The runtime's row reader, once it has packed the blocks."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            return self.rows(ids)
        assert self.segment is not None
        flat = ids.reshape(-1).cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids outside [0, {self.num_embeddings})")
        return self.segment.dequantize(flat).reshape(*ids.shape, self.hidden).to(ids.device)

"""The CPU's linear methods: the weight packed once, when the runtime binds the model, into the
layout of the kernel that serves it. A float32 weight (PackedF32Linear):

    rows <= thresholds.small_gemm_max_rows   cbgen.cpu.gemm.small_gemm over 32-column panels
                                             (tuned per machine; up to 2,048 rows with AVX2)
    more rows                                oneDNN's packed matmul (torch.ops.mkldnn)
    neither copy                             torch's F.linear

A gated MLP's gate-up projection may also apply its activation to small_gemm's tiles as they
are computed (apply_gated): the [T, 2I] product is never written.

A bfloat16 weight (PackedBf16Linear): bf16 panels, float32 activations in and out; widened to
float32 (no bf16 dot products), prompt-sized rows go through small_gemm's row blocks, a panel
widened once per block; either way the gate-up projection applies its activation on its tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cbgen.cpu import bf16, gemm
from cbgen.cpu.linear import pack_weight, packed_linear
from cbgen.models.base import TORCH_LINEAR


@dataclass
class CpuThresholds:
    """Row counts that decide which kernel serves a matmul, for one runtime (the build's
    defaults, or what cbgen.cpu.tuning measured on this machine)."""

    small_gemm_max_rows: int
    """Up to this many rows small_gemm beats oneDNN's packed matmul (0: never)."""
    blocked_rows: int = 0
    """From this many rows on small_gemm packs the rows in blocks that stay in L2 (0: the
    build's default); the same bits either way."""


class PackedF32Linear:
    """A float32 weight as small_gemm's panels and/or oneDNN's packed layout (a method per
    layer: it holds that layer's packed copies)."""

    name = "cpu-f32"

    def __init__(
        self, packed: torch.Tensor | None, panels: torch.Tensor | None, thresholds: CpuThresholds
    ) -> None:
        self.packed = packed
        self.panels = panels
        """small_gemm's panels [N / 32, K, 32] (None: not packed so, e.g. N not a multiple)."""
        self.thresholds = thresholds

    @classmethod
    def pack(
        cls, weight: torch.Tensor, onednn: bool, panels: bool, thresholds: CpuThresholds
    ) -> PackedF32Linear:
        return cls(
            pack_weight(weight) if onednn else None,
            gemm.pack_panels(weight) if panels else None,
            thresholds,
        )

    def apply(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        panels = self.panels
        if (
            panels is not None
            and x.dim() == 2
            and x.shape[0] <= self.thresholds.small_gemm_max_rows
        ):
            return gemm.small_gemm(x, panels, bias, self.thresholds.blocked_rows)
        if self.packed is not None:
            return packed_linear(x, self.packed, bias)
        return F.linear(x, weight, bias)

    def apply_gated(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        panels = self.panels
        if panels is None or x.dim() != 2 or x.dtype != panels.dtype:
            return None
        if x.shape[0] > self.thresholds.small_gemm_max_rows:
            return None  # oneDNN's rows: the gate-up product, then the activation
        return gemm.small_gemm_gated(x, panels, activation, self.thresholds.blocked_rows)


class PackedBf16Linear:
    """A bfloat16 weight as bf16 panels for small_gemm_bf16 (cbgen.cpu.bf16), float32 in and
    out: with dot, bf16 dot products (--dtype bfloat16 where the CPU has them); without, each
    weight widened in registers, the float32 sums on the weight without an upcast copy
    (weights kept in bf16 under float32 arithmetic, and --dtype bfloat16 where bf16 is
    emulated). A method per layer: it holds that layer's panels; what the kernel refuses takes
    torch's upcast matmul."""

    name = "cpu-bf16"

    def __init__(self, panels: torch.Tensor, k: int, dot: bool) -> None:
        self.panels = panels
        self.k = k
        self.dot = dot

    @classmethod
    def pack(cls, weight: torch.Tensor, dot: bool) -> PackedBf16Linear | None:
        """None where the weight cannot be packed so (not bf16, N not a multiple of 32, no
        kernels)."""
        panels = bf16.pack_panels_bf16(weight)
        return None if panels is None else cls(panels, weight.shape[1], dot)

    def apply(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:
            y = bf16.small_gemm_bf16(x, self.panels, self.k, bias, self.dot)
            if y is not None:
                return y
        # what the kernel refuses: torch's matmul on the weight, rebuilt from the panels where
        # the layer no longer holds it (the runtime frees it once packed)
        return TORCH_LINEAR.apply(x, weight if weight.numel() else self.unpack(), bias)

    def apply_gated(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """The activation on the product's tiles (the same bits as the product and then the
        activation): with dot products for any rows; widened, prompt-sized rows through
        small_gemm's row blocks, each panel widened to float32 once per block."""
        if x.dim() != 2 or x.dtype != torch.float32:
            return None
        return bf16.small_gemm_gated_bf16(x, self.panels, self.k, activation, self.dot)

    def unpack(self) -> torch.Tensor:
        """The weight [N, k] the panels were packed from (k in pairs: [P, K2, 32, 2])."""
        p, kp, panel = self.panels.shape
        pairs = self.panels.view(p, kp // 2, panel, 2).permute(0, 2, 1, 3)
        return pairs.reshape(p * panel, kp)[:, : self.k]

"""The decoder's element-wise ops as C kernels (CPU, float32): residual add + RMSNorm in one
pass, q/k norms and RoPE in place in the QKV rows (RoPE from the float32 tables), and SiLU x up
(GELU x up for Gemma) in one pass over the gate-up projection (or, where small_gemm serves the
gate-up matmul, on its tiles: cbgen.runtime.cpu_linear.PackedF32Linear.apply_gated). Each is tested against
cbgen.models.ops.TorchOps, the reference (tests/cpu/test_native.py): RoPE and the residual add bit for
bit, the norms (sums in double) and the activations (vexp.h's exp) to a few ulp.
"""

from __future__ import annotations

from typing import Any

import torch

from cbgen.cpu import kernels
from cbgen.models.ops import TORCH_OPS


class CpuOps:
    name = "cpu"

    def add_rmsnorm_(
        self, residual: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return kernels.add_rmsnorm_(residual, h, weight, eps)

    def rope_tables(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return positions.contiguous(), cos, sin

    def rope_(self, x: torch.Tensor, num_heads: int, head_dim: int, tables: Any) -> None:
        positions, cos, sin = tables
        if 2 * cos.shape[1] < head_dim:  # partial rotary: the kernel turns whole heads only
            torch_tables = TORCH_OPS.rope_tables(cos, sin, positions, x.dtype)
            TORCH_OPS.rope_(x, num_heads, head_dim, torch_tables)
            return
        kernels.rope_(x, num_heads, head_dim, positions, cos, sin)

    def rmsnorm_heads_(
        self, x: torch.Tensor, num_heads: int, head_dim: int, weight: torch.Tensor, eps: float
    ) -> None:
        kernels.rmsnorm_heads_(x, num_heads, head_dim, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.gelu_tanh_mul(gate_up)


CPU_OPS = CpuOps()

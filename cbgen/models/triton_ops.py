"""The decoder's element-wise ops as Triton kernels (cbgen_kernels), the loader's choice on CUDA
when triton imports: residual add + RMSNorm in one pass, RoPE in place with the cos/sin tables
gathered inside the kernel (also fused with the new K/V's write into the paged cache, for the
triton backend: RopeKvOps), SiLU x up in one pass over the gate-up projection, and a
mixture-of-experts layer's expert MLPs as grouped matmuls. Each rounds
as cbgen.models.ops.TorchOps, the reference, does (tests/kernels/test_triton_ops.py).

Triton is an optional dependency, so this module imports without it; cbgen_kernels (and
triton) are imported when a TritonOps is built.
"""

from __future__ import annotations

from typing import Any

import torch

from cbgen.models.ops import TORCH_OPS


class TritonOps:
    name = "triton"

    def __init__(self) -> None:
        import cbgen_kernels

        self.kernels = cbgen_kernels

    def add_rmsnorm_(
        self, residual: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self.kernels.add_rmsnorm_(residual, h, weight, eps)

    def rope_tables(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's positions and the float32 tables themselves: the kernel gathers the rows
        and rounds them to the activation dtype (x's, which is dtype), as the reference does."""
        return positions.contiguous(), cos, sin

    def rope_(self, x: torch.Tensor, num_heads: int, head_dim: int, tables: Any) -> None:
        positions, cos, sin = tables
        self.kernels.rope_(x, num_heads, head_dim, positions, cos, sin)

    def rope_write_kv_(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        tables: Any,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        positions, cos, sin = tables
        self.kernels.rope_write_kv_(
            qkv, num_heads, num_kv_heads, head_dim, positions, cos, sin, kv_cache, slot_mapping
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)

    def grouped_experts(
        self,
        x: torch.Tensor,
        token_rows: torch.Tensor,
        expert_offsets: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
    ) -> torch.Tensor:
        """cbgen.models.moe.grouped_experts in two grouped-matmul launches (no host read)."""
        return self.kernels.grouped_moe(x, token_rows, expert_offsets, w_gate_up, w_down)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """No kernel of its own: the reference's."""
        return TORCH_OPS.gelu_tanh_mul(gate_up)

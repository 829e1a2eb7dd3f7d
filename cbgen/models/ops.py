"""The element-wise ops of a decoder layer, behind one small interface, so that each model's
forward is written once and its speed is a property of the ops it is given:

    TorchOps   the reference, in torch: correct on any device and dtype
    CpuOps     cbgen.cpu's C kernels (CPU, float32), tested against TorchOps

Every op computes what the reference formulation computes, rounding included:

    h = residual + block(norm(h))   is written   residual += h; x = norm(residual); h = block(x)
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F


class Ops(Protocol):
    name: str

    def add_rmsnorm_(
        self, residual: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += h (in place; h None: no add), then RMSNorm(residual) * weight."""
        ...

    def rope_tables(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> Any:
        """What rope_ needs for this batch's positions, from the float32 tables [P, R/2] (R, the
        rotary dims of a head: head_dim, or fewer under partial rotary); built once per forward."""
        ...

    def rope_(self, x: torch.Tensor, num_heads: int, head_dim: int, tables: Any) -> None:
        """Rotate the first num_heads * head_dim columns of every row of x [T, >= that]
        (rows may be strided) in place, as rotate_half RoPE does: the first R dims of each head,
        R from the tables; the rest of the head passes through."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up for gate_up = [gate | up] along the last dimension."""
        ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GELU(gate) * up, GELU in its tanh approximation (GeGLU: Gemma), for gate_up as in
        silu_mul."""
        ...


@runtime_checkable
class RopeKvOps(Protocol):
    """Ops that also rotate q and k and write the new K/V into the paged cache in one pass
    (TritonOps), for a backend that then only attends (AttentionBackend.attends_written_kv)."""

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
        """rope_(qkv, num_heads + num_kv_heads, head_dim, tables) on the rows of qkv =
        | q | k | v | (num_heads, num_kv_heads, num_kv_heads heads), then the rotated k and v
        written into kv_cache [2, blocks, block_size, num_kv_heads, head_dim] at slot_mapping
        (negative slots: nothing written), as the backends' write_kv_cache does."""
        ...


@runtime_checkable
class HeadNormOps(Protocol):
    """Ops that apply q/k norms (one RMSNorm weight per head size) in place, in the rows of the
    QKV projection (CpuOps), so q and k stay where RoPE and the K/V write read them."""

    def rmsnorm_heads_(
        self, x: torch.Tensor, num_heads: int, head_dim: int, weight: torch.Tensor, eps: float
    ) -> None:
        """RMSNorm(head) * weight, in place, for each of the first num_heads heads of every row
        of x [T, >= num_heads * head_dim] (rows may be strided)."""
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Computed in float32 and cast back, as the reference implementations do."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x * cos + rotate_half(x) * sin in place, per half: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s]
    (the same float operations as the reference formulation, without its concatenations)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x1_sin, x2_sin = x1 * sin, x2 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)


class TorchOps:
    name = "torch"

    def add_rmsnorm_(
        self, residual: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if h is not None:
            residual.add_(h)
        return rms_norm(residual, weight, eps)

    def rope_tables(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cos[positions].to(dtype)[:, None, :], sin[positions].to(dtype)[:, None, :]

    def rope_(self, x: torch.Tensor, num_heads: int, head_dim: int, tables: Any) -> None:
        cos, sin = tables
        heads = x[:, : num_heads * head_dim].view(x.shape[0], num_heads, head_dim)
        rotate_(heads[..., : 2 * cos.shape[-1]], cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


TORCH_OPS = TorchOps()

"""small_gemm, cbgen's own matmul for few rows (csrc/small_gemm.c): weights packed once into
32-column k-major panels (in huge pages: cbgen.cpu.arena), the product with or without bias, and
the gated form that applies the MLP's activation as it goes.
"""

from __future__ import annotations

import torch

from cbgen.cpu import build
from cbgen.cpu.arena import WEIGHTS
from cbgen.cpu.checks import check, check_contiguous, library
from cbgen.cpu.thresholds import build_small_gemm_blocked_rows

PANEL = 32
"""Output columns per packed panel of small_gemm (N must be a multiple)."""


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] float32 packed for small_gemm (in huge pages where the OS gives them);
    None when N is not a multiple of 32, the weight not float32, or the kernels unavailable."""
    if weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(
            f"weight: expected a 2-D CPU tensor, got shape {list(weight.shape)} on {weight.device}"
        )
    lib = build.load_library()
    n, k = weight.shape
    if lib is None or weight.dtype != torch.float32 or n % PANEL:
        return None
    w = weight.contiguous()
    out = WEIGHTS.empty(n * k)
    lib.cbgen_pack_panels_f32(w.data_ptr(), n, k, out.data_ptr())
    return out.view(n // PANEL, k, PANEL)


def small_gemm(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, blocked_from: int = 0
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias [N]) for W [N, K] packed by pack_panels into panels
    [N / 32, K, 32] (all float32, M small: see build_small_gemm_max_rows); from blocked_from
    rows on (0: the build's default) in row blocks, the same bits either way."""
    check("panels", panels, torch.float32, ("P", "K", PANEL))
    check_contiguous("panels", panels)
    p, k, _ = panels.shape
    check("x", x, torch.float32, ("M", k))
    if bias is not None:
        check("bias", bias, torch.float32, (p * PANEL,))
    lib = library()
    x = x.contiguous()
    m, n = x.shape[0], p * PANEL
    y = torch.empty(m, n, dtype=torch.float32)
    b = None if bias is None else bias.contiguous()
    lib.cbgen_small_gemm_f32(
        x.data_ptr(),
        m,
        k,
        panels.data_ptr(),
        n,
        None if b is None else b.data_ptr(),
        blocked_from,
        y.data_ptr(),
    )
    return y


GATED_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
"""The activations small_gemm_gated applies: SiLU, GELU's tanh form (GeGLU)."""


def small_gemm_gated(
    x: torch.Tensor, panels: torch.Tensor, activation: str, blocked_from: int = 0
) -> torch.Tensor | None:
    """act(x @ W_gate.T) * (x @ W_up.T) [M, I] for a gate-up weight [2I, K] packed by
    pack_panels (gate rows first), in one pass that never writes the gate-up product: the same
    bits as silu_mul / gelu_tanh_mul of small_gemm's result. None where it does not serve:
    fewer rows than blocked_from (0: the build's default; it runs the row blocks only), I not
    a multiple of 32, or no memory for the blocks."""
    check("panels", panels, torch.float32, ("P", "K", PANEL))
    check_contiguous("panels", panels)
    p, k, _ = panels.shape
    check("x", x, torch.float32, ("M", k))
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(
            f"activation: expected one of {sorted(GATED_ACTIVATIONS)}, got {activation!r}"
        )
    m, i = x.shape[0], p * PANEL // 2
    if m < (blocked_from if blocked_from > 0 else build_small_gemm_blocked_rows()) or p % 2:
        return None
    lib = library()
    x = x.contiguous()
    y = torch.empty(m, i, dtype=torch.float32)
    act = GATED_ACTIVATIONS[activation]
    if lib.cbgen_small_gemm_gated_f32(x.data_ptr(), m, k, panels.data_ptr(), i, act, y.data_ptr()):
        return None
    return y

"""Matmuls over bfloat16 weights (cbgen/cpu/csrc/small_gemm_bf16.c): x and y float32, the weight
packed once into bf16 panels, read two ways:

    dot=False   each weight widened to float32 in registers: the float32 sums on the upcast
                weight, bit for bit small_gemm's, from half the memory traffic (any ISA)
    dot=True    x rounded to bf16 and bf16 dot products (AVX512_BF16: two multiply-adds a lane
                and instruction); a bf16 matmul's result, not float32's
"""

from __future__ import annotations

import torch

from cbgen.cpu import build
from cbgen.cpu.arena import WEIGHTS
from cbgen.cpu.gemm import GATED_ACTIVATIONS

PANEL = 32
"""Output columns per packed panel (N must be a multiple)."""


def native() -> bool:
    """Whether the kernels' bf16 matmul uses bf16 dot products (False: it widens to float32,
    or there are no kernels)."""
    lib = build.load_library()
    return lib is not None and bool(lib.cbgen_bf16_native())


def pack_panels_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] bfloat16 packed for small_gemm_bf16 (in huge pages where the OS gives
    them: cbgen.cpu.arena); None when N is not a multiple of 32, the weight not bfloat16, or
    the kernels unavailable."""
    if weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(
            f"weight: expected a 2-D CPU tensor, got shape {list(weight.shape)} on {weight.device}"
        )
    lib = build.load_library()
    n, k = weight.shape
    if lib is None or weight.dtype != torch.bfloat16 or n % PANEL:
        return None
    w = weight.contiguous()
    kp = int(lib.cbgen_panel_k_bf16(k))
    out = WEIGHTS.empty(n * kp, torch.bfloat16).view(n // PANEL, kp, PANEL)
    lib.cbgen_pack_panels_bf16(w.data_ptr(), n, k, out.data_ptr())
    return out


def small_gemm_bf16(
    x: torch.Tensor,
    panels: torch.Tensor,
    k: int,
    bias: torch.Tensor | None,
    dot: bool = False,
    blocked_from: int = 0,
) -> torch.Tensor | None:
    """x [M, k] float32 @ W.T (+ bias [N] float32) for W [N, k] bfloat16 packed by
    pack_panels_bf16 into panels; float32 [M, N]; dot: bf16 dot products (see the module
    docstring; native() says whether the build has them). Widened, from blocked_from rows on
    (0: small_gemm's build default) the rows go through small_gemm's row blocks, each panel
    widened to float32 once per block: the same bits. None without the kernels, without dot
    products where dot asks for them, or without memory for x's copy."""
    if panels.dtype != torch.bfloat16 or panels.dim() != 3 or panels.shape[2] != PANEL:
        raise ValueError(f"panels: expected bf16 [P, K, {PANEL}], got {tuple(panels.shape)}")
    if not panels.is_contiguous():
        raise ValueError("panels: must be contiguous")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x: expected float32 [M, {k}], got {x.dtype} {tuple(x.shape)}")
    n = panels.shape[0] * PANEL
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
        raise ValueError(f"bias: expected float32 [{n}], got {bias.dtype} {tuple(bias.shape)}")
    lib = build.load_library()
    if lib is None:
        return None
    if panels.shape[1] != lib.cbgen_panel_k_bf16(k):
        raise ValueError(f"panels: packed for another k than {k}")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    b = None if bias is None else bias.contiguous()
    rc = lib.cbgen_small_gemm_bf16(
        x.data_ptr(),
        m,
        k,
        panels.data_ptr(),
        n,
        None if b is None else b.data_ptr(),
        int(dot),
        blocked_from,
        y.data_ptr(),
    )
    return None if rc else y


def small_gemm_gated_bf16(
    x: torch.Tensor,
    panels: torch.Tensor,
    k: int,
    activation: str,
    dot: bool = False,
    blocked_from: int = 0,
) -> torch.Tensor | None:
    """act(x @ W_gate.T) * (x @ W_up.T) [M, I] for a bf16 gate-up weight [2I, k] packed by
    pack_panels_bf16 (gate rows first), in one pass that never writes the gate-up product: the
    same bits as small_gemm_bf16 in the same mode, then the activation pass (kernels.silu_mul,
    gelu_tanh_mul). dot: bf16 dot products, any number of rows; widened: gemm.small_gemm_gated
    on the panels widened once per row block, from blocked_from rows on (0: small_gemm's build
    default). None where it does not serve: fewer rows than that, an odd number of panels, no
    kernels, no dot products in the build, or no memory for x's copy."""
    if panels.dtype != torch.bfloat16 or panels.dim() != 3 or panels.shape[2] != PANEL:
        raise ValueError(f"panels: expected bf16 [P, K, {PANEL}], got {tuple(panels.shape)}")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x: expected float32 [M, {k}], got {x.dtype} {tuple(x.shape)}")
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(
            f"activation: expected one of {sorted(GATED_ACTIVATIONS)}, got {activation!r}"
        )
    lib = build.load_library()
    p, m = panels.shape[0], x.shape[0]
    if lib is None or p % 2 or not panels.is_contiguous():
        return None
    if panels.shape[1] != lib.cbgen_panel_k_bf16(k):
        raise ValueError(f"panels: packed for another k than {k}")
    if not dot and m < (blocked_from if blocked_from > 0 else lib.cbgen_small_gemm_blocked_rows()):
        return None
    x = x.contiguous()
    i = p * PANEL // 2
    y = torch.empty(m, i, dtype=torch.float32)
    kernel = lib.cbgen_small_gemm_gated_bf16_dot if dot else lib.cbgen_small_gemm_gated_bf16w
    rc = kernel(
        x.data_ptr(), m, k, panels.data_ptr(), i, GATED_ACTIVATIONS[activation], y.data_ptr()
    )
    return None if rc else y

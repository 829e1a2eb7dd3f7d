"""Rounding float32 values to the activation dtype, the same on the GPU and in the interpreter.

Compiled, x.to(tl.bfloat16) rounds to nearest even, as torch does. The Triton interpreter keeps
bfloat16 as raw 16-bit words and its conversion drops the low 16 bits of the float32 word
(truncation), so a kernel that rounds to bfloat16 and compares with torch would be off by an
ulp in about half of its values there. Under the interpreter the kernels of this package round
in integer arithmetic first (a no-op on the GPU, where SOFT_BF16 is False):

    bits + 0x7FFF + (bit 16 of bits), then clear the low 16 bits   (round half to even)

INTERPRETED says which of the two this process built the package's kernels for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """x (float32) rounded to nearest even in dtype."""
    if SOFT_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def _is_interpreted() -> bool:
    """Whether triton.jit gives interpreted functions here (TRITON_INTERPRET=1 was set before
    triton was first imported): then every kernel of the package runs on CPU tensors."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - very old triton
        return False
    return isinstance(round_to, InterpretedFunction)


INTERPRETED = _is_interpreted()


def soft_bf16(dtype: torch.dtype) -> bool:
    """Whether kernels writing dtype must round to bfloat16 in integers (the interpreter)."""
    return INTERPRETED and dtype == torch.bfloat16

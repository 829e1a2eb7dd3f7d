"""What every kernel wrapper shares: the checks of each tensor handed to C as a raw pointer
(dtype, shape, layout, device; TypeError or ValueError, checks that hold under `python -O` too),
the library for the ops whose callers checked availability, and the kernels' encodings of an
absent sliding window and softcap.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from cbgen.cpu import build


def check(
    name: str, t: torch.Tensor, dtype: torch.dtype, shape: Sequence[int | str] | None = None
) -> None:
    """t is a CPU tensor of dtype and, when shape is given, of that shape (a str: any size,
    named for the message). TypeError for the dtype, ValueError for the rest."""
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype}, got {t.dtype}")
    if not t.is_cpu:
        raise ValueError(f"{name}: expected a CPU tensor, got one on {t.device}")
    if shape is None:
        return
    # a plain loop: these checks run for every kernel call of every layer (~700 a decode step)
    got = t.shape
    bad = len(got) != len(shape)
    if not bad:
        for want, n in zip(shape, got, strict=False):  # lengths equal: checked above
            if want.__class__ is int and want != n:
                bad = True
                break
    if bad:
        want_text = ", ".join(str(w) for w in shape)
        raise ValueError(f"{name}: expected shape [{want_text}], got {list(got)}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor, got strides {t.stride()} for shape {list(t.shape)}"
        )


def library() -> ctypes.CDLL:
    """The kernels, for the ops whose callers checked fused_ops_available()."""
    lib = build.load_library()
    if lib is None:
        raise RuntimeError(build.native_status())
    return lib


def window(sliding_window: int | None) -> int:
    """The kernels' window argument: 0 for none."""
    if sliding_window is None:
        return 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window: must be >= 1, got {sliding_window}")
    return sliding_window


def softcap(logit_softcap: float | None) -> float:
    """The kernels' softcap argument: 0 for none."""
    if logit_softcap is None:
        return 0.0
    if not logit_softcap > 0:
        raise ValueError(f"logit_softcap: must be > 0, got {logit_softcap}")
    return logit_softcap

"""Which attention backend runs: the auto choice, and why an explicit choice cannot run.

auto on CUDA   flash when vllm_flash_attn imports and takes the dtype and block size (and
               the model's sliding window / soft-capping), else triton when it imports,
               else torch
auto elsewhere cpu (the C kernels, the torch path where they cannot run)
"""

from __future__ import annotations

from typing import get_args

import torch

from cbgen.attention.base import AttentionBackend
from cbgen.attention.cpu_backend import CpuAttentionBackend
from cbgen.attention.flash_backend import FlashAttentionBackend, flash_available, flash_fits
from cbgen.attention.torch_backend import TorchAttentionBackend
from cbgen.attention.triton_backend import (
    TritonAttentionBackend,
    triton_available,
    triton_interpreted,
)
from cbgen.config import AttentionBackendName


def resolve_backend_name(
    requested: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
) -> str:
    """The backend to run for what was asked (see the module docstring). An explicit choice
    that cannot run raises ValueError saying why; triton on the CPU runs only under the
    Triton interpreter (tests)."""
    if requested not in get_args(AttentionBackendName):
        raise ValueError(f"attention_backend: unknown backend {requested!r}")
    is_cuda = device.type == "cuda"
    if requested == "auto":
        if is_cuda and flash_fits(dtype, block_size) is None and flash_available():
            return "flash"
        if is_cuda and triton_available():
            return "triton"
        return "cpu" if device.type == "cpu" else "torch"
    if requested == "cpu" and device.type != "cpu":
        raise ValueError(
            f"attention_backend: cpu runs on the CPU, not {device.type}; use auto or torch"
        )
    if requested == "flash":
        if not is_cuda:
            raise ValueError("attention_backend: flash needs a CUDA device")
        why = flash_fits(dtype, block_size)
        if why is not None:
            raise ValueError(f"attention_backend: {why}")
        if flash_available() is None:
            raise ValueError(
                "attention_backend: flash needs vllm_flash_attn (standalone or inside vLLM), "
                "which does not import here"
            )
    if requested == "triton":
        if not triton_available():
            raise ValueError("attention_backend: triton is not installed (pip install triton)")
        if not is_cuda and not triton_interpreted():
            raise ValueError(
                "attention_backend: triton needs a CUDA device; on the CPU it runs only under the "
                "Triton interpreter (TRITON_INTERPRET=1 set before triton is imported)"
            )
    return requested


def get_attention_backend(
    requested: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    sliding_window: bool = False,
    logit_softcap: bool = False,
) -> AttentionBackend:
    """The backend to run: see resolve_backend_name. For a model with sliding windows or
    soft-capping, auto passes over a flash build that cannot apply them; an explicit choice
    that cannot raises ValueError saying why."""
    backend = _build(resolve_backend_name(requested, device, dtype, block_size))
    why = backend.unsupported(sliding_window, logit_softcap)
    if why is not None and requested == "auto" and backend.name == "flash" and triton_available():
        backend, why = TritonAttentionBackend(), None
    if why is not None:  # never attend without what the model's layers ask for
        raise ValueError(f"attention_backend: {why}")
    return backend


def _build(name: str) -> AttentionBackend:
    if name == "cpu":
        return CpuAttentionBackend()
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        return TritonAttentionBackend()
    return FlashAttentionBackend()

"""The attention backend interface, its per-step metadata, and backend selection."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from cbgen.attention import native, torch_backend


@dataclass
class AttentionMetadata:
    """The flat batch as attention sees it (see torch_backend for the index layout)."""

    slot_mapping: torch.Tensor  # [T] int64, flat KV slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context + new tokens
    block_table: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    block_size: int
    state: Any = None
    """Backend-specific index work, built once per step by AttentionBackend.prepare."""


class AttentionBackend:
    """Base: the torch reference. Subclasses override prepare/attend."""

    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        plan = torch_backend.plan_attention(
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_size,
            native=meta.block_table.device.type == "cpu",
        )
        has_negative = bool((meta.slot_mapping < 0).any()) if meta.slot_mapping.numel() else False
        meta.state = (plan, has_negative)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        plan, has_negative = meta.state
        on_cpu = query.device.type == "cpu"
        if not (on_cpu and native.write_kv_f32(key, value, kv_cache, meta.slot_mapping)):
            torch_backend.write_kv_cache(key, value, kv_cache, meta.slot_mapping, has_negative)
        return torch_backend.attend(query, kv_cache, plan, scale, native=on_cpu)


def flash_available() -> str | None:
    """The module path of an importable vllm_flash_attn, or None."""
    for name in ("vllm_flash_attn", "vllm.vllm_flash_attn"):
        try:
            mod = importlib.import_module(name)
        except Exception:
            continue
        if hasattr(mod, "flash_attn_varlen_func"):
            return name
    return None


def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except Exception:
        return False
    return True


def triton_interpreted() -> bool:
    """True when cbgen_kernels was built for the Triton interpreter (TRITON_INTERPRET=1 was set
    before triton was first imported), so the kernels run on CPU tensors."""
    try:
        kernels = importlib.import_module("cbgen_kernels")
    except Exception:
        return False
    return bool(kernels.interpreted())


FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_fits(dtype: torch.dtype | None, block_size: int | None) -> str | None:
    """Why the flash kernels cannot take this dtype or block size (None: they can, or unknown)."""
    if dtype is not None and dtype not in FLASH_DTYPES:
        return f"flash runs float16 and bfloat16, not {str(dtype).removeprefix('torch.')}"
    if block_size is not None and block_size % 16:
        return f"flash needs a block_size that is a multiple of 16, not {block_size}"
    return None


def resolve_backend_name(
    requested: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
) -> str:
    """auto: flash when vllm_flash_attn imports (on CUDA, for a 16-bit dtype and a block_size
    that is a multiple of 16, when those are given), else triton on CUDA, else torch. An
    explicit choice that cannot run raises ValueError saying why. triton on the CPU runs only
    under the Triton interpreter (tests)."""
    if requested not in ("auto", "torch", "triton", "flash"):
        raise ValueError(f"attention_backend: unknown backend {requested!r}")
    is_cuda = device.type == "cuda"
    if requested == "auto":
        if is_cuda and flash_fits(dtype, block_size) is None and flash_available():
            return "flash"
        if is_cuda and triton_available():
            return "triton"
        return "torch"
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
) -> AttentionBackend:
    """The backend to run: see resolve_backend_name."""
    name = resolve_backend_name(requested, device, dtype, block_size)
    if name == "torch":
        return AttentionBackend()
    if name == "triton":
        from cbgen.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from cbgen.attention.flash_backend import FlashAttentionBackend

    return FlashAttentionBackend()

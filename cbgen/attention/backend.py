"""The attention backend interface, its per-step metadata, and backend selection."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from cbgen.attention import torch_backend


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
        meta.state = torch_backend.plan_attention(
            meta.block_table, meta.query_start_loc, meta.seq_lens, meta.block_size
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        torch_backend.write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        return torch_backend.attend(query, kv_cache, meta.state, scale)


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


def resolve_backend_name(requested: str, device: torch.device) -> str:
    """auto: flash when vllm_flash_attn imports (CUDA only), else triton on CUDA, else torch.
    An explicit choice that cannot run raises ValueError saying why."""
    is_cuda = device.type == "cuda"
    if requested == "auto":
        if is_cuda and flash_available():
            return "flash"
        if is_cuda and triton_available():
            return "triton"
        return "torch"
    if requested == "flash":
        if not is_cuda:
            raise ValueError("attention_backend: flash needs a CUDA device")
        if flash_available() is None:
            raise ValueError(
                "attention_backend: flash needs vllm_flash_attn (standalone or inside vLLM), "
                "which does not import here"
            )
    if requested == "triton" and not triton_available():
        raise ValueError("attention_backend: triton is not installed (pip install triton)")
    if requested not in ("torch", "triton", "flash"):
        raise ValueError(f"attention_backend: unknown backend {requested!r}")
    return requested


def get_attention_backend(requested: str, device: torch.device) -> AttentionBackend:
    name = resolve_backend_name(requested, device)
    if name == "torch":
        return AttentionBackend()
    if name == "triton":
        from cbgen.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from cbgen.attention.flash_backend import FlashAttentionBackend

    return FlashAttentionBackend()

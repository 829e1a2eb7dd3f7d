"""The flash attention backend: vllm_flash_attn's paged varlen kernel, one call per layer for
the whole mixed batch (prefill chunks and decodes alike).

    flash_attn_varlen_func(q [T, H, D], k_cache, v_cache [num_blocks, block_size, Hkv, D],
        cu_seqlens_q = query_start_loc, seqused_k = seq_lens, block_table,
        max_seqlen_q, max_seqlen_k, causal=True)

With seqused_k and causal=True the mask is aligned bottom-right, which is exactly our rule:
query j of a chunk of query_len tokens sees keys [0, seq_len - query_len + j]. New K/V go in
through cbgen_kernels.write_kv_cache (the torch reference when triton is missing).

A sliding window W is window_size=(W - 1, 0): flash-attention's query i sees keys
[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right], i.e. our p - W < j <= p
(the kernel skips the key blocks before, so freed blocks are never read). Soft-capping is its
softcap argument (0.0: none). A build whose function lacks either argument is refused at
start-up for a model that needs it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from cbgen.attention import torch_backend
from cbgen.attention.base import AttentionBackend, AttentionMetadata

FLASH_DTYPES = (torch.float16, torch.bfloat16)


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


def flash_fits(dtype: torch.dtype | None, block_size: int | None) -> str | None:
    """Why the flash kernels cannot take this dtype or block size (None: they can, or unknown)."""
    if dtype is not None and dtype not in FLASH_DTYPES:
        return f"flash runs float16 and bfloat16, not {str(dtype).removeprefix('torch.')}"
    if block_size is not None and block_size % 16:
        return f"flash needs a block_size that is a multiple of 16, not {block_size}"
    return None


def _pick_fa_version(module: Any, varlen: Callable[..., Any]) -> int | None:
    """FA3 where the installed build supports it on this GPU (Hopper), else FA2; None for
    builds whose varlen function takes no fa_version."""
    if "fa_version" not in inspect.signature(varlen).parameters:
        return None
    supported = getattr(module, "is_fa_version_supported", None)
    if supported is not None:
        try:
            if supported(3):
                return 3
        except Exception:
            pass
    return 2


class FlashAttentionBackend(AttentionBackend):
    name = "flash"

    def __init__(self, module_name: str | None = None) -> None:
        module_name = module_name or flash_available()
        if module_name is None:
            raise ValueError(
                "attention_backend: flash needs vllm_flash_attn (standalone or inside vLLM), "
                "which does not import here"
            )
        self.module = importlib.import_module(module_name)
        self.varlen: Callable[..., torch.Tensor] = self.module.flash_attn_varlen_func
        self.fa_version = _pick_fa_version(self.module, self.varlen)
        params = inspect.signature(self.varlen).parameters
        self.takes_window = "window_size" in params
        self.takes_softcap = "softcap" in params
        try:
            import cbgen_kernels

            self.write_kv: Callable[..., None] = cbgen_kernels.write_kv_cache
        except ImportError:
            self.write_kv = torch_backend.write_kv_cache

    def unsupported(self, sliding_window: bool, logit_softcap: bool) -> str | None:
        missing = [
            arg
            for arg, needed, taken in (
                ("window_size", sliding_window, self.takes_window),
                ("softcap", logit_softcap, self.takes_softcap),
            )
            if needed and not taken
        ]
        if not missing:
            return None
        return (
            f"flash: this {self.module.__name__}.flash_attn_varlen_func takes no "
            f"{' or '.join(missing)}, which the model needs; use --attention-backend triton"
        )

    def prepare(self, meta: AttentionMetadata) -> None:
        # The paged kernel reads pages of 16-token multiples (vLLM's layout rule for it).
        why = flash_fits(None, meta.block_size)
        if why is not None:
            raise ValueError(f"attention_backend: {why} (use --attention-backend triton)")
        meta.state = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        why = self.unsupported(sliding_window is not None, logit_softcap is not None)
        if why is not None:
            raise ValueError(f"attention_backend: {why}")
        why = flash_fits(query.dtype, None)
        if why is not None:
            raise ValueError(
                f"attention_backend: {why} (use --dtype bfloat16 or --attention-backend triton)"
            )
        self.write_kv(key, value, kv_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        extra: dict[str, Any] = {} if self.fa_version is None else {"fa_version": self.fa_version}
        if sliding_window is not None:
            extra["window_size"] = (sliding_window - 1, 0)
        if logit_softcap is not None:
            extra["softcap"] = logit_softcap
        self.varlen(
            q=query,
            k=kv_cache[0],
            v=kv_cache[1],
            max_seqlen_q=meta.max_query_len,
            cu_seqlens_q=meta.query_start_loc,
            max_seqlen_k=meta.max_seq_len,
            seqused_k=meta.seq_lens,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_table,
            out=out,
            **extra,
        )
        return out

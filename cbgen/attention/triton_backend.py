"""The triton attention backend: the kernels of cbgen_kernels (kernels/), the default on CUDA.

Each layer writes its new K/V (write_kv_cache), then attends; or only attends (attend), where
the model's ops have written them already, fused with RoPE (rope_write_kv_). How it attends is
decided once per step, by the first layer, and reused by the others:
  - a batch with any prefill chunk: one paged_attention launch for the whole mixed batch;
  - a decode-only batch with too few (sequence, KV head) pairs to fill the GPU and contexts
    long enough to share out (choose_num_splits): the split-KV (flash-decoding) kernel, whose
    float32 workspace is allocated once per step and reused by every layer;
  - any other decode-only batch: the plain launch.
Sliding windows and logit soft-capping go to the kernels as arguments of each layer's launch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cbgen.attention.base import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from cbgen_kernels import SplitWorkspace


def triton_available() -> bool:
    """Whether triton imports (it is an optional dependency)."""
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


@dataclass
class TritonPlan:
    decode_only: bool
    """Every sequence has one query token: split-KV may pay off."""
    num_splits: int | None = None
    """1: one launch; > 1: split-KV over that many key ranges, then a merge. None until the
    first layer of the step, which knows the number of KV heads, decides it."""
    workspace: SplitWorkspace | None = None
    """Float32 partial results of this step, allocated by the first layer that splits."""


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    attends_written_kv = True

    def __init__(
        self, num_sms: int | None = None, min_keys_per_split: int = 256, max_splits: int = 16
    ) -> None:
        """num_sms: the GPU's SM count (None: asked of the device at the first step);
        min_keys_per_split, max_splits: bounds of the split-KV policy (choose_num_splits)."""
        import cbgen_kernels

        self.kernels = cbgen_kernels
        self.num_sms = num_sms
        self.min_keys_per_split = min_keys_per_split
        self.max_splits = max_splits

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.state = TritonPlan(decode_only=meta.max_query_len == 1)

    def _num_splits(self, meta: AttentionMetadata, num_kv_heads: int) -> int:
        if self.num_sms is None:
            self.num_sms = self.kernels.num_sms(meta.seq_lens.device)
        return self.kernels.choose_num_splits(
            meta.seq_lens.shape[0],
            num_kv_heads,
            meta.max_seq_len,
            self.num_sms,
            self.min_keys_per_split,
            self.max_splits,
        )

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
        self.kernels.write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        return self.attend(
            query,
            kv_cache,
            meta,
            scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        k = self.kernels
        plan: TritonPlan = meta.state
        if plan.num_splits is None:
            plan.num_splits = self._num_splits(meta, kv_cache.shape[-2]) if plan.decode_only else 1
        if plan.num_splits == 1:
            return k.paged_attention(
                query,
                kv_cache,
                meta.block_table,
                meta.query_start_loc,
                meta.seq_lens,
                scale,
                max_query_len=meta.max_query_len,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
        num_tokens, num_heads, head_dim = query.shape
        if plan.workspace is None or not plan.workspace.fits(
            plan.num_splits, num_tokens, num_heads, head_dim
        ):
            plan.workspace = k.SplitWorkspace.allocate(
                plan.num_splits, num_tokens, num_heads, head_dim, query.device
            )
        return k.paged_attention_split_kv(
            query,
            kv_cache,
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            num_splits=plan.num_splits,
            max_query_len=meta.max_query_len,
            workspace=plan.workspace,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )

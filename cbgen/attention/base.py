"""The attention backend contract and the per-step metadata every backend reads.

Every backend does the same two things, in two calls:

    prepare(meta)   once per step, before the first layer: index work that every layer
                    shares, kept in meta.state
    forward(...)    once per layer: write the new K/V at meta.slot_mapping, then attend every
                    query token to its sequence's cached context, causal inside its own chunk

Two options of a layer change what a query sees (both are arguments of forward, so layers of
one model may differ, as Gemma 2's sliding and full layers do):

    sliding_window W    a query at absolute position p attends to the keys at positions j with
                        p - W < j <= p: itself and the W - 1 before it (transformers'
                        sliding_window_overlay: kv_idx > q_idx - sliding_window, as Mistral and
                        Gemma 2 mask). Keys before p - W + 1 are never read, so a backend starts
                        at the window's first block and a decode costs O(W), not O(p); the
                        blocks before may have been handed to other sequences meanwhile.
    logit_softcap c     each score s = scale * q.k becomes c * tanh(s / c), before the mask and
                        the softmax (Gemma 2's attn_logit_softcapping)

A backend that cannot apply one says so at start-up (unsupported), never computes without it.

A backend with attends_written_kv also splits forward in two: the model may write a layer's new
K/V itself, in the same pass that applies RoPE (RopeKvOps.rope_write_kv_), and then call
attend(), which is forward() without the write.
The index layout of the flat batch and of the paged cache is drawn in torch_backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch


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
    prompts: np.ndarray | None = None
    """[B] bool on the host: whether row i's new tokens start inside its prompt (None: a row of
    one new token is a decode). The cpu backend attends every prompt token with its prompt
    kernel, however small its chunk, so that a token's bits never depend on how its prompt was
    cut into chunks (batch invariance: see cpu_backend)."""
    state: Any = None
    """Backend-specific index work, built once per step by AttentionBackend.prepare."""


class AttentionBackend(ABC):
    """One attention implementation behind the contract in the module docstring."""

    name: str
    """What --attention-backend calls it."""

    attends_written_kv: ClassVar[bool] = False
    """Whether attend() serves: the model may write the new K/V into the cache itself."""

    bf16_dot_products: bool = False
    """Whether prompt chunks' attention over a bf16 KV cache may take bf16 dot products (the
    query and the softmax's probabilities rounded to bf16), where the backend has such a
    kernel: set by the engine under --dtype bfloat16 on a CPU with them."""

    def unsupported(self, sliding_window: bool, logit_softcap: bool) -> str | None:
        """Why this backend cannot run layers with a sliding window / logit soft-capping (the
        ones asked for), or None when it can."""
        return None

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Build this step's shared index work into meta.state."""

    @abstractmethod
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
        """Write key, value [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at
        meta.slot_mapping (negative slots skipped), then return the attention of query
        [T, H, D] over the cache: [T, H, D]. sliding_window, logit_softcap: see the module
        docstring (None: full attention, no capping)."""

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
        """forward() for a layer whose new K/V are already in kv_cache at meta.slot_mapping:
        attention only. Only backends with attends_written_kv have it."""
        raise NotImplementedError(f"the {self.name} backend writes its own K/V: call forward")

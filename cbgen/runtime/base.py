"""The runtime every device's extends: the model as it is (the torch reference)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cbgen.attention import AttentionBackend, AttentionMetadata
from cbgen.cpu.linear import ExactHead
from cbgen.models.base import CausalLM

PlainSample = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]
"""(logits [B, V], temperature [B], u [B]) -> token ids [B] by inverse CDF, or None (the
sampler then takes the torch ops): a device's one-pass kernel for rows without masks."""


class Runtime:
    """The model on its device as it is: forward is the model's, no exact head."""

    name = "torch"

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.exact_head: ExactHead | None = None
        """An LM head that gives the float32 head's tokens from cheaper logits (CPU)."""
        self.plain_sample: PlainSample | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's hidden states for a step (CausalLM.forward's contract)."""
        return self.model(input_ids, positions, kv_caches, meta, backend, rows)

    def use_threads(self, num_threads: int | None) -> None:
        """Threads for the model's work (None: the device's default)."""

    def describe(self) -> str:
        """What the start-up line says of the device's speed layer ("" for nothing)."""
        return ""

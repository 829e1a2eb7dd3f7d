"""Rotary position embeddings: the frequencies of each rotated pair under the scalings the
families use (default, linear, llama3, longrope), and the cos/sin tables computed once."""

from __future__ import annotations

import math

import torch
from torch import nn

from cbgen.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, long: bool = False) -> torch.Tensor:
    """The frequency of each of the rotary_dim / 2 rotated pairs; under LongRoPE, its short
    factors' frequencies, or the long ones' when long."""
    dim = cfg.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * cfg.rope_theta**exponents)
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    if kind is None:
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"rope scaling {kind!r} is not supported (default, linear, llama3 and longrope are)"
    )


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in float32, [positions, rotary_dim / 2]:
    their width tells the ops how many dims of each head to turn (partial rotary: the first
    rotary_dim; the rest pass through)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_positions = max_positions
        half = cfg.rotary_dim // 2
        self.register_buffer("cos", torch.empty(max_positions, half), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, half), persistent=False)
        if self.cos.device.type != "meta":
            self.build()

    def build(self) -> None:
        """Fill the tables (float32, on the buffers' device). The reference computes
        cat(freqs, freqs).cos(): both halves are the same, so one half is kept."""
        device = self.cos.device
        long, scale = False, 1.0
        scaling = self.cfg.rope_scaling or {}
        if scaling.get("rope_type") == "longrope":
            # one set of factors for every position: the long ones where sequences may pass the
            # original length (vLLM's rule; transformers switches per sequence: docs/DESIGN.md)
            long = self.max_positions > scaling["original_max_position_embeddings"]
            scale = scaling["attention_factor"]
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = pos[:, None] * rope_inv_freq(self.cfg, long)[None, :]
        self.cos = (freqs.cos() * scale).to(device)
        self.sin = (freqs.sin() * scale).to(device)

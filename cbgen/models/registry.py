"""Which model class runs which architecture (ModelConfig.model_type). Every class is a
CausalLM: the same forward contract (hidden states, then compute_logits) and the same weight
loading entry points, so the engine never asks which family it runs."""

from __future__ import annotations

from cbgen.models.base import CausalLM
from cbgen.models.config import ModelConfig
from cbgen.models.gemma import GemmaForCausalLM
from cbgen.models.llama import LlamaForCausalLM
from cbgen.models.moe import MoeCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,  # Phi-3/4 checkpoints store qkv_proj and gate_up_proj as cbgen holds them
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
    "qwen3_moe": MoeCausalLM,
    "mixtral": MoeCausalLM,
}


def build_model(cfg: ModelConfig, max_positions: int) -> CausalLM:
    """The model for cfg, its parameters allocated (not loaded)."""
    cls = MODEL_CLASSES.get(cfg.model_type)
    if cls is None:
        raise ValueError(f"no model class for model_type {cfg.model_type!r}")
    return cls(cfg, max_positions)

"""ModelConfig: the shape of a decoder-only model, read from config.json, GGUF metadata or a
built-in shape name. Only architectures cbgen implements are accepted."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    """llama | qwen2 | qwen3 (mistral and SmolLM2 are llama)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on each query and key head before RoPE (Qwen3)."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    def num_parameters(self, include_embeddings: bool = True) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * d
        n = self.num_hidden_layers * per_layer + h
        if include_embeddings:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; cbgen runs "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        kind = SUPPORTED_ARCHITECTURES[model_type]
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        params = cfg.get("rope_parameters")  # transformers >= 5 folds both into one dict
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
            None,
            "default",
        ):
            rope_scaling = None
        return cls(
            model_type=kind,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=kind == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            extra={"hf_model_type": model_type, "sliding_window": cfg.get("sliding_window")},
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))

    def replace(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)


def _llama_shape(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, **kw: Any) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        **kw,
    )


# Shapes for load_format="dummy": benchmark an architecture without its weights.
BUILTIN_SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": _llama_shape(
        576, 1536, 30, 9, 3, 49152, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, eos_token_id=2,
    ),
    "llama-1b": _llama_shape(
        2048, 8192, 16, 32, 8, 128256, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        eos_token_id=128001,
    ),
    "llama-8b": _llama_shape(
        4096, 14336, 32, 32, 8, 128256, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        eos_token_id=128001,
    ),
    "tiny-llama": _llama_shape(
        64, 128, 2, 4, 2, 512, rms_norm_eps=1e-6, max_position_embeddings=2048, eos_token_id=2,
    ),
}

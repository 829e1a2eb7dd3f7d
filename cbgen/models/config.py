"""ModelConfig: the shape of a decoder-only model, read from config.json (its fields checked in
cbgen.models.hf_config), GGUF metadata or a built-in shape name. Only architectures cbgen
implements are accepted."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cbgen.models.errors import ModelFileError, read_json_object
from cbgen.models.hf_config import SLIDING, model_config_fields


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    """llama | qwen2 | qwen3 | qwen3_moe | mixtral | gemma2 | gemma3 (mistral and SmolLM2 are
    llama)."""
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
    partial_rotary_factor: float = 1.0
    """The share of each head's dims that RoPE turns, the first ones (Phi-4-mini: 0.75); the
    rest pass through. See rotary_dim."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on each query and key head before RoPE (Qwen3)."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    sliding_window: int | None = None
    """Keys a query sees, itself included, in the layers that use a window (Mistral's
    sliding_window; Qwen2/3's with use_sliding_window); None: no layer has one."""
    layer_types: tuple[str, ...] | None = None
    """transformers' per-layer "sliding_attention" / "full_attention" (Qwen2/3 from
    max_window_layers, Gemma 2 alternating); None: every layer takes sliding_window (Mistral).
    See layer_windows."""
    attn_logit_softcap: float | None = None
    """Attention scores s become c * tanh(s / c) with this c (Gemma 2's attn_logit_softcapping);
    None: no capping."""
    num_experts: int = 0
    """Experts in each sparse (mixture-of-experts) layer; 0: every layer is a dense MLP."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (the router's top k)."""
    moe_intermediate_size: int = 0
    """Each expert's intermediate size."""
    norm_topk_prob: bool = True
    """Rescale a token's top-k routing weights to sum to 1 (Mixtral always; Qwen3-MoE as set)."""
    dense_layers: tuple[int, ...] = ()
    """The layers of a mixture-of-experts model that have a dense MLP of intermediate_size
    (Qwen3-MoE's mlp_only_layers and those off its decoder_sparse_step)."""
    # Gemma 2 / Gemma 3 (cbgen.models.gemma); other families leave these None
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5)."""
    final_logit_softcap: float | None = None
    """Each logit x becomes c * tanh(x / c) (Gemma 2's final_logit_softcapping)."""
    local_rope_theta: float | None = None
    """The RoPE base of the sliding-window layers, which take no rope scaling (Gemma 3); None:
    every layer uses rope_theta and rope_scaling."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None where the layer attends to every earlier token."""
        n = self.num_hidden_layers
        if self.sliding_window is None:
            return (None,) * n
        if self.layer_types is None:
            return (self.sliding_window,) * n
        return tuple(self.sliding_window if t == SLIDING else None for t in self.layer_types)

    @property
    def rotary_dim(self) -> int:
        """The dims at the start of each head that RoPE turns (transformers' int(head_dim *
        partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether the layer routes tokens to experts instead of one dense MLP."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Every parameter, each expert's included (all of them sit in memory)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        per_layer = h * (q + 2 * kv) + q * h + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * d
        sparse = sum(self.is_sparse_layer(n) for n in range(self.num_hidden_layers))
        experts = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # + the router
        n = self.num_hidden_layers * per_layer + h
        n += (self.num_hidden_layers - sparse) * 3 * h * i + sparse * experts
        if include_embeddings:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """A Hugging Face config.json's fields (cbgen.models.hf_config); raises ValueError naming
        the first field that is missing, of the wrong type or out of range."""
        return cls(**model_config_fields(cfg))

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read config.json; a malformed one raises ModelFileError naming the file and field."""
        cfg = read_json_object(Path(path))
        try:
            return cls.from_hf_dict(cfg)
        except ValueError as e:
            raise ModelFileError(f"{path}: {e}") from None

    def replace(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)


def _llama_shape(
    hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, **kw: Any
) -> ModelConfig:
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
# fmt: off
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
# fmt: on

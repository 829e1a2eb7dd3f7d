"""Gemma 2 and Gemma 3 (text) over the flat batch: Llama's attention and fused projections
with Gemma's differences, each where the reference computes it:

    embedding      scaled by sqrt(hidden), the factor rounded to the model dtype
    RMSNorm        x * (1 + weight): the 1 is added to every norm weight once, at load
    layer          four norms: after attention's output, and before and after the MLP
    MLP            GeGLU: GELU (tanh approximation) of the gate times up
    attention      scores scaled by query_pre_attn_scalar ** -0.5; soft-capped (Gemma 2); Q/K
                   norm (Gemma 3); sliding-window and full layers as layer_types says
    RoPE           Gemma 3's sliding layers have their own base (rope_local_base_freq) and no
                   scaling; its full layers take rope_theta and rope_scaling
    logits         soft-capped, c * tanh(x / c) (Gemma 2)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import cast

import torch

from cbgen.attention import AttentionBackend, AttentionMetadata
from cbgen.models.base import RMSNorm
from cbgen.models.config import ModelConfig
from cbgen.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from cbgen.models.rope import RotaryEmbedding


class GemmaMLP(MLP):
    """GeGLU: down(GELU_tanh(gate) * up)."""

    activation = "gelu_tanh"


class GemmaDecoderLayer(DecoderLayer):
    """Llama's layer with Gemma's attention scale, and norms after the attention's output
    (post_attention_layernorm, which Llama puts before the MLP) and around the MLP."""

    def __init__(self, cfg: ModelConfig, mlp: torch.nn.Module) -> None:
        super().__init__(cfg, mlp)
        if cfg.query_pre_attn_scalar is not None:
            self.self_attn.scale = cfg.query_pre_attn_scalar**-0.5
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text: Llama's weights and LM head, Gemma's layers."""

    layer_class = GemmaDecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.local_rope: RotaryEmbedding | None = None
        """The sliding-window layers' RoPE where it differs from self.rope (Gemma 3)."""
        if cfg.local_rope_theta is not None:
            local = cfg.replace(rope_theta=cfg.local_rope_theta, rope_scaling=None)
            self.local_rope = RotaryEmbedding(local, max_positions)

    def make_mlp(self, cfg: ModelConfig, layer: int) -> torch.nn.Module:
        return GemmaMLP(cfg)

    @property
    def gemma_layers(self) -> Sequence[GemmaDecoderLayer]:
        return cast(Sequence[GemmaDecoderLayer], self.layers)

    @property
    def exact_head_allowed(self) -> bool:
        """The exact head picks tokens from logits it never writes out, so it cannot soft-cap
        them (and a draw from capped logits differs): with final soft-capping there is none."""
        return self.config.final_logit_softcap is None

    def embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden) as the reference multiplies by it: a float32 tensor cast to the
        embedding's dtype (55.4256 becomes 55.5 in bfloat16)."""
        return float(torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(dtype))

    def forward_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm (with `rows`, of those rows only:
        CausalLM.forward_layers), in the residual-stream form:

            residual += h;  x = input_norm(residual);  h = post_attention_norm(attn(x))
            residual += h;  x = pre_ff_norm(residual); h = post_ff_norm(mlp(x))
        (what the reference writes as h = residual + norm(block(norm(h))), twice per layer,
        with the same roundings)
        """
        ops, eps = self.ops, self.config.rms_norm_eps
        residual = self.embed_tokens(input_ids)
        residual = residual * self.embed_scale(residual.dtype)
        full = ops.rope_tables(self.rope.cos, self.rope.sin, positions, residual.dtype)
        local = full
        if self.local_rope is not None:
            local = ops.rope_tables(
                self.local_rope.cos, self.local_rope.sin, positions, residual.dtype
            )
        h: torch.Tensor | None = None
        last = len(self.gemma_layers) - 1
        for n, (layer, kv_cache) in enumerate(zip(self.gemma_layers, kv_caches, strict=True)):
            attn = layer.self_attn
            rope = full if attn.sliding_window is None else local
            wanted = rows if n == last else None
            x = ops.add_rmsnorm_(residual, h, layer.input_layernorm.weight, eps)
            a = attn(x, rope, ops, kv_cache, meta, backend, wanted)
            if wanted is not None:
                residual = residual[wanted]
            h = ops.add_rmsnorm_(a, None, layer.post_attention_layernorm.weight, eps)
            x = ops.add_rmsnorm_(residual, h, layer.pre_feedforward_layernorm.weight, eps)
            m = layer.mlp(x, ops)
            h = ops.add_rmsnorm_(m, None, layer.post_feedforward_layernorm.weight, eps)
        return ops.add_rmsnorm_(residual, h, self.norm.weight, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    # ---- weights ---------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """CausalLM's loading, with 1 added to every norm weight (in float32, then cast to
        the model dtype). In float32 that is exactly the reference's x * (1 + w); in bfloat16
        the reference rounds x * (1 + w) once where this rounds (1 + w) and the product.
        A multimodal Gemma 3 checkpoint gives its language model's tensors; the vision
        encoder's and the projector's are left out."""
        multimodal = self.config.extra.get("hf_model_type") == "gemma3"
        return super().load_weights(
            (name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
            for name, tensor in (_language_model(weights) if multimodal else weights)
        )

    def expected_weight_names(self) -> set[str]:
        names = super().expected_weight_names()
        for i in range(self.config.num_hidden_layers):
            names |= {
                f"layers.{i}.pre_feedforward_layernorm.weight",
                f"layers.{i}.post_feedforward_layernorm.weight",
            }
        return names


_VISION = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def _language_model(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A multimodal Gemma 3's language-model tensors under Gemma3ForCausalLM's names:
    language_model.model.X (as Google's checkpoints and transformers write them) or
    model.language_model.X (transformers' in-memory names) become model.X; the vision
    encoder's and the projector's tensors are skipped, lm_head.weight passes as it is."""
    for name, tensor in weights:
        if name.startswith(_VISION):
            continue
        if name.startswith("language_model."):
            name = name[len("language_model.") :]
        elif name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        yield name, tensor

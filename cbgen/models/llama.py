"""The Llama family (Llama 2/3, Mistral, SmolLM2), Qwen2/2.5 (QKV bias), Qwen3 (Q/K norm) and
Phi-3/4 over the flat batch: linear layers run on [T, hidden]; only attention looks at
sequences.

One fused QKV projection and one fused gate-up projection per layer; weights are loaded under
Hugging Face names and packed into the fused tensors by CausalLM.load_weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from cbgen.attention import AttentionBackend, AttentionMetadata
from cbgen.models.base import CausalLM, Linear, RMSNorm
from cbgen.models.config import ModelConfig
from cbgen.models.ops import HeadNormOps, Ops, RopeKvOps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.sliding_window: int | None = None
        """This layer's window (ModelConfig.layer_windows), set by the model that holds it."""
        self.logit_softcap = cfg.attn_logit_softcap

    def forward(
        self,
        x: torch.Tensor,
        rope: Any,
        ops: Ops,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block's output [T, hidden]; with `rows`, only those rows' (every row's K/V is
        still written: later tokens read them)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        q = qkv[:, :q_end].view(t, self.num_heads, self.head_dim)
        k = qkv[:, q_end:k_end].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, k_end:].view(t, self.num_kv_heads, self.head_dim)
        written = False  # the new K/V already in kv_cache
        qn, kn = self.q_norm, self.k_norm
        if qn is not None and kn is not None and isinstance(ops, HeadNormOps):
            # q/k norms in place in the rows of qkv; then q and k rotate in one go below
            ops.rmsnorm_heads_(qkv, self.num_heads, self.head_dim, qn.weight, qn.eps)
            ops.rmsnorm_heads_(qkv[:, q_end:], self.num_kv_heads, self.head_dim, kn.weight, kn.eps)
            qn = kn = None
        if qn is not None and kn is not None:
            q, k = qn(q).contiguous(), kn(k).contiguous()
            ops.rope_(q.view(t, -1), self.num_heads, self.head_dim, rope)
            ops.rope_(k.view(t, -1), self.num_kv_heads, self.head_dim, rope)
        elif backend.attends_written_kv and isinstance(ops, RopeKvOps):
            # one pass rotates q and k (side by side in each row of qkv) and writes K/V
            ops.rope_write_kv_(
                qkv,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                rope,
                kv_cache,
                meta.slot_mapping,
            )
            written = True
        else:
            # q and k sit side by side in each row of qkv: rotate them in one go
            ops.rope_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, rope)
        window, cap = self.sliding_window, self.logit_softcap
        if written:
            o = backend.attend(
                q, kv_cache, meta, self.scale, sliding_window=window, logit_softcap=cap
            )
        else:
            o = backend.forward(
                q, k, v, kv_cache, meta, self.scale, sliding_window=window, logit_softcap=cap
            )
        o = o.reshape(t, self.q_size)
        return self.o_proj(o if rows is None else o[rows])


class MLP(nn.Module):
    """down(act(gate) * up), act SiLU."""

    activation = "silu"
    """The gate's activation: "silu", or "gelu_tanh" (GeGLU)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        h = self.gate_up_proj.gated(x, self.activation)  # in one pass, where its method can
        if h is not None:
            return self.down_proj(h)
        gate_up = self.gate_up_proj(x)
        if self.activation == "gelu_tanh":
            return self.down_proj(ops.gelu_tanh_mul(gate_up))
        return self.down_proj(ops.silu_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp
        """The feed-forward block: mlp(x, ops) -> [T, hidden]."""


class LlamaForCausalLM(CausalLM):
    """Llama-type models: CausalLM with the Llama layer (layer_class) and its MLP (make_mlp)."""

    layer_class: type[DecoderLayer] = DecoderLayer
    """What each layer is (a family with more per layer subclasses DecoderLayer)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        for layer, window in zip(self.decoder_layers, cfg.layer_windows, strict=True):
            layer.self_attn.sliding_window = window

    def make_layer(self, cfg: ModelConfig, n: int) -> nn.Module:
        return self.layer_class(cfg, self.make_mlp(cfg, n))

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Layer `layer`'s feed-forward block (a mixture-of-experts model routes some)."""
        return MLP(cfg)

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """self.layers, typed (a ModuleList hands out plain Modules)."""
        return cast(Sequence[DecoderLayer], self.layers)

    def forward_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layers from Python, in the residual-stream form:

            residual += h;  x = norm(residual);  h = block(x)
        (what the reference writes as h = residual + block(norm(h)), with the same roundings).
        With `rows`, the last layer's output projection and MLP run on those rows only: the
        other rows' hidden states feed nothing after it (a prompt chunk's K/V of every layer
        is written all the same), and in a prompt chunk they are nearly all of them.
        """
        ops, eps = self.ops, self.config.rms_norm_eps
        residual = self.embed_tokens(input_ids)
        rope = ops.rope_tables(self.rope.cos, self.rope.sin, positions, residual.dtype)
        h: torch.Tensor | None = None
        last = len(self.decoder_layers) - 1
        for n, (layer, kv_cache) in enumerate(zip(self.decoder_layers, kv_caches, strict=True)):
            wanted = rows if n == last else None
            x = ops.add_rmsnorm_(residual, h, layer.input_layernorm.weight, eps)
            h = layer.self_attn(x, rope, ops, kv_cache, meta, backend, wanted)
            if wanted is not None:
                residual = residual[wanted]
            x = ops.add_rmsnorm_(residual, h, layer.post_attention_layernorm.weight, eps)
            h = layer.mlp(x, ops)
        return ops.add_rmsnorm_(residual, h, self.norm.weight, eps)

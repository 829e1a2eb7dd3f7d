"""The Llama family (Llama 2/3, Mistral, SmolLM2), Qwen2/2.5 (QKV bias) and Qwen3 (Q/K norm)
over the flat batch: linear layers run on [T, hidden]; only attention looks at sequences.

One fused QKV projection and one fused gate-up projection per layer; weights are loaded under
Hugging Face names and packed into the fused tensors by load_weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from cbgen.attention import AttentionBackend, AttentionMetadata, native
from cbgen.attention.cpu_features import cpu_info
from cbgen.models.config import ModelConfig


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered once for oneDNN's CPU matmul (1.2-1.8x faster than the default
    BLAS path at every batch size measured, 1 to 2048 tokens)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def bf16_matmul_supported() -> bool:
    """oneDNN runs bfloat16 matmuls here, natively or emulated (any AVX-512 CPU)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return onednn_packing_available() and check is not None and bool(check())


def bf16_matmul_fast() -> bool:
    """oneDNN runs bfloat16 matmuls natively here, at about twice the float32 rate: the CPU has
    bf16 dot products (AVX512_BF16 or AMX-BF16). oneDNN's own check is also true where it
    emulates them, and there a bf16 head is about 3x slower than the float32 one."""
    return cpu_info().bf16_dot and bf16_matmul_supported()


class Bf16Head:
    """The LM head from a bfloat16 copy, with the tokens of the float32 head: greedy rows get
    the argmax of the float32 logits, sampled rows a draw from their softmax, from bf16 logits
    with a proven error bound plus float32 recomputes of a few tokens
    (cbgen/attention/csrc/bf16_head.c has the bound and the rejection step). About half the
    cost of the float32 head on a CPU with bf16 dot products."""

    UNIT = 2.0**-8
    """bfloat16 unit roundoff (8 significant bits, round to nearest)."""

    MIN_TEMPERATURE = 0.25
    """Sampled rows below this temperature take the float32 head: a proposal is accepted with
    probability about exp(-bound / T), and the bound (~0.5 on SmolLM2's likely tokens) would
    have them retry too often."""

    MAX_ATTEMPTS = 1000
    """Rejected proposals after which a row takes the float32 head."""

    def __init__(self, weight: torch.Tensor) -> None:
        hidden = weight.shape[1]
        self.weight = weight
        w16 = weight.to(torch.bfloat16)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w16, 64)
        up = 1 + 1e-6  # norms rounded up
        self.norms = (weight.double().norm(dim=1) * up).float()
        self.residual_norms = ((w16.double() - weight.double()).norm(dim=1) * up).float()
        f32_unit = 2.0**-24
        # g: float32 accumulation over a row (slack for blocked sums); m: 25 % margin for the
        # bound's own float arithmetic; b: the result rounded to bf16 (a whole ulp allowed)
        g = (hidden + 32) * f32_unit / (1 - (hidden + 32) * f32_unit)
        b = 1.25 * 2 * self.UNIT / (1 - 2 * self.UNIT)
        self.bound = (g, 1.25, b, 1e-5)
        self.last_candidates = 0
        """The most candidates a greedy row needed in the last call (a diagnostic)."""

    def __call__(self, hidden: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """Token ids [M] (int64) for hidden [M, hidden] float32, temperature [M] (0: greedy,
        else >= MIN_TEMPERATURE) and seeds [M] int64 (a sampled row's draw depends only on its
        logits and seed); -1 for a row that must take the float32 head (a value not finite,
        or MAX_ATTEMPTS proposals rejected)."""
        hidden16 = hidden.to(torch.bfloat16)
        logits = packed_linear(hidden16, self.packed, None)
        weights = (self.weight, self.residual_norms, self.norms)
        tokens, self.last_candidates = native.head_bf16(
            logits, hidden, hidden16, *weights, self.bound, temperature, seeds, self.MAX_ATTEMPTS
        )
        return tokens


class Linear(nn.Linear):
    """nn.Linear that can switch to packed copies of its weight (CPU, float32): panels for the
    C matmul at decode sizes, oneDNN's layout for larger batches."""

    packed: torch.Tensor | None = None
    panels: torch.Tensor | None = None

    def pack(self, onednn: bool = True, panels: bool = False) -> None:
        if onednn:
            self.packed = pack_weight(self.weight.data)
        if panels:
            self.panels = native.pack_panels(self.weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.panels)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    panels: torch.Tensor | None,
) -> torch.Tensor:
    """x @ weight.T (+ bias) through the fastest copy of the weight there is for x's rows
    (the packed copies exist on the CPU in float32 only)."""
    if panels is not None and x.dim() == 2 and x.shape[0] <= native.SMALL_GEMM_MAX_ROWS:
        return native.small_gemm(x, panels, bias)
    if packed is not None:
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 and cast back, as the reference implementations do.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
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
    raise ValueError(f"rope scaling {kind!r} is not supported (default, linear and llama3 are)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in float32."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(max_positions, cfg.head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, cfg.head_dim // 2), persistent=False)
        if self.cos.device.type != "meta":
            self.build()

    def build(self) -> None:
        """Fill the tables (float32, on the buffers' device). The reference computes
        cat(freqs, freqs).cos(): both halves are the same, so one half is kept."""
        device = self.cos.device
        inv_freq = rope_inv_freq(self.cfg)
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        self.cos = freqs.cos().to(device)
        self.sin = freqs.sin().to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the batch's positions: [T, 1, D/2] each."""
        cos = self.cos[positions].to(dtype)[:, None, :]
        sin = self.sin[positions].to(dtype)[:, None, :]
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, per half: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s]
    (the same float operations as the reference formulation, without the concatenations)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    torch.mul(x1, cos, out=out[..., :half])
    out[..., :half].sub_(x2 * sin)
    torch.mul(x2, cos, out=out[..., half:])
    out[..., half:].add_(x1 * sin)
    return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        cos, sin = rope
        heads = self.num_heads + self.num_kv_heads
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            # q and k sit side by side in each row of qkv: rotate them in one go.
            qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(t, heads, self.head_dim), cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class CausalLM(nn.Module):
    """Decoder-only LM. forward() returns hidden states; compute_logits() the LM head."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg, max_positions)
        self.fused_cpu_ops = False
        """Use the fused C element-wise ops (set by the loader on the CPU in float32)."""
        self.lm_head_packed: torch.Tensor | None = None
        self.lm_head_panels: torch.Tensor | None = None
        self.bf16_head: Bf16Head | None = None
        """Set by the loader where bf16 matmuls are native (CPU, float32 model)."""
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """self.layers, typed (a ModuleList hands out plain Modules)."""
        return cast(Sequence[DecoderLayer], self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.fused_cpu_ops:
            return self._forward_fused(h, positions, kv_caches, meta, backend)
        rope = self.rope.tables(positions, h.dtype)
        for layer, kv_cache in zip(self.decoder_layers, kv_caches, strict=True):
            residual = h
            h = layer.self_attn(layer.input_layernorm(h), rope, kv_cache, meta, backend)
            h = residual + h
            residual = h
            h = residual + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def _forward_fused(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The same computation on the CPU in float32 with the fused C ops of
        cbgen.attention.native: residual add + RMSNorm, RoPE in place, and the MLP's SiLU and
        product in one pass over the gate-up projection.

            residual += h;  x = norm(residual)      (what the reference writes as
            h = block(x)                             h = residual + block(norm(h)))
        """
        eps = self.config.rms_norm_eps
        cos, sin = self.rope.cos, self.rope.sin
        positions = positions.contiguous()
        residual = h
        x = native.add_rmsnorm_(residual, None, self.decoder_layers[0].input_layernorm.weight, eps)
        for i, (layer, kv_cache) in enumerate(zip(self.decoder_layers, kv_caches, strict=True)):
            if i:
                x = native.add_rmsnorm_(residual, h, layer.input_layernorm.weight, eps)
            attn = layer.self_attn
            t = x.shape[0]
            qkv = attn.qkv_proj(x)
            q_end, k_end = attn.q_size, attn.q_size + attn.kv_size
            if attn.q_norm is not None and attn.k_norm is not None:
                q = attn.q_norm(qkv[:, :q_end].view(t, attn.num_heads, attn.head_dim)).contiguous()
                k = attn.k_norm(qkv[:, q_end:k_end].view(t, attn.num_kv_heads, attn.head_dim)).contiguous()
                native.rope_(q.view(t, -1), attn.num_heads, attn.head_dim, positions, cos, sin)
                native.rope_(k.view(t, -1), attn.num_kv_heads, attn.head_dim, positions, cos, sin)
            else:
                native.rope_(qkv, attn.num_heads + attn.num_kv_heads, attn.head_dim, positions, cos, sin)
                q = qkv[:, :q_end].view(t, attn.num_heads, attn.head_dim)
                k = qkv[:, q_end:k_end].view(t, attn.num_kv_heads, attn.head_dim)
            v = qkv[:, k_end:].view(t, attn.num_kv_heads, attn.head_dim)
            o = backend.forward(q, k, v, kv_cache, meta, attn.scale)
            h = attn.o_proj(o.reshape(t, attn.q_size))
            x = native.add_rmsnorm_(residual, h, layer.post_attention_layernorm.weight, eps)
            h = layer.mlp.down_proj(native.silu_mul(layer.mlp.gate_up_proj(x)))
        return native.add_rmsnorm_(residual, h, self.norm.weight, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden.contiguous(), self.head_weight, None, self.lm_head_packed, self.lm_head_panels)

    def pack_linear_weights(self, onednn: bool = True, panels: bool = False) -> None:
        """Reorder every matmul weight for oneDNN and/or into the C matmul's panels (CPU
        float32). The LM head gets packed copies (a tied one still serves the embedding
        lookup)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(onednn, panels)
        if onednn:
            self.lm_head_packed = pack_weight(self.head_weight.data)
        if panels:
            self.lm_head_panels = native.pack_panels(self.head_weight.data)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head weight [vocab, hidden] (the embedding when tied)."""
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head_weight

    # ---- weights ---------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the (fused) parameters. Returns the names of
        parameters that were filled; raises on unknown or misshapen tensors."""
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        inter = cfg.intermediate_size
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
            "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
        }
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model.") :]
            if name == "lm_head.weight":
                if cfg.tie_word_embeddings:
                    continue
                name = "lm_head_weight"
            if "rotary_emb" in name:
                continue
            target, start, size = name, 0, None
            for src, (dst, off, n) in fused.items():
                if f".{src}." in name:
                    target, start, size = name.replace(src, dst), off, n
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} for a {cfg.model_type} model")
            dst_view = param.data if size is None else param.data.narrow(0, start, size)
            if tuple(dst_view.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst_view.shape)}"
                )
            dst_view.copy_(tensor)
            loaded.add(name)
        return loaded

    def expected_weight_names(self) -> set[str]:
        cfg = self.config
        names = {"embed_tokens.weight", "norm.weight"}
        if not cfg.tie_word_embeddings:
            names.add("lm_head_weight")
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            names |= {
                p + "input_layernorm.weight",
                p + "post_attention_layernorm.weight",
                p + "self_attn.q_proj.weight",
                p + "self_attn.k_proj.weight",
                p + "self_attn.v_proj.weight",
                p + "self_attn.o_proj.weight",
                p + "mlp.gate_proj.weight",
                p + "mlp.up_proj.weight",
                p + "mlp.down_proj.weight",
            }
            if cfg.attention_bias:
                names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
            if cfg.qk_norm:
                names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        return names

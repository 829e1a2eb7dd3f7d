"""The Llama family (Llama 2/3, Mistral, SmolLM2), Qwen2/2.5 (QKV bias) and Qwen3 (Q/K norm)
over the flat batch: linear layers run on [T, hidden]; only attention looks at sequences.

One fused QKV projection and one fused gate-up projection per layer; weights are loaded under
Hugging Face names and packed into the fused tensors by load_weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from cbgen.attention import AttentionBackend, AttentionMetadata
from cbgen.cpu import kernels
from cbgen.cpu.linear import ExactHead, linear, pack_weight
from cbgen.models.config import ModelConfig
from cbgen.models.ops import TORCH_OPS, GatedLinearOps, HeadNormOps, Ops, RopeKvOps, rms_norm


class Linear(nn.Linear):
    """nn.Linear that can switch to packed copies of its weight (CPU, float32): panels for the
    C matmul at decode sizes, oneDNN's layout for larger batches."""

    packed: torch.Tensor | None = None
    panels: torch.Tensor | None = None

    def pack(self, onednn: bool = True, panels: bool = False) -> None:
        if onednn:
            self.packed = pack_weight(self.weight.data)
        if panels:
            self.panels = kernels.pack_panels(self.weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.panels)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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
        if isinstance(ops, GatedLinearOps):
            h = ops.gated_linear(x, self.gate_up_proj, self.activation)
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


class CausalLM(nn.Module):
    """Decoder-only LM. forward() returns hidden states; compute_logits() the LM head."""

    layer_class: type[DecoderLayer] = DecoderLayer
    """What each layer is (a family with more per layer subclasses DecoderLayer)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_class(cfg, self.make_mlp(cfg, n)) for n in range(cfg.num_hidden_layers)
        )
        for layer, window in zip(self.decoder_layers, cfg.layer_windows, strict=True):
            layer.self_attn.sliding_window = window
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg, max_positions)
        self.ops: Ops = TORCH_OPS
        """The element-wise ops; the loader gives the CPU's C kernels where they serve."""
        self.lm_head_packed: torch.Tensor | None = None
        self.lm_head_panels: torch.Tensor | None = None
        self.exact_head: ExactHead | None = None
        """Set by the loader on the CPU for a float32 model: bf16 logits where bf16 matmuls are
        native, int16 logits where the tuning measured them faster (AVX2)."""
        self.native_decoder: Callable[..., torch.Tensor | None] | None = None
        """Set by the loader on the CPU (cbgen.cpu.decoder.NativeDecoder): the forward pass of
        the steps it serves in one C call, the same hidden states bit for bit."""
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Layer `layer`'s feed-forward block (a mixture-of-experts model routes some)."""
        return MLP(cfg)

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
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, or [len(rows), hidden] of the rows
        asked for (those the LM head reads): from the native decoder's one C call where it
        serves the step, else from forward_layers."""
        native = self.native_decoder
        if native is not None:
            hidden = native(input_ids, positions, kv_caches, meta)
            if hidden is not None:
                return hidden if rows is None else hidden[rows]
        return self.forward_layers(input_ids, positions, kv_caches, meta, backend, rows)

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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(
            hidden.contiguous(), self.head_weight, None, self.lm_head_packed, self.lm_head_panels
        )

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
            self.lm_head_panels = kernels.pack_panels(self.head_weight.data)

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
            if size is None:  # a fused tensor stored whole (Phi-3's qkv_proj, gate_up_proj)
                parts = [(w, part) for part, (w, _, _) in fused.items() if f".{w}." in name]
                loaded |= {name.replace(w, part) for w, part in parts}
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

"""What every model family shares: linear layers that run through a method object, RMSNorm, and
CausalLM, the base class of every model (the engine, the runtime and the loader know models
through it alone).

A linear layer holds its weight (and bias) as parameters under Hugging Face's names, and a
method that runs x @ weight.T + bias: the reference (TORCH_LINEAR: torch's matmul, or a weight
kept in a half dtype upcast a chunk of rows at a time), or what a runtime gave it when it bound
the model to a device (cbgen.runtime: packed float32 panels for the CPU's C matmul, and next
bfloat16 and quantized GGUF blocks). The model's forward calls the layer; it never asks which
method the layer has. The LM head is a linear layer of its own kind (its weight is the
embedding's when tied): CausalLM.head_method runs it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from cbgen.attention import AttentionBackend, AttentionMetadata
from cbgen.models.config import ModelConfig
from cbgen.models.ops import TORCH_OPS, Ops, rms_norm
from cbgen.models.quantized import (
    DequantizingLinear,
    QuantizedEmbedding,
    QuantizedWeight,
    QuantSegment,
)
from cbgen.models.rope import RotaryEmbedding


class LinearMethod(Protocol):
    """How a linear layer's weight is held and multiplied."""

    name: str

    def apply(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [..., K] @ weight [N, K].T (+ bias [N]) in x's dtype: [..., N]."""
        ...


@runtime_checkable
class GatedLinearMethod(Protocol):
    """A method that can also apply a gated activation to a [gate | up] product as it computes
    it (the gate-up projection of a gated MLP), never writing the product out."""

    def apply_gated(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """act(x @ gate.T) * (x @ up.T) [T, N / 2] for the layer's weight [gate | up] (no bias),
        act "silu" or "gelu_tanh", rounded as the two separate passes round; None where it does
        not serve these rows (the caller then multiplies and applies the activation)."""
        ...


UPCAST_CHUNK_BYTES = 4 << 20
"""The scratch a half-precision weight is upcast into, a chunk of its rows at a time: small
enough that the chunk is still in cache when the matmul reads it, large enough that the two
calls per chunk cost little beside the matmul."""

_scratch = threading.local()


def _scratch_buffer(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A buffer of at least `numel` elements of `like`'s dtype and device, reused by every
    upcast matmul of this thread (one matmul at a time uses it, so layers share it)."""
    buffer: torch.Tensor | None = getattr(_scratch, "buffer", None)
    if (
        buffer is None
        or buffer.numel() < numel
        or (buffer.dtype, buffer.device) != (like.dtype, like.device)
    ):
        # A normal tensor even when made under inference_mode: one made there could not be
        # written by a matmul that runs outside it later.
        with torch.inference_mode(False):
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
        _scratch.buffer = buffer
    return buffer[:numel]


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) in x's dtype for a weight stored in another (bf16 or fp16, x
    float32): each chunk of weight rows is upcast exactly into a scratch buffer, then
    multiplied, so the result is the float32 matmul on the upcast weight and the float32
    copy never exists whole.

        weight [N, K]  rows n0:n1 --upcast--> scratch [n1-n0, K] --x @ .T--> out[:, n0:n1]
    """
    rows = x.reshape(-1, x.shape[-1])
    n, k = weight.shape
    out = rows.new_empty(rows.shape[0], n)
    chunk = max(1, UPCAST_CHUNK_BYTES // (k * x.element_size()))
    scratch = _scratch_buffer(min(chunk, n) * k, rows)
    for n0 in range(0, n, chunk):
        n1 = min(n, n0 + chunk)
        w = scratch[: (n1 - n0) * k].view(n1 - n0, k)
        w.copy_(weight[n0:n1])
        torch.mm(rows, w.t(), out=out[:, n0:n1])
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], n)


class TorchLinear:
    """The reference: torch's matmul on the weight as stored, or, for a weight kept in a half
    dtype under float32 activations, upcast_linear (the float32 matmul on the upcast weight)."""

    name = "torch"

    def apply(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if weight.dtype != x.dtype:
            return upcast_linear(x, weight, bias)
        return F.linear(x, weight, bias)


TORCH_LINEAR = TorchLinear()


def store_weights_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every weight of two or more dimensions (the matmul weights, stacked experts, the
    embedding and LM head) fresh, unfilled storage of `dtype`; norms and biases keep theirs.
    The matmuls upcast such weights as they use them (TorchLinear), and an embedding's rows
    come out in the dtype its weight had before (a forward hook), so activations keep the
    model's dtype. Called on a model built without initialisation, before its weights are
    loaded, so that each weight is filled once, in `dtype`."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            module.register_forward_hook(_rows_in(module.weight.dtype))
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() >= 2:
                stored = torch.empty(param.shape, dtype=dtype, device=param.device)
                setattr(module, name, nn.Parameter(stored, requires_grad=False))


def _rows_in(dtype: torch.dtype) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def hook(module: nn.Module, args: Any, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(dtype)

    return hook


class Linear(nn.Linear):
    """nn.Linear whose product is its method's (TORCH_LINEAR until a runtime gives it another)."""

    method: LinearMethod = TORCH_LINEAR

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(x, self.weight, self.bias)

    def gated(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """act(gate) * up of this [gate | up] projection in one pass where the method computes
        it so (GatedLinearMethod), else None."""
        method = self.method
        if self.bias is not None or not isinstance(method, GatedLinearMethod):
            return None
        return method.apply_gated(x, activation)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class CausalLM(nn.Module):
    """A decoder-only LM. forward() returns hidden states [T, hidden] after the final norm;
    compute_logits() the LM head. A family subclasses it with its layers (make_layer) and its
    forward pass (forward_layers); weights load under Hugging Face's names, q/k/v and
    gate/up fused into one projection each."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens: nn.Embedding | QuantizedEmbedding = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size
        )
        self.layers = nn.ModuleList(self.make_layer(cfg, n) for n in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg, max_positions)
        self.ops: Ops = TORCH_OPS
        """The element-wise ops; a runtime gives the device's kernels where they serve."""
        self.head_method: LinearMethod = TORCH_LINEAR
        """The LM head's linear method (a runtime may pack the head weight)."""
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))

    def make_layer(self, cfg: ModelConfig, n: int) -> nn.Module:
        """Decoder layer n of this family."""
        raise NotImplementedError

    @property
    def exact_head_allowed(self) -> bool:
        """Whether an exact LM head (tokens of the float32 head from cheaper logits it never
        writes out) may stand in for compute_logits + the sampler: not where the logits are
        transformed after the head (Gemma 2's final soft-capping)."""
        return True

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
        asked for (those the LM head reads)."""
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
        """The family's forward pass (forward's contract)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_method.apply(hidden.contiguous(), self.head_weight, None)

    def linear_layers(self) -> list[Linear]:
        """Every linear layer of the model (not the LM head)."""
        return [m for m in self.modules() if isinstance(m, Linear)]

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

    def attach_quantized(self, segments: dict[str, QuantSegment]) -> set[str]:
        """Give linear layers the file's quantized blocks of their tensors (Hugging Face names,
        as load_weights takes; every part of a fused layer, or none), with the reference
        method DequantizingLinear, and free their float storage. Returns the names attached."""
        parts = {
            "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
        }
        modules = dict(self.named_modules())
        by_layer: dict[str, list[tuple[str, QuantSegment]]] = {}
        attached = self._attach_quantized_embedding(segments)
        for name, seg in segments.items():
            if name in ("embed_tokens.weight", "lm_head.weight"):
                continue
            name = name.removeprefix("model.").removesuffix(".weight")
            target = name
            for fused, names in parts.items():
                for part in names:
                    if name.endswith("." + part):
                        target = name[: -len(part)] + fused
            by_layer.setdefault(target, []).append((name, seg))
        for target, named in by_layer.items():
            layer = modules.get(target)
            if not isinstance(layer, Linear):
                raise ValueError(f"unexpected quantized weight {named[0][0]!r}")
            fused_parts = next((ns for f, ns in parts.items() if target.endswith(f)), None)
            if fused_parts is not None:
                order = {part: i for i, part in enumerate(fused_parts)}
                named.sort(key=lambda ns: order[".".join(ns[0].split(".")[-2:])])
                if len(named) != len(fused_parts):
                    raise ValueError(f"{target}: some of its parts are quantized, not all")
            weight = QuantizedWeight(layer.in_features, [seg for _, seg in named])
            if weight.rows != layer.out_features:
                raise ValueError(
                    f"{target}: quantized rows {weight.rows}, expected {layer.out_features}"
                )
            layer.method = DequantizingLinear(weight)
            layer.weight.data = layer.weight.data.new_empty(0)
            attached |= {name + ".weight" for name, _ in named}
        return attached

    def _attach_quantized_embedding(self, segments: dict[str, QuantSegment]) -> set[str]:
        """The token embedding and the LM head kept in their blocks (attach_quantized): the
        embedding as a QuantizedEmbedding, the head (its own tensor, or the embedding's when
        tied) under DequantizingLinear; the float storage freed."""
        cfg = self.config
        attached: set[str] = set()
        embed = segments.get("embed_tokens.weight")
        if embed is not None:
            if tuple(embed.blocks.shape[:1]) != (cfg.vocab_size,):
                raise ValueError(
                    f"embed_tokens: quantized rows {embed.rows}, expected {cfg.vocab_size}"
                )
            self.embed_tokens = QuantizedEmbedding(embed, cfg.hidden_size)
            attached.add("embed_tokens.weight")
            if cfg.tie_word_embeddings:
                self.head_method = DequantizingLinear(QuantizedWeight(cfg.hidden_size, [embed]))
        head = segments.get("lm_head.weight")
        if head is not None and not cfg.tie_word_embeddings:
            if head.rows != cfg.vocab_size:
                raise ValueError(f"lm_head: quantized rows {head.rows}, expected {cfg.vocab_size}")
            self.head_method = DequantizingLinear(QuantizedWeight(cfg.hidden_size, [head]))
            self.lm_head_weight.data = self.lm_head_weight.data.new_empty(0)
            attached.add("lm_head_weight")
        return attached

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

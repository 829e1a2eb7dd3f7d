"""A decode step's whole forward pass in one C call (cbgen/cpu/csrc/decoder.c), for Llama-type
and Gemma models on the CPU in float32.

With the cpu ops and the cpu attention backend, LlamaForCausalLM.forward_layers makes ~9 kernel calls a
layer (~270 a step for SmolLM2's 30 layers); from Python each also pays its argument checks, a
tensor allocation, a module call and ctypes, while the kernels' other thread waits. NativeDecoder
makes the same calls, in the same order, on the same kinds of buffers, from C: the hidden
states are bit for bit the Python path's (tests/runtime/test_native_decoder.py). It serves the steps
whose matmuls all go to small_gemm (the runtime's CpuThresholds.small_gemm_max_rows; a GGUF
model's blocks take any rows) and whose attention the C kernels take as the cpu backend sends
it: decodes to the decode kernel, prompt chunks to the prefill kernel (its bf16 form over a
bf16 cache with bf16 dot products), their keys gathered from the cache as the backend gathers
them. Any other step, and a step a kernel refuses, runs the Python path.

Which models: the plain Llama layer (LlamaForCausalLM with its MLP; Llama, Mistral, Qwen2 with its QKV
bias, Qwen3 with its q/k norms, SmolLM2, Phi-3 without partial rotary) and Gemma 2 / 3's (norms
after each block, GeGLU, soft-capped scores, local RoPE tables), float32 weights with
small_gemm panels, bf16 panels, or a GGUF file's blocks (every matmul through cbgen_q_gemm).
Not mixtures of experts or partial rotary: they keep the Python path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, cast

import torch

from cbgen.attention.base import AttentionMetadata
from cbgen.attention.cpu_backend import CpuPlan
from cbgen.attention.torch_backend import PrefillChunk
from cbgen.cpu import build, kernels
from cbgen.cpu import thresholds as cpu_thresholds
from cbgen.models.base import CausalLM, Linear
from cbgen.models.gemma import GemmaDecoderLayer, GemmaForCausalLM, GemmaMLP
from cbgen.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from cbgen.runtime.cpu_linear import CpuThresholds, PackedBf16Linear, PackedF32Linear
from cbgen.runtime.cpu_ops import CpuOps
from cbgen.runtime.cpu_quant import QuantLinear

_P = ctypes.c_void_p


class _Layer(ctypes.Structure):
    """decoder.c's cbgen_layer_f32."""

    _fields_ = [
        *(
            (name, _P)
            for name in (
                "input_norm",
                "post_norm",
                "qkv",
                "qkv_bias",
                "q_norm",
                "k_norm",
                "o",
                "gate_up",
                "down",
                "k_cache",
                "v_cache",
                "cos",
                "sin",
                "pre_ff_norm",
                "post_ff_norm",
            )
        ),
        ("window", ctypes.c_int64),
    ]


class _Decoder(ctypes.Structure):
    """decoder.c's cbgen_decoder_f32."""

    _fields_ = [
        *(
            (name, ctypes.c_int64)
            for name in (
                "layers",
                "hidden",
                "heads",
                "kv_heads",
                "head_dim",
                "inter",
                "block_size",
                "num_slots",
                "gemma",
                "blocked_rows",
                "weights",
                "kv_bf16",
                "bf16_dots",
            )
        ),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("final_norm", _P),
        ("layer", ctypes.POINTER(_Layer)),
    ]


class _Step(ctypes.Structure):
    """decoder.c's cbgen_decoder_step."""

    _fields_ = [
        ("decodes", ctypes.c_int64),
        ("decode_rows", _P),
        ("block_table", _P),
        ("bt_stride", ctypes.c_int64),
        ("seq_lens", _P),
        ("chunks", ctypes.c_int64),
        ("chunk", _P),
        ("chunk_blocks", _P),
        ("cb_stride", ctypes.c_int64),
    ]


class NativeDecoder:
    """model's decode forward in one C call; see the module docstring. Build with for_model."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        thresholds: CpuThresholds,
        weights: int = 0,
        gemma: bool = False,
    ) -> None:
        cfg = model.config
        self.model = model
        self.thresholds = thresholds
        self.weights = weights
        """How the matmuls' panels are packed: 0 float32, 1 bf16 widened, 2 bf16 dot products."""
        self.layers = list(model.decoder_layers)
        attn = self.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.scale = attn.scale
        self.softcap = attn.logit_softcap or 0.0
        self.gemma = gemma
        """Gemma's layers: embedding scale, norms after each block, GeGLU."""
        self.lib = build.load_library()
        self._caches: list[torch.Tensor] = []
        self._struct: _Decoder | None = None
        self._layer_array: ctypes.Array[_Layer] | None = None
        self._pinned: list[torch.Tensor] = []
        self._work = torch.empty(0, dtype=torch.float32)
        self.calls = 0
        """Forward passes this decoder ran (a diagnostic: tests check it served)."""
        self.prompt_calls = 0
        """Of them, those with prompt chunks."""

    @classmethod
    def for_model(cls, model: CausalLM, thresholds: CpuThresholds) -> NativeDecoder | None:
        """The decoder for model, or None where it cannot serve: another kind of layer or MLP,
        other ops, a weight without small_gemm panels, partial rotary, or heads the attention
        kernel does not hold."""
        kinds: dict[type, tuple[type, type]] = {
            LlamaForCausalLM: (DecoderLayer, MLP),
            GemmaForCausalLM: (GemmaDecoderLayer, GemmaMLP),
        }
        kind = kinds.get(type(model))
        if kind is None or build.load_library() is None or not isinstance(model.ops, CpuOps):
            return None
        assert isinstance(model, LlamaForCausalLM)
        cfg = model.config
        if model.embed_tokens.weight.dtype not in (torch.float32, torch.bfloat16):
            return None  # (bf16 rows come out of the embedding in float32: store_weights_in)
        for rope in cls._rope_tables(model):
            if 2 * rope.cos.shape[1] != cfg.head_dim or rope.cos.dtype != torch.float32:
                return None
        first = model.decoder_layers[0].self_attn
        weights = _weights(first.qkv_proj)
        if weights is None:
            return None
        for layer in model.decoder_layers:
            if (
                type(layer) is not kind[0]
                or type(layer.self_attn) is not Attention
                or type(layer.mlp) is not kind[1]
            ):
                return None
            attn, mlp = layer.self_attn, cast(MLP, layer.mlp)
            if (attn.scale, attn.logit_softcap) != (first.scale, first.logit_softcap):
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(_weights(lin) != weights for lin in linears):
                return None  # every matmul of every layer packed alike, or no C pass
            if any(lin.bias is not None for lin in linears[1:]):
                return None
            if (attn.q_norm is None) != (attn.k_norm is None):
                return None
            if any(
                n.weight.dtype != torch.float32
                or not n.weight.is_contiguous()
                or n.eps != cfg.rms_norm_eps
                for n in cls._norms(layer)
            ):
                return None
        # the attention kernel's limits on heads and head size: asked with an empty batch
        probe = kernels.paged_decode_f32(
            torch.empty(0, first.num_heads, first.head_dim),
            torch.empty(2, 1, 1, first.num_kv_heads, first.head_dim),
            torch.empty(0, 1, dtype=torch.int32),
            torch.empty(0, dtype=torch.int32),
            first.scale,
        )
        if probe is None:
            return None
        return cls(model, thresholds, weights, gemma=type(model) is GemmaForCausalLM)

    @staticmethod
    def _rope_tables(model: LlamaForCausalLM) -> list[Any]:
        """The RotaryEmbeddings the model's layers read: its own, and Gemma 3's local one."""
        local = getattr(model, "local_rope", None)
        return [model.rope] if local is None else [model.rope, local]

    @staticmethod
    def _norms(layer: Any) -> list[Any]:
        """Every RMSNorm of a layer the C pass applies."""
        attn = layer.self_attn
        names = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
        norms = [getattr(layer, n) for n in names if hasattr(layer, n)]
        return norms + [n for n in (attn.q_norm, attn.k_norm) if n is not None]

    def _bound(self, kv_caches: Sequence[torch.Tensor]) -> bool:
        """The C structs point at these very caches."""
        return len(kv_caches) == len(self._caches) and all(
            a is b for a, b in zip(kv_caches, self._caches, strict=True)
        )

    def _bind(self, kv_caches: Sequence[torch.Tensor], block_size: int) -> bool:
        """Point the C structs at these caches (once per set of caches). False when a cache is
        not what the kernels take: float32 or bfloat16 (all alike), contiguous, [2, blocks,
        block_size, KV heads, D], every layer's the same size."""
        want = (block_size, self.kv_heads, self.head_dim)
        first = kv_caches[0] if kv_caches else None
        if first is None or len(kv_caches) != len(self.layers):
            return False
        kv_dtype = first.dtype
        for c in kv_caches:
            if (
                c.dtype not in (torch.float32, torch.bfloat16)
                or c.dtype != kv_dtype
                or not c.is_cpu
                or not c.is_contiguous()
                or c.dim() != 5
                or c.shape[0] != 2
                or tuple(c.shape[2:]) != want
                or c.shape != first.shape
            ):
                return False
        model = self.model
        tables = self._rope_tables(model)
        # every tensor the structs point into stays referenced as long as they do
        pinned: list[torch.Tensor] = []

        def ptr(t: torch.Tensor | int | None) -> int | None:
            if t is None or isinstance(t, int):
                return t  # an address the model's methods keep alive (a cbgen_qweight)
            pinned.append(t)
            return t.data_ptr()

        array = (_Layer * len(self.layers))()
        for entry, layer, cache in zip(array, self.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, cast(MLP, layer.mlp)
            entry.input_norm = ptr(layer.input_layernorm.weight)
            entry.post_norm = ptr(layer.post_attention_layernorm.weight)
            entry.qkv = ptr(_panels(attn.qkv_proj))
            entry.qkv_bias = ptr(attn.qkv_proj.bias)
            entry.q_norm = ptr(None if attn.q_norm is None else attn.q_norm.weight)
            entry.k_norm = ptr(None if attn.k_norm is None else attn.k_norm.weight)
            entry.o = ptr(_panels(attn.o_proj))
            entry.gate_up = ptr(_panels(mlp.gate_up_proj))
            entry.down = ptr(_panels(mlp.down_proj))
            entry.k_cache = ptr(cache[0])
            entry.v_cache = ptr(cache[1])
            # Gemma's sliding layers read the local tables where the model has them
            rope = tables[-1] if attn.sliding_window is not None else tables[0]
            entry.cos, entry.sin = ptr(rope.cos), ptr(rope.sin)
            if self.gemma:
                gemma_layer = cast(GemmaDecoderLayer, layer)
                entry.pre_ff_norm = ptr(gemma_layer.pre_feedforward_layernorm.weight)
                entry.post_ff_norm = ptr(gemma_layer.post_feedforward_layernorm.weight)
            entry.window = attn.sliding_window or 0
        self._struct = _Decoder(
            layers=len(self.layers),
            hidden=self.hidden,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            inter=self.inter,
            block_size=block_size,
            num_slots=first.shape[1] * block_size,
            gemma=int(self.gemma),
            blocked_rows=self.thresholds.blocked_rows,
            weights=self.weights,
            kv_bf16=int(kv_dtype == torch.bfloat16),
            eps=self.eps,
            scale=self.scale,
            softcap=self.softcap,
            final_norm=ptr(model.norm.weight),
            layer=array,
        )
        self._layer_array = array
        self._pinned = pinned
        self._caches = list(kv_caches)
        return True

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        meta: AttentionMetadata,
        bf16_dots: bool = False,
    ) -> torch.Tensor | None:
        """The hidden states [T, hidden] after the final norm, as CausalLM.forward_layers returns them;
        None, having changed nothing the Python path would not redo, for a step it does not
        serve. bf16_dots: the attention backend's bf16_dot_products (prompt chunks over a bf16
        cache)."""
        plan = meta.state
        t = input_ids.shape[0]
        if (
            not isinstance(plan, CpuPlan)
            or t == 0
            or (t > self.thresholds.small_gemm_max_rows and self.weights != 3)
            or positions.dtype != torch.int64
            or meta.slot_mapping.dtype != torch.int64
        ):
            return None
        native = plan.native_for(None, kernels.prefill_takes(self.head_dim))
        chunks = native.prefills
        if chunks and not self._takes_chunks():
            return None
        if not self._bound(kv_caches) and not self._bind(kv_caches, meta.block_size):
            return None
        struct = self._struct
        assert struct is not None and self.lib is not None
        if struct.block_size != meta.block_size:
            return None
        struct.bf16_dots = int(bf16_dots)
        step, keep = _step(native.tokens, native.blocks, native.seq_lens, chunks, t)
        struct.blocked_rows = self.thresholds.blocked_rows  # the runtime's, as it is now
        max_keys = max((c[2] for c in chunks), default=0)
        need = self.lib.cbgen_decoder_work_f32(ctypes.byref(struct), t, max_keys)
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        residual = self.model.embed_tokens(input_ids)
        if self.gemma:
            residual = residual * cast(GemmaForCausalLM, self.model).embed_scale(residual.dtype)
        residual = residual.contiguous()
        out = torch.empty_like(residual)
        pos, slots = positions.contiguous(), meta.slot_mapping.contiguous()
        rc = self.lib.cbgen_decoder_forward_f32(
            ctypes.byref(struct),
            t,
            residual.data_ptr(),
            pos.data_ptr(),
            slots.data_ptr(),
            ctypes.byref(step),
            self._work.data_ptr(),
            out.data_ptr(),
        )
        del keep
        if rc:
            return None
        self.calls += 1
        if chunks:
            self.prompt_calls += 1
        return out

    def _takes_chunks(self) -> bool:
        """Whether a step's prompt chunks can go through the call: the cpu backend sends them
        to the prefill kernel (unless it prefers SDPA)."""
        return cpu_thresholds.prefill_split()[1] and kernels.prefill_takes(self.head_dim)


def _step(
    tokens: torch.Tensor,
    blocks: torch.Tensor,
    seq_lens: torch.Tensor,
    chunks: Sequence[PrefillChunk],
    t: int,
) -> tuple[_Step, list[torch.Tensor]]:
    """The step's cbgen_decoder_step, and the tensors it points into (keep them until the call
    returns): the decode kernel's tokens (their rows, where they are not the first ones), each
    prompt chunk's first row, rows, keys and blocks."""
    blocks, seq_lens = blocks.contiguous(), seq_lens.contiguous()
    n = tokens.shape[0]
    keep = [blocks, seq_lens]
    rows = None
    if n and not (n == t or tokens[-1].item() == n - 1):  # not rows 0 .. n - 1 (they ascend)
        rows = tokens.contiguous()
        keep.append(rows)
    step = _Step(
        decodes=n,
        decode_rows=None if rows is None else rows.data_ptr(),
        block_table=blocks.data_ptr() if n else None,
        bt_stride=blocks.shape[1] if n else 0,
        seq_lens=seq_lens.data_ptr() if n else None,
        chunks=len(chunks),
    )
    if chunks:
        spans = torch.tensor([(s, e - s, k) for s, e, k, _ in chunks], dtype=torch.int64)
        widest = max(b.shape[0] for *_, b in chunks)
        table = torch.zeros(len(chunks), widest, dtype=torch.int32)
        for i, (*_, b) in enumerate(chunks):
            table[i, : b.shape[0]] = b
        keep += [spans, table]
        step.chunk, step.chunk_blocks, step.cb_stride = spans.data_ptr(), table.data_ptr(), widest
    return step, keep


def _panels(linear: Linear) -> torch.Tensor | int | None:
    """The panels of a layer whose method holds them (small_gemm's or small_gemm_bf16's), or
    the address of a quantized weight's cbgen_qweight."""
    method = linear.method
    if isinstance(method, PackedF32Linear):
        return method.panels
    if isinstance(method, QuantLinear):
        return ctypes.addressof(method.packed.descriptor)
    return method.panels if isinstance(method, PackedBf16Linear) else None


def _weights(linear: Linear) -> int | None:
    """decoder.c's code for how a layer's weight is packed (cbgen_decoder_f32.weights), or None
    where it is not packed for a C matmul."""
    method = linear.method
    if isinstance(method, PackedF32Linear):
        ok = method.panels is not None and linear.weight.dtype == torch.float32
        return 0 if ok else None
    if isinstance(method, PackedBf16Linear):
        return 2 if method.dot else 1
    return 3 if isinstance(method, QuantLinear) else None

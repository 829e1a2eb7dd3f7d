"""The model on the CPU, bound once (prepare): all that the engine and the loader know of the
CPU's speed layer is the CpuRuntime this returns.

    threads      torch's intra-op threads: the cores this process may run on (or num_threads)
    tuning       the row thresholds measured on this machine for its kernel build, or the
                 build's defaults (cbgen.cpu.tuning); they live on the runtime (CpuThresholds),
                 and every method and the decoder bound here read them from it
    ops          the C kernels' element-wise ops (CpuOps), where the kernels built
    linears      (float32 weights) each layer's method packs its weight for small_gemm and
                 oneDNN (PackedF32Linear); the LM head likewise
    exact head   tokens of the float32 head from bf16 logits (bf16 dot products) or int16 ones
                 (AVX2, where the tuning found them faster), where the model allows it
    decoder      a decode step's forward pass in one C call (NativeDecoder), where it serves

A model whose weights are kept in bfloat16 (--dtype bfloat16 on the CPU, or a bf16 checkpoint
too large for float32 copies) gets bf16 panels (PackedBf16Linear: bf16 dot products where the
CPU has them, the weight widened in registers elsewhere) under float32 activations; fp16
weights keep torch's linear method, which upcasts them as it goes; a model whose activations
are not float32 runs the torch reference, with the C sampler.
"""

from __future__ import annotations

import psutil
import torch

from cbgen.attention import AttentionBackend, AttentionMetadata
from cbgen.cpu import bf16, kernels, quant, tuning
from cbgen.cpu.build import native_status
from cbgen.cpu.features import cpu_info
from cbgen.cpu.linear import Bf16Head, Int16Head, bf16_matmul_fast, onednn_packing_available
from cbgen.cpu.thresholds import build_small_gemm_blocked_rows
from cbgen.models.base import CausalLM
from cbgen.runtime.base import Runtime
from cbgen.runtime.cpu_decoder import NativeDecoder
from cbgen.runtime.cpu_linear import CpuThresholds, PackedBf16Linear, PackedF32Linear
from cbgen.runtime.cpu_ops import CpuOps
from cbgen.runtime.cpu_quant import QuantLinear, pack_quantized, pack_quantized_embedding


class CpuRuntime(Runtime):
    name = "cpu"

    def __init__(
        self, model: CausalLM, tuned: tuning.Tuning | None, thresholds: CpuThresholds
    ) -> None:
        super().__init__(model)
        self.tuning = tuned
        """What cbgen.cpu.tuning found for this build (None: no kernels, or not float32)."""
        self.thresholds = thresholds
        self.decoder: NativeDecoder | None = None
        self.plain_sample = kernels.sample
        self.quantized: dict[str, int] = {}
        """Linear tensors run in their GGUF blocks, by type ("Q4_1": 210), and those
        dequantized for want of a kernel ("dequantized Q6_K": 30)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """From the one-call decoder where it serves the step (the same hidden states bit for
        bit), else the model's forward."""
        if self.decoder is not None:
            hidden = self.decoder(input_ids, positions, kv_caches, meta, backend.bf16_dot_products)
            if hidden is not None:
                return hidden if rows is None else hidden[rows]
        return self.model(input_ids, positions, kv_caches, meta, backend, rows)

    def use_threads(self, num_threads: int | None) -> None:
        torch.set_num_threads(_threads(num_threads))

    def describe(self) -> str:
        status = native_status() + ("" if self.tuning is None else f", {self.tuning.describe()}")
        head = "float32" if self.exact_head is None else self.exact_head.DESCRIPTION
        if isinstance(self.model.head_method, QuantLinear):
            head = "in its GGUF blocks"
        elif isinstance(self.model.head_method, PackedBf16Linear):
            head = "bf16 panels" + (", bf16 dot products" if self.model.head_method.dot else "")
        steps = (
            "layer by layer"
            if self.decoder is None
            else "one C call each (where every matmul and attention kernel takes the step)"
        )
        blocks = ""
        if self.quantized:
            counts = ", ".join(f"{k} x{v}" for k, v in sorted(self.quantized.items()))
            blocks = f"; GGUF weights in their blocks ({quant.isa()}): {counts}"
        return f"; {cpu_info().describe()}; {status}{blocks}; LM head {head}; decode steps: {steps}"


def prepare(
    model: CausalLM, dtype: torch.dtype, num_threads: int | None = None, bf16_dot: bool = False
) -> CpuRuntime:
    """Bind model to the CPU (see the module docstring). bf16_dot: bfloat16 weights multiply
    with bf16 dot products (--dtype bfloat16 where the CPU has them), not widened to float32."""
    torch.set_num_threads(_threads(num_threads))  # before the tuning pass times anything
    native = dtype == torch.float32 and kernels.fused_ops_available()
    tuned = tuning.for_this_machine() if native else None
    thresholds = (
        CpuThresholds(0)
        if tuned is None
        else CpuThresholds(
            tuned.small_gemm_max_rows,
            tuned.blocked_rows or build_small_gemm_blocked_rows(),
        )
    )
    runtime = CpuRuntime(model, tuned, thresholds)
    if dtype != torch.float32:
        return runtime
    if native:
        model.ops = CpuOps()
        runtime.quantized = pack_quantized(model.linear_layers())
        for key, n in pack_quantized_embedding(model).items():
            runtime.quantized[key] = runtime.quantized.get(key, 0) + n
    quantized_head = isinstance(model.head_method, QuantLinear)
    if model.head_weight.dtype == torch.bfloat16 and native:
        _pack_bf16(model, bf16_dot)
        runtime.decoder = NativeDecoder.for_model(model, thresholds)
        return runtime
    if model.head_weight.dtype != dtype:
        return runtime  # weights kept in fp16: no packed copies of them, upcast per matmul
    onednn = onednn_packing_available()
    for layer in model.linear_layers():
        if not isinstance(layer.method, QuantLinear):
            layer.method = PackedF32Linear.pack(layer.weight.data, onednn, native, thresholds)
    if not quantized_head:
        model.head_method = PackedF32Linear.pack(model.head_weight.data, onednn, native, thresholds)
    if native and model.exact_head_allowed and not quantized_head:
        if bf16_matmul_fast():
            runtime.exact_head = Bf16Head(model.head_weight.data)
        elif tuned is not None and tuned.int16_head:
            runtime.exact_head = Int16Head(model.head_weight.data)
    if native:
        runtime.decoder = NativeDecoder.for_model(model, thresholds)
    return runtime


def _pack_bf16(model: CausalLM, dot: bool) -> None:
    """Weights kept in bfloat16: each layer's (and the head's) packed into bf16 panels where its
    shape allows (the others keep torch's upcast), multiplied with bf16 dot products (dot) or
    widened to float32; no exact head (it needs float32 weights). A packed weight's own
    storage is freed: the panels are the one copy (a tied head's weight stays: the embedding
    reads it), so the model takes its checkpoint's bytes (cbgen.engine.memory)."""
    for layer in model.linear_layers():
        if isinstance(layer.method, QuantLinear):
            continue
        method = PackedBf16Linear.pack(layer.weight.data, dot)
        if method is not None:
            layer.method = method
            layer.weight.data = layer.weight.data.new_empty(0)
    head = PackedBf16Linear.pack(model.head_weight.data, dot)
    if head is not None:
        model.head_method = head
        if not model.config.tie_word_embeddings:
            model.lm_head_weight.data = model.lm_head_weight.data.new_empty(0)


def bf16_native() -> bool:
    """Whether the kernels multiply bf16 weights with bf16 dot products on this CPU."""
    return bf16.native()


def _threads(num_threads: int | None) -> int:
    """num_threads, else the cores this process may run on."""
    return num_threads or len(psutil.Process().cpu_affinity() or [0])

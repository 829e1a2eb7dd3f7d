"""Binding a loaded model to its device, once: what the loader and the engine call, and all they
know of the device's speed layer.

    bind(model, device, dtype) -> Runtime
        CPU     cbgen.runtime.cpu.prepare: the C kernels' ops, each linear layer's weight packed
                into its method, the exact LM head, the one-call decoder, the tuning result
        CUDA    cbgen.runtime.cuda.prepare: the Triton ops
        else    the model as it is (the torch reference)

The runner then runs the model's forward pass through Runtime.forward (which may answer it in
one native call) and picks tokens with Runtime.exact_head where there is one.
"""

from __future__ import annotations

import torch

from cbgen.models.base import CausalLM
from cbgen.runtime import cpu, cpu_quant, cuda
from cbgen.runtime.base import PlainSample, Runtime


def bind(
    model: CausalLM,
    device: torch.device,
    dtype: torch.dtype,
    num_threads: int | None = None,
    bf16_dot: bool = False,
) -> Runtime:
    """Bind model (loaded, in dtype, on device) to the device once; see the module docstring.
    bf16_dot (CPU): bfloat16 weights multiply with bf16 dot products (cpu.prepare)."""
    if device.type == "cpu":
        return cpu.prepare(model, dtype, num_threads, bf16_dot)
    if device.type == "cuda":
        return cuda.prepare(model)
    return Runtime(model)


def quantized_types(device: torch.device) -> frozenset[int]:
    """The ggml types a GGUF file's linear tensors may keep on this device (run in their
    blocks); empty where none can (then the loader dequantizes every tensor)."""
    return cpu_quant.quantized_types() if device.type == "cpu" else frozenset()


def cpu_bf16_mode(
    dtype: str, attention_backend: str, cpu_weight_dtype: str, stored: torch.dtype | None
) -> str | None:
    """How the CPU runs a model asked for in `dtype` (EngineConfig.dtype), stored as `stored`:
    "dot" (bf16 weights multiplied with bf16 dot products, float32 activations and the rest),
    "widen" (bf16 weights widened to float32 in the matmuls: where the CPU has no bf16 dot
    products), or None (as dtype says: float32, or torch's own bf16/fp16 arithmetic with an
    attention backend other than cpu). auto: a bf16 checkpoint takes "dot" where the CPU has
    bf16 dot products (vLLM's choice, from this CPU's real features), float32 elsewhere."""
    if attention_backend not in ("auto", "cpu"):
        return None
    native = cpu.bf16_native()
    if dtype == "bfloat16":
        return "dot" if native else "widen"
    if dtype == "auto" and cpu_weight_dtype == "auto" and stored == torch.bfloat16 and native:
        return "dot"
    return None


__all__ = ["PlainSample", "Runtime", "bind", "cpu_bf16_mode", "quantized_types"]

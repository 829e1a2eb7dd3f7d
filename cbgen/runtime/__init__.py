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
from cbgen.runtime import cpu, cuda
from cbgen.runtime.base import PlainSample, Runtime


def bind(
    model: CausalLM, device: torch.device, dtype: torch.dtype, num_threads: int | None = None
) -> Runtime:
    """Bind model (loaded, in dtype, on device) to the device once; see the module docstring."""
    if device.type == "cpu":
        return cpu.prepare(model, dtype, num_threads)
    if device.type == "cuda":
        return cuda.prepare(model)
    return Runtime(model)


__all__ = ["PlainSample", "Runtime", "bind"]

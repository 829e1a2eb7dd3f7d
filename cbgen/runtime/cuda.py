"""The model on a CUDA GPU: the Triton element-wise ops where triton imports (residual +
RMSNorm, RoPE with the K/V write, SiLU x up, grouped experts: cbgen.models.triton_ops), the
torch reference otherwise. CUDA graphs are the engine's (cbgen.engine.cuda_graphs)."""

from __future__ import annotations

from cbgen.attention.triton_backend import triton_available
from cbgen.models.base import CausalLM
from cbgen.models.triton_ops import TritonOps
from cbgen.runtime.base import Runtime


class CudaRuntime(Runtime):
    name = "cuda"


def prepare(model: CausalLM) -> CudaRuntime:
    if triton_available():
        model.ops = TritonOps()
    return CudaRuntime(model)

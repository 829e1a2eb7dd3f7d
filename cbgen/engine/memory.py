"""Will the model fit? Checked on the CPU before any weight is allocated, so a model too big
for the machine is one clear error at start-up, not a swap storm or an out-of-memory kill
halfway through loading. (On CUDA the KV cache is sized by a profiling pass instead.)"""

from __future__ import annotations

import torch

from cbgen.models.config import ModelConfig

GiB = 1 << 30


def cpu_model_bytes(mc: ModelConfig, dtype: torch.dtype) -> int:
    """The weights' memory on the CPU: in float32 each matmul weight is kept with two packed
    copies (oneDNN's layout and small_gemm's panels), so about three times the checkpoint."""
    elt = torch.finfo(dtype).bits // 8
    weights = mc.num_parameters() * elt
    return 3 * weights if dtype == torch.float32 else weights


def check_cpu_memory(mc: ModelConfig, dtype: torch.dtype, available: int, name: str) -> None:
    """ValueError naming what the weights need when they cannot fit in `available` bytes (the
    KV cache has its own check, once the weights are in)."""
    need = cpu_model_bytes(mc, dtype)
    if need <= available:
        return
    kind = str(dtype).removeprefix("torch.")
    hint = ""
    if dtype == torch.float32:
        smaller = cpu_model_bytes(mc, torch.bfloat16)
        hint = f": use --dtype bfloat16 (about {smaller / GiB:.1f} GiB) or a smaller model"
    packed = " and their packed copies" if dtype == torch.float32 else ""
    raise ValueError(
        f"model {name} needs about {need / GiB:.1f} GiB of memory in {kind} on the CPU "
        f"(weights{packed}), and {available / GiB:.1f} GiB is available{hint}"
    )

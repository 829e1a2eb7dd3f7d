"""The engine's start-up line, from what its start-up chose (Engine.describe)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cbgen.engine.memory import GiB

if TYPE_CHECKING:
    from cbgen.engine.engine import Engine


def describe_engine(engine: Engine) -> str:
    """The start-up line (Engine.describe): model, device and dtype, attention, KV cache, and
    the runtime's kernels; on CUDA whether decode steps replay graphs."""
    tokens = engine.num_blocks * engine.config.block_size
    return (
        f"model {engine.source.name}"
        + ("" if engine.source.commit is None else f"@{engine.source.commit[:12]}")
        + f" ({engine.model_config.model_type}, "
        f"{engine.model_config.num_parameters() / 1e6:.0f}M params) on {engine.device} {engine.dtype_name}"
        + _weight_storage(engine)
        + ", "
        f"attention {engine.backend.name}; KV cache {engine.num_blocks} blocks x {engine.config.block_size} "
        f"tokens = {tokens} tokens ({engine.num_blocks * engine.kv_bytes_per_block / GiB:.2f} GiB), "
        f"room for {tokens // engine.max_model_len}+ sequences at max_model_len {engine.max_model_len}"
    ) + (
        engine.runtime.describe()
        if engine.device.type == "cpu"
        else f"{engine.runtime.describe()}; decode steps: {_graphs_line(engine)}"
    )


def _graphs_line(engine: Engine) -> str:
    graphs = engine.runner.graphs
    if graphs is None:
        return f"eager ({engine.graphs_off})"
    return f"CUDA graphs at batch sizes {graphs.sizes[0]}-{graphs.sizes[-1]} ({len(graphs)})"


def _weight_storage(engine: Engine) -> str:
    bf16_kv = engine.kv_dtype == torch.bfloat16
    if engine.cpu_bf16 == "dot":
        return (
            " (bf16 weights"
            + (" and KV cache" if bf16_kv else ", float32 KV cache")
            + ", bf16 dot products in the matmuls"
            + (" and the prompts' attention" if bf16_kv else "")
            + "; float32 activations, norms, softmax and sampling)"
        )
    if engine.cpu_bf16 == "widen":
        return (
            " (bf16 weights widened to float32 in the matmuls: this CPU has no bf16 dot "
            "products, so the arithmetic is float32's, at 0.9-1.0x its speed; bf16 halves "
            "the weights' memory; "
            + ("KV cache bf16, widened as attention reads it)" if bf16_kv else "float32 KV cache)")
        )
    kv = " KV cache in bfloat16" if bf16_kv and engine.dtype != torch.bfloat16 else ""
    if engine.weight_dtype == engine.dtype:
        return f" ({kv.strip()})" if kv else ""
    name = str(engine.weight_dtype).removeprefix("torch.")
    return f" (weights kept in {name}, float32 arithmetic on them{',' + kv if kv else ''})"

"""What the engine settles at start-up, before its first step: the device and dtype, the KV
cache's size (given; on CUDA, what a profiled forward pass leaves of the memory budget; on the
CPU, a share of the memory), the check of CUDA memory once the cache and graphs are in place,
the KV cache manager and the scheduler of the chosen policy. The Engine calls these in order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import psutil
import torch

from cbgen.attention.base import AttentionBackend
from cbgen.config import EngineConfig
from cbgen.engine.cuda_graphs import capture_sizes, graph_memory_reserve, graphs_unavailable
from cbgen.engine.kv_cache import KVCacheManager
from cbgen.engine.profile import cap_allocator, cuda_memory_in_use, profile_peak_memory
from cbgen.engine.scheduler import Scheduler
from cbgen.engine.static_scheduler import StaticScheduler
from cbgen.models.base import CausalLM
from cbgen.models.config import ModelConfig

logger = logging.getLogger("cbgen")

GiB = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def resolve_kv_dtype(
    kv_cache_dtype: str, dtype: torch.dtype, cpu_bf16: str | None, backend: str
) -> torch.dtype:
    """The KV cache's dtype (EngineConfig.kv_cache_dtype) for activations in `dtype`, the CPU's
    bf16 mode (cbgen.runtime.cpu_bf16_mode) and the attention backend's name. auto: bf16 in the
    CPU's bf16 modes (half the bytes a token: twice the sequences fit; where bf16 is widened,
    attention reads a bf16 cache as fast as a float32 one, docs/PERFORMANCE.md), else the
    activations' dtype. A dtype of one's own needs the CPU's C attention kernels, which read
    either cache under float32 activations."""
    if kv_cache_dtype == "auto":
        return torch.bfloat16 if cpu_bf16 is not None else dtype
    want = _DTYPES[kv_cache_dtype]
    if want != dtype and (backend != "cpu" or dtype != torch.float32):
        raise ValueError(
            f"kv_cache_dtype: {kv_cache_dtype} needs the CPU attention kernels under float32 "
            f"activations (this run: attention {backend}, {str(dtype).removeprefix('torch.')})"
        )
    return want


def default_cpu_kv_cache_memory() -> int:
    """A quarter of available memory, at most 4 GiB."""
    return int(min(4 * GiB, psutil.virtual_memory().available // 4))


def kv_bytes_per_block(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """One KV block's K and V over every layer."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * block_size * mc.num_key_value_heads * mc.head_dim * elem * mc.num_hidden_layers


def num_kv_blocks(
    config: EngineConfig,
    device: torch.device,
    bytes_per_block: int,
    cuda_budget: Callable[[], int],
) -> int:
    """The KV cache's blocks: kv_cache_memory when given (on the CPU, no more than the
    machine's memory), else on CUDA cuda_budget() (profile_cuda_kv_budget), on the CPU
    default_cpu_kv_cache_memory()."""
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
        if device.type == "cpu":
            # The CPU cache is mapped lazily: too large a size would not fail here but
            # when its blocks fill up, mid-run. Refuse what the machine cannot hold.
            total = psutil.virtual_memory().total
            if budget > total:
                raise ValueError(
                    f"kv_cache_memory: {budget / GiB:.1f} GiB is more than this machine's "
                    f"{total / GiB:.1f} GiB of memory"
                )
    elif device.type == "cuda":
        budget = cuda_budget()
    else:
        budget = default_cpu_kv_cache_memory()
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory: {budget} bytes hold no KV block ({bytes_per_block} bytes each)"
        )
    return int(num_blocks)


def profile_cuda_kv_budget(
    model: CausalLM,
    backend: AttentionBackend,
    config: EngineConfig,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    memory_plan: dict[str, int],
) -> int:
    """Run one forward pass at the full token budget, then give the KV cache what is left
    of gpu_memory_utilization x total memory (the peak and the graphs' reserve recorded in
    memory_plan)."""
    peak = profiled = profile_peak_memory(model, backend, config, max_model_len, dtype, device)
    if graphs_unavailable(device, backend.name, config.enforce_eager) is None:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        elem = torch.empty((), dtype=dtype).element_size()
        peak += graph_memory_reserve(
            peak - weights,
            config.max_num_batched_tokens,
            capture_sizes(config.max_num_seqs),
            model.config.hidden_size * elem,
        )
    total = torch.cuda.get_device_properties(device).total_memory
    memory_plan["profiled_peak"] = profiled
    memory_plan["graph_reserve"] = peak - profiled
    budget = int(total * config.gpu_memory_utilization) - peak
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {config.gpu_memory_utilization} leaves no room for a KV "
            f"cache (model and activations take {peak / GiB:.2f} GiB of {total / GiB:.2f} GiB)"
        )
    return budget


def check_cuda_memory(
    config: EngineConfig, device: torch.device, memory_plan: dict[str, int]
) -> None:
    """After the KV cache and the graphs: what the device holds against the budget the
    profile planned for (memory_plan), a warning when it is over; then torch's allocator is
    capped at the budget less what is held outside it. Steps of changing sizes leave the
    allocator's cache holding partly used segments (0.4 GiB past the allocated peak in a
    256-request run on an H200): at the cap it frees cached blocks instead of growing."""
    reserved, outside = cuda_memory_in_use(device)
    total = torch.cuda.get_device_properties(device).total_memory
    budget = config.gpu_memory_utilization * total
    memory_plan.update(budget=int(budget), reserved=reserved, outside_torch=outside)
    cap_allocator(device, budget, reserved, outside)
    if reserved + outside > budget:
        logger.warning(
            "GPU memory: %.2f GiB held (%.2f in torch, %.2f outside) after start-up, over the "
            "%.2f GiB that gpu_memory_utilization %.2f allows",
            (reserved + outside) / GiB,
            reserved / GiB,
            outside / GiB,
            budget / GiB,
            config.gpu_memory_utilization,
        )


def make_kv_cache(config: EngineConfig, mc: ModelConfig, num_blocks: int) -> KVCacheManager:
    """The KV cache manager. Blocks out of every layer's window go back while a request runs
    (continuous scheduling), which needs a window in every layer."""
    windows = [w for w in mc.layer_windows if w is not None]
    release = len(windows) == mc.num_hidden_layers and config.scheduling_policy != "static"
    return KVCacheManager(
        num_blocks,
        config.block_size,
        config.enable_prefix_caching,
        max(windows) if release else None,
    )


def make_scheduler(config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> Scheduler:
    """The scheduler of config.scheduling_policy: continuous, or static (request-level)."""
    if config.scheduling_policy == "static":
        return StaticScheduler(
            kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            static_batch_size=config.static_batch_size,
            max_model_len=max_model_len,
        )
    return Scheduler(
        kv, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill
    )

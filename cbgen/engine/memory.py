"""Will the model fit? Checked on the CPU before any weight is allocated, so a model too big
for the machine is one clear error at start-up, not a swap storm or an out-of-memory kill
halfway through loading. (On CUDA the KV cache is sized by a profiling pass instead.)

The CPU computes in float32 (dtype auto) with each matmul weight kept three times (the
checkpoint's values and two packed copies). A checkpoint stored in bf16 or fp16 whose float32
copy would not fit keeps its half-precision weights instead, upcast per layer as they are used
(cbgen.models.base.upcast_linear): the same float32 arithmetic on the same values, in a sixth
of the memory, at a speed cost. Only when even that does not fit is the model refused.

The CPU KV cache's layers are mapped, not written (mapped_zeros): its size costs no start-up.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import psutil
import torch

from cbgen.models.config import ModelConfig

GiB = 1 << 30
MiB = 1 << 20
_HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_CGROUP_UNLIMITED = 1 << 60


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _size(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def cpu_model_bytes(mc: ModelConfig, dtype: torch.dtype) -> int:
    """The weights' memory on the CPU: in float32 each matmul weight is kept with two packed
    copies (oneDNN's layout and small_gemm's panels), so about three times the checkpoint; a
    mixture of experts' stacked expert weights are kept once. In bfloat16 the packed panels
    replace the weights (cbgen.runtime.cpu), but a tied head is packed beside the embedding."""
    elt = torch.finfo(dtype).bits // 8
    params = mc.num_parameters()
    if dtype == torch.bfloat16 and mc.tie_word_embeddings:
        return (params + mc.vocab_size * mc.hidden_size) * elt
    if dtype != torch.float32:
        return params * elt
    experts = expert_parameters(mc)
    return (3 * (params - experts) + experts) * elt


def expert_parameters(mc: ModelConfig) -> int:
    """The parameters of the experts' stacked weights (gate, up and down of each), 0 for a
    dense model."""
    sparse = sum(mc.is_sparse_layer(n) for n in range(mc.num_hidden_layers))
    return sparse * mc.num_experts * 3 * mc.hidden_size * mc.moe_intermediate_size


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _stat_value(stat: Path, key: str) -> int:
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _own_cgroups(proc_cgroup: Path) -> dict[str, str]:
    """This process's cgroup paths from /proc/self/cgroup: "" for v2, "memory" for v1."""
    paths: dict[str, str] = {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            paths[controller] = path.lstrip("/")
    return paths


# (folder under the cgroup root, the controller's key in /proc/self/cgroup, limit, usage,
# the page cache the kernel drops before it kills, which usage counts)
_CGROUP_FILES = (
    ("", "", "memory.max", "memory.current", "inactive_file"),
    ("memory", "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
)


def cgroup_available(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int | None:
    """What this process's memory cgroup (a container, a Slurm job) still allows, or None
    without a limit: limit - usage + reclaimable page cache, cgroup v2 or v1. The cgroup is
    looked up by this process's path and, inside a container (where the mount is its own
    cgroup), at the mount itself."""
    own = _own_cgroups(proc_cgroup)
    for mount, key, limit_name, usage_name, cache_key in _CGROUP_FILES:
        base = root / mount
        folders = [base / own[key], base] if own.get(key) else [base]
        for folder in folders:
            limit = _read_int(folder / limit_name)
            usage = _read_int(folder / usage_name)
            if limit is not None and usage is not None and limit < _CGROUP_UNLIMITED:
                cache = _stat_value(folder / "memory.stat", cache_key)
                return max(0, limit - usage + cache)
    return None


def available_memory() -> int:
    """Bytes this process can still allocate without swapping: the OS's available memory, or
    less where a cgroup limit says so."""
    available = int(psutil.virtual_memory().available)
    limit = cgroup_available()
    return available if limit is None else min(available, limit)


def check_cpu_memory(mc: ModelConfig, dtype: torch.dtype, available: int, name: str) -> None:
    """ValueError naming what the weights need when they cannot fit in `available` bytes (the
    KV cache has its own check, once the weights are in)."""
    need = cpu_model_bytes(mc, dtype)
    if need <= available:
        return
    hint = ""
    if dtype == torch.float32:
        smaller = _size(cpu_model_bytes(mc, torch.bfloat16))
        hint = (
            f": use --dtype bfloat16 (about {smaller}), --cpu-weight-dtype bfloat16 "
            f"(float32 arithmetic on bf16 weights, about {smaller}) or a smaller model"
        )
    packed = " and their packed copies" if dtype == torch.float32 else ""
    raise ValueError(
        f"model {name} needs about {_size(need)} of memory in {_dtype_name(dtype)} on the "
        f"CPU (weights{packed}), and {_size(available)} is available{hint}"
    )


def plan_cpu_weights(
    mc: ModelConfig,
    dtype: torch.dtype,
    weight_dtype: str,
    stored: torch.dtype | None,
    name: str,
) -> torch.dtype:
    """The dtype the matmul weights are kept in on the CPU, checked against available_memory():
    the engine dtype, or a half dtype under float32 arithmetic when asked for (`weight_dtype`,
    EngineConfig.cpu_weight_dtype) or, with "auto", when the checkpoint is `stored` in one and
    its float32 copy would not fit. ValueError naming what is needed when nothing fits."""
    available = available_memory()
    if dtype != torch.float32 or weight_dtype == "float32":
        check_cpu_memory(mc, dtype, available, name)
        return dtype
    if weight_dtype in _HALF:
        check_cpu_memory(mc, _HALF[weight_dtype], available, name)
        return _HALF[weight_dtype]
    if stored is None or stored not in _HALF.values() or cpu_model_bytes(mc, dtype) <= available:
        check_cpu_memory(mc, dtype, available, name)
        return dtype
    half = cpu_model_bytes(mc, stored)
    if half <= available:
        return stored
    raise ValueError(
        f"model {name} needs about {_size(cpu_model_bytes(mc, dtype))} of memory on the CPU in "
        f"float32 (weights and their packed copies) and about {_size(half)} with its "
        f"{_dtype_name(stored)} weights kept as stored, and {_size(available)} is available: "
        "use a smaller model or a machine with more memory"
    )


def check_quantized_memory(need: int, name: str) -> None:
    """A GGUF file run in its blocks: ValueError when its weights (`need` bytes: the file's
    quantized tensors as the kernels hold them, the rest in float32 with their packed copies,
    cbgen.models.gguf_model.gguf_resident_bytes) cannot fit in what is available."""
    available = available_memory()
    if need > available:
        raise ValueError(
            f"model {name} needs about {_size(need)} of memory on the CPU with its quantized "
            f"weights in their blocks, and {_size(available)} is available: use a smaller "
            "model or a machine with more memory"
        )


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor (the KV cache's layers). On the CPU it lives in an anonymous memory map, zero by definition:
    nothing is written up front (gigabytes of KV cache cost no start-up time) and pages
    become resident only when first used."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    try:
        # private, not Python's default shared mapping (shmem): its first-touch page faults,
        # paid as the cache fills, cost about 1.5x less. No MADV_HUGEPAGE: a huge-page fault
        # compacts and zeroes 2 MiB in the step that first writes there, and measured slower
        # per KV write than 4 KiB faults, for no gain in attention reads.
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise ValueError(
            f"kv_cache_memory: cannot map {nbytes / (1 << 30):.2f} GiB for one layer's KV cache "
            f"({e.strerror}); give a smaller --kv-cache-memory"
        ) from None
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)

"""EngineConfig: the engine's options, a plain dataclass validated once, with `ValueError`
naming the field (every CLI option maps onto a field here; cli_options reads them). A request's
options are SamplingParams (cbgen.sampling_params); both check through cbgen.option_checks.

What is discovered at run time (number of KV blocks, EOS id, the resolved device) lives in
the engine, not here: a config says what the user asked for.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

from cbgen.option_checks import check, check_choice, check_int, check_num

DEFAULT_MODEL = "smollm2-135m-instruct"

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
CpuWeightDtype = Literal["auto", "float32", "bfloat16", "float16"]
KvCacheDtype = Literal["auto", "float32", "bfloat16"]
Device = Literal["auto", "cpu", "cuda"]
AttentionBackendName = Literal["auto", "torch", "cpu", "triton", "flash"]
LoadFormat = Literal["auto", "dummy"]
SchedulingPolicy = Literal["continuous", "static"]


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option, with its default. CLI options map one to one onto these fields."""

    model: str | None = None
    """Local Hugging Face folder, GGUF file, Hub id (org/name, or org/name:file.gguf) from the
    local cache or downloaded, built-in shape name (with load_format='dummy'), or None for the
    default SmolLM2-135M-Instruct."""
    revision: str | None = None
    """Branch, tag or commit of a Hub id (default: main)."""
    download_dir: str | None = None
    """Hugging Face cache folder for Hub ids (default: the cache under HF_HOME)."""
    max_num_seqs: int = 64
    """Slots: the most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep flowing."""
    block_size: int = 16
    """Tokens per KV cache block."""
    kv_cache_memory: int | None = None
    """KV cache size in bytes. None: on the CPU a quarter of available memory, at most 4 GiB;
    on CUDA sized from gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights, activations and KV cache)."""
    max_model_len: int | None = None
    """Longest prompt + output. None: the model's own limit."""
    dtype: Dtype = "auto"
    """Weights and activations: auto is float32 on the CPU, bfloat16 on CUDA."""
    cpu_weight_dtype: CpuWeightDtype = "auto"
    """On the CPU in float32: the dtype the weights are kept in. bfloat16 or float16 keep
    them in half the memory of float32 (a sixth of float32 with its packed copies), each
    matmul upcasting its weight as it runs, while activations, norms, attention and the KV
    cache stay float32 (slower; the same tokens as float32 on those weights). auto: float32,
    or the checkpoint's own bf16/fp16 when its float32 copy would not fit in memory."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """On the CPU: the KV cache's dtype. bfloat16 holds twice the tokens of float32 in the same
    memory (attention reads rounded K and V: not token-exact against transformers); float32
    keeps them exact under --dtype bfloat16. auto: bfloat16 under --dtype bfloat16, else the
    activations' dtype."""
    device: Device = "auto"
    """auto picks CUDA when available."""
    attention_backend: AttentionBackendName = "auto"
    """auto: flash when vllm_flash_attn imports, else triton on CUDA; cpu on the CPU (the C
    kernels). torch is the plain reference, on any device."""
    load_format: LoadFormat = "auto"
    """dummy: random weights for the model's shape (benchmarks without weights)."""
    dequantize: bool = False
    """A GGUF file's quantized tensors dequantized to float on load (the path token-exact
    against transformers), instead of run in their blocks (the default on the CPU, as llama.cpp
    runs them: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; other types are dequantized,
    and the start-up line says which)."""
    seed: int = 0
    """Seed for dummy weights and for sampling requests that give no seed of their own;
    in [0, 2**32)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes seen before."""
    scheduling_policy: SchedulingPolicy = "continuous"
    """continuous (iteration-level) or static (request-level, for comparison)."""
    static_batch_size: int = 8
    """Batch size of the static policy."""
    num_threads: int | None = None
    """CPU threads for torch. None: every core this process may use."""
    enforce_eager: bool = False
    """Run every step eagerly. Otherwise, on CUDA with the triton attention backend, decode-only
    steps replay CUDA graphs captured at start-up, one per batch-size bucket."""

    def __post_init__(self) -> None:
        # types first, so that a wrong type is a ValueError naming the field, not a TypeError
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "static_batch_size"):
            check_int(getattr(self, name), name)
        for name in ("kv_cache_memory", "max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name)
        for name in (
            "enable_chunked_prefill",
            "enable_prefix_caching",
            "enforce_eager",
            "dequantize",
        ):
            check(isinstance(getattr(self, name), bool), name, "must be true or false")
        check_num(self.gpu_memory_utilization, "gpu_memory_utilization")
        check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        check(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            f"must be >= 1, got {self.max_num_batched_tokens}",
        )
        check(
            self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            "block_size",
            f"must be a power of two, got {self.block_size}",
        )
        check(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            "kv_cache_memory",
            f"must be > 0 bytes, got {self.kv_cache_memory}",
        )
        check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        check(
            self.max_model_len is None or self.max_model_len >= 1,
            "max_model_len",
            f"must be >= 1, got {self.max_model_len}",
        )
        check_choice(self.dtype, "dtype", ("auto", "float32", "bfloat16", "float16"))
        check_choice(self.device, "device", ("auto", "cpu", "cuda"))
        check_choice(self.cpu_weight_dtype, "cpu_weight_dtype", get_args(CpuWeightDtype))
        check(
            self.cpu_weight_dtype == "auto"
            or (self.dtype in ("auto", "float32") and self.device != "cuda"),
            "cpu_weight_dtype",
            f"applies to float32 on the CPU, not to dtype {self.dtype} on device {self.device}",
        )
        check_choice(self.kv_cache_dtype, "kv_cache_dtype", get_args(KvCacheDtype))
        check(
            self.kv_cache_dtype == "auto" or self.device != "cuda",
            "kv_cache_dtype",
            f"applies to the CPU, not to device {self.device}",
        )
        check_choice(self.attention_backend, "attention_backend", get_args(AttentionBackendName))
        check_choice(self.load_format, "load_format", ("auto", "dummy"))
        check_choice(self.scheduling_policy, "scheduling_policy", ("continuous", "static"))
        check(
            self.static_batch_size >= 1,
            "static_batch_size",
            f"must be >= 1, got {self.static_batch_size}",
        )
        check_int(self.seed, "seed")
        check(0 <= self.seed < 2**32, "seed", f"must be in [0, 2**32), got {self.seed}")
        for name in ("revision", "download_dir"):
            value = getattr(self, name)
            check(
                value is None or (isinstance(value, str) and bool(value.strip())),
                name,
                f"must be a non-empty string, got {value!r}",
            )
        check(
            self.num_threads is None or self.num_threads >= 1,
            "num_threads",
            f"must be >= 1, got {self.num_threads}",
        )

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- sizes ------------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip


def parse_size(text: str) -> int:
    """'4GiB' -> 4294967296; KiB/MiB/GiB/TiB (and K/M/G/T) are binary, KB/MB/GB/TB decimal,
    a plain number is bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"kv_cache_memory: expected a size such as 4GiB, 512MiB or 1000000 (bytes), got {text!r}"
        )
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"kv_cache_memory: must be > 0 bytes, got {text!r}")
    return value

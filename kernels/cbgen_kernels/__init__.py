"""cbgen_kernels: Triton kernels for cbgen (installed under this name so that it cannot clash
with the PyPI package `kernels`, which transformers probes for).

    write_kv_cache            new K/V into the paged cache by slot_mapping (negative: skipped)
    paged_attention           one launch for a flat mixed batch of prefill chunks and decodes
    paged_attention_split_kv  split-KV (flash-decoding) form, merged by log-sum-exp
    add_rmsnorm_              residual += h in place, then RMSNorm(residual) * weight
    rope_                     rotate_half RoPE in place on (strided) q/k rows, tables gathered
    rope_write_kv_            rope_ on qkv rows and write_kv_cache of their k and v, one launch
    silu_mul                  SiLU(gate) * up over [gate | up]
    grouped_moe               expert MLPs over tokens sorted by expert (mixture of experts)
    uniform_draws             per-row uniform numbers from (seed, draw counter): Philox on the device

The attention kernels have the signatures of their torch references in
cbgen.attention.torch_backend; the element-wise ones compute what cbgen.models.ops.TorchOps
does (cbgen.models.triton_ops.TritonOps puts them behind the model's Ops interface). Set
TRITON_INTERPRET=1 before triton is first imported to run them on the CPU (interpreter).
"""

from cbgen_kernels.attention import (
    LaunchConfig,
    SplitWorkspace,
    choose_config,
    choose_num_splits,
    num_sms,
    paged_attention,
    paged_attention_split_kv,
)
from cbgen_kernels.cache import rope_write_kv_, write_kv_cache
from cbgen_kernels.elementwise import rope_, silu_mul
from cbgen_kernels.moe import grouped_moe
from cbgen_kernels.norm import add_rmsnorm_
from cbgen_kernels.rounding import INTERPRETED
from cbgen_kernels.sampling import uniform_draws


def interpreted() -> bool:
    """True when these kernels were built for the Triton interpreter (they then run on CPU
    tensors); False when they compile for a GPU."""
    return INTERPRETED


__all__ = [
    "LaunchConfig",
    "SplitWorkspace",
    "add_rmsnorm_",
    "choose_config",
    "choose_num_splits",
    "grouped_moe",
    "interpreted",
    "num_sms",
    "paged_attention",
    "paged_attention_split_kv",
    "rope_",
    "rope_write_kv_",
    "silu_mul",
    "uniform_draws",
    "write_kv_cache",
]

"""cbgen_kernels: Triton kernels for cbgen (installed under this name so that it cannot clash
with the PyPI package `kernels`, which transformers probes for).

    write_kv_cache            new K/V into the paged cache by slot_mapping (negative: skipped)
    paged_attention           one launch for a flat mixed batch of prefill chunks and decodes
    paged_attention_split_kv  split-KV (flash-decoding) form, merged by log-sum-exp

Each has the signature of its torch reference in cbgen.attention.torch_backend. Set
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
from cbgen_kernels.cache import write_kv_cache


def interpreted() -> bool:
    """True when these kernels were built for the Triton interpreter (they then run on CPU
    tensors); False when they compile for a GPU."""
    from cbgen_kernels import attention

    return attention._INTERPRETED


__all__ = [
    "LaunchConfig",
    "SplitWorkspace",
    "choose_config",
    "choose_num_splits",
    "interpreted",
    "num_sms",
    "paged_attention",
    "paged_attention_split_kv",
    "write_kv_cache",
]

"""The GPU check's plan (python -m tools.gpu_check --plan): the Triton variants each section is
expected to compile, from the shapes and settings its engines and models use.
"""

from __future__ import annotations

from typing import Any

from cbgen.models.config import BUILTIN_SHAPES, ModelConfig
from tools.gpu_correctness import GPU_TESTS
from tools.model_shapes import CHECKPOINTS, QUICK_CHECKPOINTS

# ---- the plan (--plan) ----------------------------------------------------------------------

# (checkpoint or builtin shape, dtype, attention backend, decode steps split keys, sampled) of
# each section's engines and models, as the sections above build them (quick: toy shapes)
_SECTION_MODELS: dict[str, list[tuple[str, str, str, bool, bool]]] = {
    "kernels": [],  # expected_compiles lists the decode steps' variants itself
    "kernel_tests": [],  # the suites' own variants
    "greedy_fp32": [
        (n, "fp32", b, True, False)
        for n in ("llama-hd64-gqa4", "llama-hd128-gqa4", "qwen2-hd64-gqa6", "qwen3-hd128-gqa2")
        for b in ("triton", "torch")
    ],
    "bf16_top1": [("llama-hd128-gqa4", "bf16", "triton", False, False)],
    "sampling": [("llama-hd64-gqa4", "fp32", "triton", True, True)],
    "memory": [("smollm2-135m", "bf16", "triton", True, True)],
    "graphs": [
        ("llama-hd64-gqa4", "fp32", "triton", False, False),
        ("smollm2-135m", "bf16", "triton", True, False),
    ],
    "throughput": [("smollm2-135m", "bf16", "triton", True, False)],
    "roofline_8b": [("llama-8b", "bf16", "triton", True, False)],
}
_QUICK_NAMES = {
    "llama-hd64-gqa4": "llama-hd64-gqa2",
    "llama-hd128-gqa4": "llama-hd128-gqa2",
    "qwen2-hd64-gqa6": "qwen2-hd64-gqa2",
    "qwen3-hd128-gqa2": "qwen3-hd64-gqa2",
    "llama-8b": "tiny-llama",
}


def _variant(kernel: str, **constexprs: Any) -> str:
    return f"{kernel}[" + ", ".join(f"{k}={v}" for k, v in constexprs.items()) + "]"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _attention_variants(
    heads: int, kv_heads: int, head_dim: int, dtype: str, mixed: bool, split: bool
) -> list[str]:
    """paged_attention for mixed steps, decode steps and split decode steps, and the merge."""
    from cbgen_kernels.attention import MAX_SPLITS, choose_config

    out = []
    kinds = ([(512, False)] if mixed else []) + [(1, False)] + ([(1, True)] if split else [])
    for max_q, split_keys in kinds:
        c = choose_config(heads, kv_heads, head_dim, max_q)
        out.append(
            _variant(
                "paged_attention",
                dtype=dtype,
                GROUP=heads // kv_heads,
                HEAD_DIM=head_dim,
                BLOCK_Q=c.block_q,
                BLOCK_M=c.block_m,
                BLOCK_N=c.block_n,
                SPLIT=split_keys,
            )
        )
    if split:
        out.append(_variant("merge_splits", dtype=dtype, HEAD_DIM=head_dim, SPLITS_PAD=MAX_SPLITS))
    return out


def _model_variants(
    shape: ModelConfig | dict[str, Any], dtype: str, backend: str, split: bool, sampled: bool
) -> list[str]:
    """The Triton variants an engine of this shape compiles: TritonOps' element-wise kernels,
    the attention kernels (triton backend) and the sampler's draws."""
    if isinstance(shape, dict):
        heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
        hidden, inter = shape["hidden_size"], shape["intermediate_size"]
        head_dim = shape.get("head_dim", hidden // heads)
        qk_norm = shape["model_type"] == "qwen3"
    else:
        heads, kv, hidden = shape.num_attention_heads, shape.num_key_value_heads, shape.hidden_size
        inter, head_dim, qk_norm = shape.intermediate_size, shape.head_dim, False
    out = [
        _variant("add_rmsnorm", dtype=dtype, N=hidden, BLOCK=_pow2(hidden), HAS_H=h)
        for h in (False, True)
    ]
    half = head_dim // 2
    if backend == "triton" and not qk_norm:
        out.append(
            _variant(
                "rope_write_kv",
                dtype=dtype,
                NUM_HEADS=heads,
                NUM_KV_HEADS=kv,
                HEAD_DIM=head_dim,
                HALF=half,
            )
        )
    else:
        out.append(
            _variant("rope", dtype=dtype, NUM_HEADS=heads + kv, HEAD_DIM=head_dim, HALF=half)
        )
        if backend == "triton":
            out.append(_variant("write_kv_cache", dtype=dtype, NUM_KV_HEADS=kv, HEAD_DIM=head_dim))
    out.append(_variant("silu_mul", dtype=dtype, INTER=inter))
    if backend == "triton":
        out += _attention_variants(heads, kv, head_dim, dtype, mixed=True, split=split)
    if sampled:
        out.append(_variant("uniform_draws", BLOCK=128))
    return out


def expected_compiles(section: str, quick: bool) -> list[str]:
    """The Triton variants (kernel and constexpr values) a section is expected to compile;
    the kernels section's pytest run compiles the suites' own besides."""
    if section == "kernels":
        heads, kv, head_dim, dtype = (8, 2, 64, "fp32") if quick else (32, 8, 128, "bf16")
        return _attention_variants(heads, kv, head_dim, dtype, mixed=False, split=True)
    if section == "kernel_tests":
        return [] if quick else ["(the suites' own: " + ", ".join(GPU_TESTS) + ")"]
    shapes = QUICK_CHECKPOINTS if quick else CHECKPOINTS
    out: list[str] = []
    for name, dtype, backend, split, sampled in _SECTION_MODELS[section]:
        name = _QUICK_NAMES.get(name, name) if quick else name
        shape = shapes.get(name) or BUILTIN_SHAPES[name]
        if quick and name == "smollm2-135m":
            split = False
        for v in _model_variants(shape, dtype, backend, split, sampled):
            if v not in out:
                out.append(v)
    return out

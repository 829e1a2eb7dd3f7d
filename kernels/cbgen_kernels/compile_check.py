"""Compile every kernel variant the backends and TritonOps launch for a CUDA target, without a
GPU.

Triton lowers to PTX and runs ptxas (shipped with triton) on any machine, so this catches what
the interpreter cannot: type errors of the compiled dialect, unsupported constructs, and tiles
that need more shared memory than the chip has. It must run in a process where
TRITON_INTERPRET is unset (the kernels are then JIT functions, not interpreted ones).

    python -m cbgen_kernels.compile_check [arch ...]     # e.g. 90 (H100/H200), 80 (A100)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

# Shared memory a block may use, by compute capability (bytes; from the CUDA programming guide).
MAX_SHARED = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
ELEMENTWISE = ("add_rmsnorm", "rope", "silu_mul")  # "rope" covers rope_write_kv
"""Variants launched without fused multiply-adds (they round where the torch reference does)."""


_ONE = {"0x3F80", "0x3C00", "0f3F800000", "0x3F800000", "1065353216"}
_ONE |= {"0xBF80", "0xBC00", "0fBF800000", "0xBF800000", "-1082130432"}
"""1.0 and -1.0 as PTX writes them: bf16, fp16 and f32 bit patterns, f32 hex floats, f32 bits
in decimal."""
_MINUS_ZERO = {"0x8000", "0f80000000", "0x80000000", "-2147483648"}
"""-0.0 likewise (bf16 and fp16 share the pattern)."""


def rounding_fmas(ptx: str) -> list[str]:
    """The fused multiply-adds of a PTX listing that round differently from a multiply and an
    add done apart. Left out: a multiplicand of 1.0 or -1.0 (a correctly rounded add or
    subtraction) and an addend of -0.0 (a correctly rounded multiply), which is how LLVM writes
    bf16 adds, subtractions and multiplies for sm_80, which has none of them (fma.rn.bf16 a,
    1.0, b)."""
    ones, minus_zeros = set(_ONE), set(_MINUS_ZERO)
    found = []
    for line in ptx.splitlines():
        parts = line.replace(",", " ").replace(";", " ").split()
        if len(parts) == 3 and parts[0].startswith("mov."):
            if parts[2] in _ONE:
                ones.add(parts[1])
            elif parts[2] in _MINUS_ZERO:
                minus_zeros.add(parts[1])
        elif parts and parts[0].startswith("fma."):
            a, b, c = parts[2], parts[3], parts[4]  # fma d, a, b, c: d = a * b + c
            if a not in ones and b not in ones and c not in minus_zeros:
                found.append(line.strip())
    return found


@dataclass(frozen=True)
class CompiledVariant:
    name: str
    arch: int
    shared_bytes: int
    num_warps: int
    cubin_bytes: int


def _signature(fn: Any, pointers: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers[name]
        elif name.startswith("scale") or name in ("eps", "softcap"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def variants(dtype: str = "bf16") -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """(name, kernel, pointer types, constexprs) of what the backends launch for a model with
    head_dim 128, GQA 4 and 16-token pages, in one dtype ("bf16", "fp16" or "fp32")."""
    from cbgen_kernels.attention import (
        MAX_SPLITS,
        _merge_splits_kernel,
        _paged_attention_kernel,
        choose_config,
    )
    from cbgen_kernels.cache import _rope_write_kv_kernel, _write_kv_kernel
    from cbgen_kernels.elementwise import _rope_kernel, _silu_mul_kernel
    from cbgen_kernels.moe import _grouped_matmul_kernel
    from cbgen_kernels.norm import _add_rmsnorm_kernel
    from cbgen_kernels.sampling import _uniform_kernel

    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    write_ptrs = {
        n: f"*{dtype}" for n in ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr")
    }
    write_ptrs["slot_mapping_ptr"] = "*i64"
    out.append(
        (
            f"write_kv_cache[{dtype}]",
            _write_kv_kernel,
            write_ptrs,
            dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, DIM_PAD=128, PAGE_SIZE=16),
        )
    )
    for label, max_q, splits in (("mixed", 512, 1), ("decode", 1, 1), ("decode-split", 1, 4)):
        cfg = choose_config(32, 8, 128, max_q, splits)
        part = "fp32" if splits > 1 else dtype
        ptrs = {
            "q_ptr": f"*{dtype}",
            "key_cache_ptr": f"*{dtype}",
            "value_cache_ptr": f"*{dtype}",
            "out_ptr": f"*{part}",
            "lse_ptr": f"*{part}",
            "block_table_ptr": "*i32",
            "query_start_loc_ptr": "*i32",
            "seq_lens_ptr": "*i32",
        }
        consts = dict(
            GROUP=4,
            HEAD_DIM=128,
            DIM_PAD=128,
            PAGE_SIZE=16,
            BLOCK_Q=cfg.block_q,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            SPLIT=splits > 1,
            UPCAST=False,
            DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
        )
        out.append((f"paged_attention[{label},{dtype}]", _paged_attention_kernel, ptrs, consts))
    out.append(
        (
            f"merge_splits[{dtype}]",
            _merge_splits_kernel,
            {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": f"*{dtype}"},
            dict(HEAD_DIM=128, DIM_PAD=128, SPLITS_PAD=MAX_SPLITS),
        )
    )
    # the element-wise ops (TritonOps) of a Llama-8B-shape layer: hidden 4096, 32 + 8 heads of
    # 128 rotated in qkv rows, intermediate 14336
    norm_ptrs = {n: f"*{dtype}" for n in ("residual_ptr", "h_ptr", "weight_ptr", "out_ptr")}
    for has_h in (True, False):
        out.append(
            (
                f"add_rmsnorm[{'h' if has_h else 'no-h'},{dtype}]",
                _add_rmsnorm_kernel,
                norm_ptrs,
                dict(N=4096, BLOCK=4096, HAS_H=has_h, SOFT_BF16=False),
            )
        )
    rope_ptrs = {"x_ptr": f"*{dtype}", "positions_ptr": "*i64"}
    rope_ptrs |= {"cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    out.append(
        (
            f"rope[{dtype}]",
            _rope_kernel,
            rope_ptrs,
            dict(NUM_HEADS=40, HEAD_DIM=128, HALF=64, HEADS_PAD=64, HALF_PAD=64, SOFT_BF16=False),
        )
    )
    rope_kv_ptrs = rope_ptrs | {"key_cache_ptr": f"*{dtype}", "value_cache_ptr": f"*{dtype}"}
    rope_kv_ptrs |= {"qkv_ptr": f"*{dtype}", "slot_mapping_ptr": "*i64"}
    out.append(
        (
            f"rope_write_kv[{dtype}]",
            _rope_write_kv_kernel,
            rope_kv_ptrs,
            dict(
                NUM_HEADS=32,
                NUM_KV_HEADS=8,
                HEAD_DIM=128,
                HALF=64,
                HEADS_PAD=32,
                KV_HEADS_PAD=8,
                HALF_PAD=64,
                DIM_PAD=128,
                PAGE_SIZE=16,
                SOFT_BF16=False,
            ),
        )
    )
    out.append(
        (
            f"silu_mul[{dtype}]",
            _silu_mul_kernel,
            {"gate_up_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"},
            dict(INTER=14336, BLOCK=1024, SOFT_BF16=False),
        )
    )
    # a mixture of experts' two grouped launches (Qwen3-30B-A3B's shape: hidden 2048, experts
    # of 768, 128 of them): gate-up with SiLU x up over gathered rows, then down
    for label, n, k, gated in (("gate-up", 768, 2048, True), ("down", 2048, 768, False)):
        moe_ptrs = {"a_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
        moe_ptrs |= {"a_rows_ptr": "*i64" if gated else "*i32", "offsets_ptr": "*i64"}
        moe_ptrs |= {"tile_expert_ptr": "*i32", "tile_start_ptr": "*i32"}
        out.append(
            (
                f"grouped_moe[{label},{dtype}]",
                _grouped_matmul_kernel,
                moe_ptrs,
                dict(
                    NUM_EXPERTS=128,
                    N=n,
                    K=k,
                    GATHER=gated,
                    GATED=gated,
                    BLOCK_M=16,
                    BLOCK_N=64,
                    BLOCK_K=64,
                    UPCAST=False,
                    DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
                    SOFT_BF16=False,
                ),
            )
        )
    # the sampler's device draws (dtype-independent: seeds and counters in, float32 out)
    out.append(
        (
            "uniform_draws",
            _uniform_kernel,
            {"seed_ptr": "*i64", "counter_ptr": "*i64", "out_ptr": "*fp32"},
            dict(BLOCK=128),
        )
    )
    return out


def compile_all(
    arch: int = 90, dtypes: tuple[str, ...] = ("bf16", "fp32")
) -> list[CompiledVariant]:
    """Compile every variant for sm_<arch>; raises on a compile error, a tile that exceeds
    the chip's shared memory, or a fused multiply-add in an element-wise kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cbgen_kernels import interpreted
    from cbgen_kernels.attention import choose_config

    if interpreted():
        raise RuntimeError(
            "compile_check needs TRITON_INTERPRET unset (kernels are interpreted here)"
        )
    target = GPUTarget("cuda", arch, 32)
    results = []
    for dtype in dtypes:
        for name, fn, ptrs, consts in variants(dtype):
            src = ASTSource(fn=fn, signature=_signature(fn, ptrs, consts), constexprs=consts)
            options: dict[str, Any] = {"num_warps": 4}
            if name.startswith("paged_attention["):  # as launched: the config's warps, depth
                cfg = choose_config(32, 8, 128, 1 if "decode" in name else 512)
                options["num_warps"] = cfg.num_warps
                if cfg.num_stages is not None:
                    options["num_stages"] = cfg.num_stages
            if name.startswith(ELEMENTWISE):
                options["enable_fp_fusion"] = False  # as launched: every operation rounded
            compiled = triton.compile(src, target=target, options=options)
            if name.startswith(ELEMENTWISE) and rounding_fmas(compiled.asm["ptx"]):
                raise RuntimeError(
                    f"{name}: fused multiply-adds, which torch's ops do not round as"
                )
            shared = int(compiled.metadata.shared)
            limit = MAX_SHARED.get(arch, 99 * 1024)
            if shared > limit:
                raise RuntimeError(
                    f"{name}: needs {shared} bytes of shared memory, sm_{arch} has {limit}"
                )
            results.append(
                CompiledVariant(
                    name, arch, shared, int(compiled.metadata.num_warps), len(compiled.asm["cubin"])
                )
            )
    return results


def main(argv: list[str]) -> int:
    archs = [int(a) for a in argv] or [90]
    for arch in archs:
        for v in compile_all(arch):
            print(
                f"sm_{v.arch} {v.name}: shared {v.shared_bytes} B, {v.num_warps} warps, cubin {v.cubin_bytes} B"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

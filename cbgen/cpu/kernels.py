"""The C kernels' Python side for attention and the element-wise ops: each wrapper checks every
tensor it hands to C as a raw pointer (cbgen.cpu.checks), then calls the library that
cbgen.cpu.build made for this machine. The matmul kernels are cbgen.cpu.gemm, the exact LM heads'
cbgen.cpu.head_kernels, and the build's own answers (row thresholds, the prefill split)
cbgen.cpu.thresholds.
"""

from __future__ import annotations

import torch

from cbgen.cpu import build
from cbgen.cpu.checks import check, check_contiguous, library, softcap, window


def exp_sub_sum_(scores: torch.Tensor, m: float) -> float | None:
    """The decode kernel's softmax step on its own: scores[i] = exp(scores[i] - m) in place
    (float32, contiguous, every score <= m); returns their sum. None without the kernels."""
    check("scores", scores, torch.float32)
    check_contiguous("scores", scores)
    lib = build.load_library()
    if lib is None:
        return None
    return lib.cbgen_exp_sub_sum_f32(scores.data_ptr(), scores.numel(), m)


def paged_decode_f32(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor | None:
    """Decode attention, one query token per sequence: query [B, H, D] float32 (CPU; each
    row's heads packed, rows at any stride: a view of the QKV projection is read in place),
    kv_cache [2, num_blocks, block_size, Hkv, D] contiguous, block_table [B, n] int32,
    seq_lens [B] int32; with a sliding window, sequence b reads only its last sliding_window
    keys (from their first block on), and logit_softcap caps the scores (see
    cbgen.attention.base). A bfloat16 kv_cache is widened to float32 as it is read (the
    float32 kernel's arithmetic on the widened values). None when the kernel is unavailable or
    cannot hold the shape."""
    check("query", query, torch.float32, ("B", "H", "D"))
    b, h, d = query.shape
    cache_dtype = torch.bfloat16 if kv_cache.dtype == torch.bfloat16 else torch.float32
    check("kv_cache", kv_cache, cache_dtype, (2, "num_blocks", "block_size", "Hkv", d))
    check_contiguous("kv_cache", kv_cache)
    check("block_table", block_table, torch.int32, (b, "n"))
    check("seq_lens", seq_lens, torch.int32, (b,))
    _, _, bs, hkv, _ = kv_cache.shape
    if h % hkv:
        raise ValueError(f"query: {h} heads are not a multiple of the cache's {hkv} KV heads")
    lib = build.load_library()
    if lib is None:
        return None
    q = query if query.stride(2) == 1 and query.stride(1) == d else query.contiguous()
    bt = block_table.contiguous()
    sl = seq_lens.contiguous()
    out = torch.empty(b, h, d, dtype=torch.float32)
    kernel = (
        lib.cbgen_paged_decode_bf16kv
        if cache_dtype == torch.bfloat16
        else lib.cbgen_paged_decode_f32
    )
    rc = kernel(
        q.data_ptr(),
        q.stride(0),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        bt.data_ptr(),
        bt.shape[1],
        sl.data_ptr(),
        b,
        h,
        hkv,
        d,
        bs,
        scale,
        window(sliding_window),
        softcap(logit_softcap),
        out.data_ptr(),
    )
    if rc != 0:
        return None
    return out


def prefill_takes(head_dim: int) -> bool:
    """Whether the prefill kernels take heads of this size."""
    return head_dim in (64, 128)


def prefill_attention_f32(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor | None:
    """Causal attention of a prompt chunk: query [Q, H, D] (float32, rows at positions
    L - Q .. L - 1) over key, value [L, Hkv, D] (the chunk's cached context, then itself; only
    relative positions matter, so the keys may start anywhere at or before the first row's
    window). Out [Q, H, D]; None without the kernels or for what the kernel does not take
    (another dtype, D other than 64 or 128)."""
    return _prefill(
        "cbgen_prefill_attention_f32", torch.float32, query, key, value, scale,
        sliding_window, logit_softcap,
    )  # fmt: skip


def prefill_attention_bf16(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor | None:
    """prefill_attention_f32 over bfloat16 key and value (a bf16 cache's rows) with bf16 dot
    products: the query and the softmax's probabilities rounded to bf16, every sum and the
    softmax in float32 (a bf16 flash attention's arithmetic). None where the build has no bf16
    dot products, and as prefill_attention_f32."""
    return _prefill(
        "cbgen_prefill_attention_bf16", torch.bfloat16, query, key, value, scale,
        sliding_window, logit_softcap,
    )  # fmt: skip


def _prefill(
    kernel: str,
    kv_dtype: torch.dtype,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> torch.Tensor | None:
    if query.dtype != torch.float32 or not key.dtype == value.dtype == kv_dtype:
        return None
    check("query", query, torch.float32, ("Q", "H", "D"))
    q_len, heads, head_dim = query.shape
    check("key", key, kv_dtype, ("L", "Hkv", head_dim))
    check("value", value, kv_dtype, tuple(key.shape))
    seq_len, kv_heads, _ = key.shape
    if seq_len < q_len or heads % kv_heads:
        raise ValueError(
            f"key: {seq_len} positions x {kv_heads} heads cannot serve a query of {q_len} x {heads}"
        )
    lib = build.load_library()
    if lib is None:
        return None
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    k, v = key.contiguous(), value.contiguous()
    out = torch.empty(q_len, heads, head_dim, dtype=torch.float32)
    rc = getattr(lib, kernel)(
        query.data_ptr(),
        query.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        heads * head_dim,
        q_len,
        seq_len - q_len,
        heads,
        kv_heads,
        head_dim,
        scale,
        window(sliding_window),
        softcap(logit_softcap),
    )
    return None if rc else out


def write_kv_f32(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """torch_backend.write_kv_cache in one C call, for float32 CPU tensors whose heads are
    packed in each row (key/value [T, Hkv, D], any row stride; slot_mapping int64, negative
    slots skipped), into a float32 cache or a bfloat16 one (each value rounded to nearest even,
    as torch's conversion). False, writing nothing, when the tensors do not fit that
    description."""
    lib = build.load_library()
    if (
        lib is None
        or key.dim() != 3
        or not (key.dtype == value.dtype == torch.float32)
        or kv_cache.dtype not in (torch.float32, torch.bfloat16)
        or slot_mapping.dtype != torch.int64
        or not (key.is_cpu and value.is_cpu and kv_cache.is_cpu and slot_mapping.is_cpu)
        or not kv_cache.is_contiguous()
        or kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or kv_cache.shape[-2:] != key.shape[1:]
        or value.shape != key.shape
        or any(x.stride(2) != 1 or x.stride(1) != x.shape[2] for x in (key, value))
        or slot_mapping.shape != key.shape[:1]
    ):
        return False
    t, hkv, d = key.shape
    slots = slot_mapping.contiguous()
    write = lib.cbgen_write_kv_bf16 if kv_cache.dtype == torch.bfloat16 else lib.cbgen_write_kv_f32
    rc = write(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        kv_cache[0].numel() // (hkv * d),
        slots.data_ptr(),
        t,
        hkv * d,
    )
    if rc != 0:
        raise IndexError(
            f"KV write: a slot is past the cache's {kv_cache[0].numel() // (hkv * d)} slots"
        )
    return True


# ---- fused element-wise ops (float32, contiguous rows; callers check availability) ------


def add_rmsnorm_(
    residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (when given), in place; returns weight * rmsnorm(residual). residual and
    x [T, H], weight [H], all float32 and contiguous."""
    check("residual", residual, torch.float32, ("T", "H"))
    t, h = residual.shape
    check("weight", weight, torch.float32, (h,))
    if x is not None:
        check("x", x, torch.float32, (t, h))
    for name, a in (("residual", residual), ("x", x), ("weight", weight)):
        if a is not None:
            check_contiguous(name, a)
    lib = library()
    out = torch.empty_like(residual)
    lib.cbgen_add_rmsnorm_f32(
        residual.data_ptr(),
        None if x is None else x.data_ptr(),
        weight.data_ptr(),
        eps,
        t,
        h,
        out.data_ptr(),
    )
    return out


def _check_head_rows(x: torch.Tensor, heads: int, head_dim: int) -> int:
    """x [T, C] float32 holds `heads` heads of head_dim contiguous floats at the start of each
    row (rows at any stride, not overlapping them); returns T."""
    check("x", x, torch.float32, ("T", "C"))
    t = x.shape[0]
    if (
        x.shape[1] < heads * head_dim
        or x.stride(1) != 1
        or (t > 1 and x.stride(0) < heads * head_dim)
    ):
        raise ValueError(
            f"x: rows of {heads} heads x {head_dim} contiguous floats expected, got shape {list(x.shape)} "
            f"and strides {x.stride()}"
        )
    return t


def rope_(
    x: torch.Tensor,
    heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotate, in place, the first `heads` heads of each row of x [T, >= heads * head_dim]
    (float32, unit column stride) at positions [T] int64, from the tables cos and sin
    [max_positions, head_dim / 2] float32, contiguous."""
    if head_dim % 2:
        raise ValueError(f"head_dim: RoPE turns pairs of dimensions, got {head_dim}")
    t = _check_head_rows(x, heads, head_dim)
    check("positions", positions, torch.int64, (t,))
    check("cos", cos, torch.float32, ("max_positions", head_dim // 2))
    check("sin", sin, torch.float32, tuple(cos.shape))
    for name, a in (("positions", positions), ("cos", cos), ("sin", sin)):
        check_contiguous(name, a)
    lib = library()
    lib.cbgen_rope_f32(
        x.data_ptr(),
        x.stride(0),
        t,
        heads,
        head_dim,
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
    )


def rmsnorm_heads_(
    x: torch.Tensor, heads: int, head_dim: int, weight: torch.Tensor, eps: float
) -> None:
    """RMSNorm in place over each of the first `heads` heads of each row of x
    [T, >= heads * head_dim] (float32, unit column stride, rows at any stride), weight
    [head_dim] float32 shared by the heads (q/k norms)."""
    t = _check_head_rows(x, heads, head_dim)
    check("weight", weight, torch.float32, (head_dim,))
    check_contiguous("weight", weight)
    library().cbgen_rmsnorm_heads_f32(
        x.data_ptr(), x.stride(0), t, heads, head_dim, weight.data_ptr(), eps
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (gate first) float32: one pass, [T, I] out."""
    return _gated("cbgen_silu_mul_f32", gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate) * up, GELU in its tanh approximation (GeGLU), for gate_up as in silu_mul."""
    return _gated("cbgen_gelu_tanh_mul_f32", gate_up)


def _gated(kernel: str, gate_up: torch.Tensor) -> torch.Tensor:
    check("gate_up", gate_up, torch.float32, ("T", "2I"))
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(
            f"gate_up: expected an even number of columns (gate, then up), got {two_i}"
        )
    lib = library()
    gu = gate_up.contiguous()
    out = torch.empty(t, two_i // 2, dtype=torch.float32)
    getattr(lib, kernel)(gu.data_ptr(), t, two_i // 2, out.data_ptr())
    return out


def sample(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """Temperature sampling by inverse CDF for logits [B, V] float32,
    temperature [B] (> 0) and u [B] in [0, 1): per row, the first token whose running sum of
    exp(logit / T - max) exceeds u x the total (cbgen/cpu/csrc/sample.c). The logits are
    not modified. None without the kernels or when a row holds NaN or +inf."""
    check("logits", logits, torch.float32, ("B", "V"))
    b, v = logits.shape
    temp = temperature.to(torch.float32).contiguous()
    draws = u.to(torch.float32).contiguous()
    check("temperature", temp, torch.float32, (b,))
    check("u", draws, torch.float32, (b,))
    lib = build.load_library()
    if lib is None:
        return None
    if logits.stride(1) != 1 or logits.stride(0) < logits.shape[1]:
        logits = logits.contiguous()
    out = torch.empty(b, dtype=torch.int64)
    rc = lib.cbgen_sample_f32(
        logits.data_ptr(), b, v, logits.stride(0), temp.data_ptr(), draws.data_ptr(), out.data_ptr()
    )
    return None if rc else out


def fused_ops_available() -> bool:
    return build.load_library() is not None

"""The C kernels' Python side: each wrapper checks every tensor it hands to C as a raw pointer
(dtype, shape, layout, device) and raises TypeError or ValueError (checks that hold under
`python -O` too), then calls the library that cbgen.cpu.build made for this machine.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from collections.abc import Sequence

import torch

from cbgen.cpu.build import load_library, native_status

# ---- argument checks: every tensor handed to C as a raw pointer ------------------------


def _check(
    name: str, t: torch.Tensor, dtype: torch.dtype, shape: Sequence[int | str] | None = None
) -> None:
    """t is a CPU tensor of dtype and, when shape is given, of that shape (a str: any size,
    named for the message). TypeError for the dtype, ValueError for the rest."""
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype}, got {t.dtype}")
    if not t.is_cpu:
        raise ValueError(f"{name}: expected a CPU tensor, got one on {t.device}")
    if shape is None:
        return
    # a plain loop: these checks run for every kernel call of every layer (~700 a decode step)
    got = t.shape
    bad = len(got) != len(shape)
    if not bad:
        for want, n in zip(shape, got, strict=False):  # lengths equal: checked above
            if want.__class__ is int and want != n:
                bad = True
                break
    if bad:
        want_text = ", ".join(str(w) for w in shape)
        raise ValueError(f"{name}: expected shape [{want_text}], got {list(got)}")


def _check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor, got strides {t.stride()} for shape {list(t.shape)}"
        )


def _library() -> ctypes.CDLL:
    """The kernels, for the ops whose callers checked fused_ops_available()."""
    lib = load_library()
    if lib is None:
        raise RuntimeError(native_status())
    return lib


def exp_sub_sum_(scores: torch.Tensor, m: float) -> float | None:
    """The decode kernel's softmax step on its own: scores[i] = exp(scores[i] - m) in place
    (float32, contiguous, every score <= m); returns their sum. None without the kernels."""
    _check("scores", scores, torch.float32)
    _check_contiguous("scores", scores)
    lib = load_library()
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
    cbgen.attention.base). None when the kernel is unavailable or cannot hold the shape."""
    _check("query", query, torch.float32, ("B", "H", "D"))
    b, h, d = query.shape
    _check("kv_cache", kv_cache, torch.float32, (2, "num_blocks", "block_size", "Hkv", d))
    _check_contiguous("kv_cache", kv_cache)
    _check("block_table", block_table, torch.int32, (b, "n"))
    _check("seq_lens", seq_lens, torch.int32, (b,))
    _, _, bs, hkv, _ = kv_cache.shape
    if h % hkv:
        raise ValueError(f"query: {h} heads are not a multiple of the cache's {hkv} KV heads")
    lib = load_library()
    if lib is None:
        return None
    q = query if query.stride(2) == 1 and query.stride(1) == d else query.contiguous()
    bt = block_table.contiguous()
    sl = seq_lens.contiguous()
    out = torch.empty(b, h, d, dtype=torch.float32)
    rc = lib.cbgen_paged_decode_f32(
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
        _window(sliding_window),
        _softcap(logit_softcap),
        out.data_ptr(),
    )
    if rc != 0:
        return None
    return out


# ---- fused element-wise ops (float32, contiguous rows; callers check availability) ------


def add_rmsnorm_(
    residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (when given), in place; returns weight * rmsnorm(residual). residual and
    x [T, H], weight [H], all float32 and contiguous."""
    _check("residual", residual, torch.float32, ("T", "H"))
    t, h = residual.shape
    _check("weight", weight, torch.float32, (h,))
    if x is not None:
        _check("x", x, torch.float32, (t, h))
    for name, a in (("residual", residual), ("x", x), ("weight", weight)):
        if a is not None:
            _check_contiguous(name, a)
    lib = _library()
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
    _check("x", x, torch.float32, ("T", "C"))
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
    _check("positions", positions, torch.int64, (t,))
    _check("cos", cos, torch.float32, ("max_positions", head_dim // 2))
    _check("sin", sin, torch.float32, tuple(cos.shape))
    for name, a in (("positions", positions), ("cos", cos), ("sin", sin)):
        _check_contiguous(name, a)
    lib = _library()
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
    _check("weight", weight, torch.float32, (head_dim,))
    _check_contiguous("weight", weight)
    _library().cbgen_rmsnorm_heads_f32(
        x.data_ptr(), x.stride(0), t, heads, head_dim, weight.data_ptr(), eps
    )


def write_kv_f32(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """torch_backend.write_kv_cache in one C call, for float32 CPU tensors whose heads are
    packed in each row (key/value [T, Hkv, D], any row stride; slot_mapping int64, negative
    slots skipped). False, writing nothing, when the tensors do not fit that description."""
    lib = load_library()
    if (
        lib is None
        or key.dim() != 3
        or not (key.dtype == value.dtype == kv_cache.dtype == torch.float32)
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
    rc = lib.cbgen_write_kv_f32(
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


def head_bf16(
    logits: torch.Tensor,
    hidden: torch.Tensor,
    hidden16: torch.Tensor,
    weight: torch.Tensor,
    weight_residual_norms: torch.Tensor,
    weight_norms: torch.Tensor,
    bound: tuple[float, float, float, float],
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    max_attempts: int,
) -> tuple[torch.Tensor, int]:
    """Tokens from bfloat16 logits [M, V] = hidden16 @ bf16(weight).T, as from the float32
    logits hidden @ weight.T (csrc/bf16_head.c has the bound; bound = its g, m, b, c): per row
    the argmax (temperature 0) or a draw from softmax(logits / T) by rejection, its uniforms
    from a splitmix64 stream started at the row's seed. Returns (token ids [M] int64, -1 where
    a row must take the float32 path; the most candidates a greedy row needed)."""
    _check("logits", logits, torch.bfloat16, ("M", "V"))
    _check_contiguous("logits", logits)
    m, v = logits.shape
    _check("hidden", hidden, torch.float32, (m, "K"))
    k = hidden.shape[1]
    _check("hidden16", hidden16, torch.bfloat16, (m, k))
    _check("weight", weight, torch.float32, (v, k))
    _check("weight_residual_norms", weight_residual_norms, torch.float32, (v,))
    _check("weight_norms", weight_norms, torch.float32, (v,))
    temp = temperature.to(torch.float32).contiguous()
    seed = seeds.to(torch.int64).contiguous()
    _check("temperature", temp, torch.float32, (m,))
    _check("seeds", seed, torch.int64, (m,))
    lib = _library()
    h, h16, w = hidden.contiguous(), hidden16.contiguous(), weight.contiguous()
    r, n = weight_residual_norms.contiguous(), weight_norms.contiguous()
    out = torch.empty(m, dtype=torch.int64)
    ptrs = (h.data_ptr(), h16.data_ptr(), k, w.data_ptr(), r.data_ptr(), n.data_ptr())
    most = lib.cbgen_head_bf16(
        logits.data_ptr(),
        m,
        v,
        *ptrs,
        *bound,
        temp.data_ptr(),
        seed.data_ptr(),
        max_attempts,
        out.data_ptr(),
    )
    return out, int(most)


def head_i16_available() -> bool:
    """This machine's build has the int16 LM head (x86-64 with AVX2)."""
    lib = load_library()
    return lib is not None and bool(lib.cbgen_head_i16_available())


HEAD_I16_PANEL = 16
"""Vocabulary rows per packed panel of the int16 head."""


def head_i16_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The LM head weight [V, K] float32 packed for head_i16: (q, the int16 panels
    [ceil(V / 16), ceil(K / 2), 16, 2]; scale [ceil(V / 16) * 16], each row's step; the residual
    norms |scale_v q_v - w_v| [ceil(V / 16) * 16], rounded up, 0 past V; W, the largest |q|).
    ValueError for a weight that is not finite."""
    _check("weight", weight, torch.float32, ("V", "K"))
    lib = _library()
    v, k = weight.shape
    levels = int(lib.cbgen_head_i16_levels(k))
    p, k2 = -(-v // HEAD_I16_PANEL), -(-k // 2)
    q = torch.empty(p, k2, HEAD_I16_PANEL, 2, dtype=torch.int16)
    scale = torch.empty(p * HEAD_I16_PANEL, dtype=torch.float32)
    wres = torch.zeros(p * HEAD_I16_PANEL, dtype=torch.float32)
    w = weight.contiguous()
    if lib.cbgen_head_i16_pack(
        w.data_ptr(), v, k, levels, q.data_ptr(), scale.data_ptr(), wres.data_ptr()
    ):
        raise ValueError("LM head weight: a value is not finite")
    return q, scale, wres, levels


def head_i16_scratch(rows: int, vocab: int) -> int:
    """Floats of head_i16's scratch for `rows` rows: each row's upper bounds, and its two maxima
    per panel."""
    return rows * -(-vocab // HEAD_I16_PANEL) * (HEAD_I16_PANEL + 2)


def head_i16(
    hidden: torch.Tensor,
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
    weight: torch.Tensor,
    weight_norms: torch.Tensor,
    bound: tuple[float, float, float, float],
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    max_attempts: int,
    scratch: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """Tokens of the float32 logits hidden @ weight.T from int16 logits over head_i16_pack's
    copy (csrc/int16_head.c; the bound and the selection as for head_bf16): per row the argmax
    (temperature 0) or a draw from softmax(logits / T). weight_norms: |w_v| rounded up, 0-padded
    like the packed residual norms; scratch: float32, at least M x ceil(V / 16) * 18 elements
    (head_i16_scratch). Returns (token ids [M] int64, -1 where a row must take the float32 path;
    the most candidates a greedy row needed)."""
    q, scale, wres, levels = packed
    _check("q", q, torch.int16, ("P", "K2", HEAD_I16_PANEL, 2))
    _check_contiguous("q", q)
    p, k2 = q.shape[:2]
    _check("weight", weight, torch.float32, ("V", "K"))
    v, k = weight.shape
    if p != -(-v // HEAD_I16_PANEL) or k2 != -(-k // 2):
        raise ValueError(
            f"q: shape {list(q.shape)} is not the packing of a weight of shape {[v, k]}"
        )
    _check("scale", scale, torch.float32, (p * HEAD_I16_PANEL,))
    _check("wres", wres, torch.float32, (p * HEAD_I16_PANEL,))
    _check("weight_norms", weight_norms, torch.float32, (p * HEAD_I16_PANEL,))
    _check("hidden", hidden, torch.float32, ("M", k))
    m = hidden.shape[0]
    lib = _library()
    # the hidden state's scale keeps the int32 sums below 2^31 for that range only
    if levels != lib.cbgen_head_i16_levels(k):
        raise ValueError(f"levels: {levels} is not what head_i16_pack packs a hidden size {k} with")
    _check("scratch", scratch, torch.float32)
    _check_contiguous("scratch", scratch)
    if scratch.numel() < head_i16_scratch(m, v):
        raise ValueError(f"scratch: {scratch.numel()} floats, {head_i16_scratch(m, v)} needed")
    temp = temperature.to(torch.float32).contiguous()
    seed = seeds.to(torch.int64).contiguous()
    _check("temperature", temp, torch.float32, (m,))
    _check("seeds", seed, torch.int64, (m,))
    h, w = hidden.contiguous(), weight.contiguous()
    for t in (scale, wres, weight_norms):
        _check_contiguous("scale, wres and weight_norms", t)
    out = torch.empty(m, dtype=torch.int64)
    most = lib.cbgen_head_i16(
        h.data_ptr(),
        m,
        k,
        q.data_ptr(),
        scale.data_ptr(),
        v,
        levels,
        w.data_ptr(),
        wres.data_ptr(),
        weight_norms.data_ptr(),
        *bound,
        temp.data_ptr(),
        seed.data_ptr(),
        max_attempts,
        scratch.data_ptr(),
        out.data_ptr(),
    )
    if most < 0:
        raise RuntimeError("int16 LM head: not in this build, or out of memory")
    return out, int(most)


PANEL = 32
"""Output columns per packed panel of small_gemm (N must be a multiple)."""


def build_small_gemm_max_rows() -> int:
    """Up to this many rows small_gemm beats oneDNN's packed matmul with the tiles of this
    machine's build (0 without the kernels); the build answers, since the tiles are chosen per
    ISA when it is compiled. With AVX-512 (16-row tiles, measured over a whole model's layers
    from cold caches: 1.6x at 1 row, 1.4x at 8, 1.1-1.2x at 29-512, even at 640, 2 % slower at
    1024) and with AVX2 (6-row tiles; in packed row blocks from 96 rows on par with oneDNN up
    to 2,048): docs/PERFORMANCE.md. The build's default: the runtime uses what cbgen.cpu.tuning
    measured on this machine where it could (cbgen.runtime.cpu.CpuThresholds)."""
    lib = load_library()
    return 0 if lib is None else int(lib.cbgen_small_gemm_max_rows())


def build_small_gemm_blocked_rows() -> int:
    """From this many rows on, by this build's default, small_gemm copies the rows in blocks
    that stay in L2 while the weights stream past (0 without the kernels); fewer rows stream
    from where they are while each weight panel sits in L2 and the next is prefetched. Both
    give the same bits. The runtime passes what the tuning measured (CpuThresholds)."""
    lib = load_library()
    return 0 if lib is None else int(lib.cbgen_small_gemm_blocked_rows())


HUGE_PAGE = 2 << 20
"""Transparent huge page size (x86-64, and arm64 with 4 KiB base pages)."""


class HugePageArena:
    """Float32 buffers in anonymous memory maps advised for transparent huge pages
    (`MADV_HUGEPAGE`, which the kernel honours when THP is `always` or `madvise`), handed
    out back to back from chunks of at least `chunk_bytes` (huge-page aligned, so each page
    the buffers fill is one 2 MiB page).

    For the packed matmul weights, which every decode step streams from memory once: with
    4 KiB pages the stream meets a new TLB entry every 4 KiB, and the hardware prefetchers
    stop at each page boundary. On SmolLM2 a decode step of 8 sequences measured ~10 %
    faster with the weights in 2 MiB pages, 16 sequences ~4 %, 64 (bound by arithmetic) ~1 %
    (docs/PERFORMANCE.md, "Decode-sized matmuls"). Buffers keep their chunk
    alive; nothing is ever returned to a chunk."""

    def __init__(self, chunk_bytes: int = 64 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # float32, the current chunk's unused tail
        self.huge = hasattr(mmap, "MADV_HUGEPAGE")

    def empty(self, numel: int) -> torch.Tensor:
        """An uninitialised float32 tensor of numel elements (64-byte aligned)."""
        if not self.huge or numel == 0:
            return torch.empty(numel, dtype=torch.float32)
        size = -(-numel // 16) * 16  # keep the next buffer on a cache line
        if self._chunk is None or self._chunk.numel() < size:
            self._chunk = self._new_chunk(size * 4)
            if self._chunk is None:
                return torch.empty(numel, dtype=torch.float32)
        out, self._chunk = self._chunk[:numel], self._chunk[size:]
        return out

    def _new_chunk(self, nbytes: int) -> torch.Tensor | None:
        nbytes = -(-max(nbytes, self.chunk_bytes) // HUGE_PAGE) * HUGE_PAGE
        try:
            # one spare huge page, to start on a 2 MiB boundary wherever the map lands
            buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf.madvise(mmap.MADV_HUGEPAGE)  # before anything touches the pages
        except (OSError, ValueError):
            self.huge = False
            return None
        whole = torch.frombuffer(buf, dtype=torch.uint8)
        start = -whole.data_ptr() % HUGE_PAGE
        return torch.frombuffer(buf, dtype=torch.float32, count=nbytes // 4, offset=start)


_WEIGHT_ARENA = HugePageArena()


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] float32 packed for small_gemm (in huge pages where the OS gives them);
    None when N is not a multiple of 32, the weight not float32, or the kernels unavailable."""
    if weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(
            f"weight: expected a 2-D CPU tensor, got shape {list(weight.shape)} on {weight.device}"
        )
    lib = load_library()
    n, k = weight.shape
    if lib is None or weight.dtype != torch.float32 or n % PANEL:
        return None
    w = weight.contiguous()
    out = _WEIGHT_ARENA.empty(n * k)
    lib.cbgen_pack_panels_f32(w.data_ptr(), n, k, out.data_ptr())
    return out.view(n // PANEL, k, PANEL)


def small_gemm(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, blocked_from: int = 0
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias [N]) for W [N, K] packed by pack_panels into panels
    [N / 32, K, 32] (all float32, M small: see build_small_gemm_max_rows); from blocked_from
    rows on (0: the build's default) in row blocks, the same bits either way."""
    _check("panels", panels, torch.float32, ("P", "K", PANEL))
    _check_contiguous("panels", panels)
    p, k, _ = panels.shape
    _check("x", x, torch.float32, ("M", k))
    if bias is not None:
        _check("bias", bias, torch.float32, (p * PANEL,))
    lib = _library()
    x = x.contiguous()
    m, n = x.shape[0], p * PANEL
    y = torch.empty(m, n, dtype=torch.float32)
    b = None if bias is None else bias.contiguous()
    lib.cbgen_small_gemm_f32(
        x.data_ptr(),
        m,
        k,
        panels.data_ptr(),
        n,
        None if b is None else b.data_ptr(),
        blocked_from,
        y.data_ptr(),
    )
    return y


GATED_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
"""The activations small_gemm_gated applies: SiLU, GELU's tanh form (GeGLU)."""


def small_gemm_gated(
    x: torch.Tensor, panels: torch.Tensor, activation: str, blocked_from: int = 0
) -> torch.Tensor | None:
    """act(x @ W_gate.T) * (x @ W_up.T) [M, I] for a gate-up weight [2I, K] packed by
    pack_panels (gate rows first), in one pass that never writes the gate-up product: the same
    bits as silu_mul / gelu_tanh_mul of small_gemm's result. None where it does not serve:
    fewer rows than blocked_from (0: the build's default; it runs the row blocks only), I not
    a multiple of 32, or no memory for the blocks."""
    _check("panels", panels, torch.float32, ("P", "K", PANEL))
    _check_contiguous("panels", panels)
    p, k, _ = panels.shape
    _check("x", x, torch.float32, ("M", k))
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(
            f"activation: expected one of {sorted(GATED_ACTIVATIONS)}, got {activation!r}"
        )
    m, i = x.shape[0], p * PANEL // 2
    if m < (blocked_from if blocked_from > 0 else build_small_gemm_blocked_rows()) or p % 2:
        return None
    lib = _library()
    x = x.contiguous()
    y = torch.empty(m, i, dtype=torch.float32)
    act = GATED_ACTIVATIONS[activation]
    if lib.cbgen_small_gemm_gated_f32(x.data_ptr(), m, k, panels.data_ptr(), i, act, y.data_ptr()):
        return None
    return y


@functools.cache
def prefill_split() -> tuple[int, bool]:
    """How the cpu attention backend splits prompt chunks with this machine's build: (rows,
    kernel). A chunk whose query tokens read at most `rows` K/V rows in all goes to the decode
    kernel, one token at a time; a larger one to prefill_attention_f32 when `kernel`, else to
    torch's SDPA. The build answers, since the kernels' tiles are chosen per ISA when it is
    compiled (docs/PERFORMANCE.md: 8192 and the kernel, with AVX-512 and with AVX2).
    (8192, True) without the kernels, where every chunk takes torch's path anyway."""
    lib = load_library()
    if lib is None:
        return 8192, True
    return int(lib.cbgen_native_prefill_rows()), bool(lib.cbgen_prefill_kernel_preferred())


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
    if not query.dtype == key.dtype == value.dtype == torch.float32:
        return None
    _check("query", query, torch.float32, ("Q", "H", "D"))
    q_len, heads, head_dim = query.shape
    _check("key", key, torch.float32, ("L", "Hkv", head_dim))
    _check("value", value, torch.float32, tuple(key.shape))
    seq_len, kv_heads, _ = key.shape
    if seq_len < q_len or heads % kv_heads:
        raise ValueError(
            f"key: {seq_len} positions x {kv_heads} heads cannot serve a query of {q_len} x {heads}"
        )
    lib = load_library()
    if lib is None:
        return None
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    k, v = key.contiguous(), value.contiguous()
    out = torch.empty(q_len, heads, head_dim, dtype=torch.float32)
    rc = lib.cbgen_prefill_attention_f32(
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
        _window(sliding_window),
        _softcap(logit_softcap),
    )
    return None if rc else out


def _window(sliding_window: int | None) -> int:
    """The kernels' window argument: 0 for none."""
    if sliding_window is None:
        return 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window: must be >= 1, got {sliding_window}")
    return sliding_window


def _softcap(logit_softcap: float | None) -> float:
    """The kernels' softcap argument: 0 for none."""
    if logit_softcap is None:
        return 0.0
    if not logit_softcap > 0:
        raise ValueError(f"logit_softcap: must be > 0, got {logit_softcap}")
    return logit_softcap


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (gate first) float32: one pass, [T, I] out."""
    return _gated("cbgen_silu_mul_f32", gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate) * up, GELU in its tanh approximation (GeGLU), for gate_up as in silu_mul."""
    return _gated("cbgen_gelu_tanh_mul_f32", gate_up)


def _gated(kernel: str, gate_up: torch.Tensor) -> torch.Tensor:
    _check("gate_up", gate_up, torch.float32, ("T", "2I"))
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(
            f"gate_up: expected an even number of columns (gate, then up), got {two_i}"
        )
    lib = _library()
    gu = gate_up.contiguous()
    out = torch.empty(t, two_i // 2, dtype=torch.float32)
    getattr(lib, kernel)(gu.data_ptr(), t, two_i // 2, out.data_ptr())
    return out


def sample(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """Temperature sampling by inverse CDF for logits [B, V] float32,
    temperature [B] (> 0) and u [B] in [0, 1): per row, the first token whose running sum of
    exp(logit / T - max) exceeds u x the total (cbgen/cpu/csrc/sample.c). The logits are
    not modified. None without the kernels or when a row holds NaN or +inf."""
    _check("logits", logits, torch.float32, ("B", "V"))
    b, v = logits.shape
    temp = temperature.to(torch.float32).contiguous()
    draws = u.to(torch.float32).contiguous()
    _check("temperature", temp, torch.float32, (b,))
    _check("u", draws, torch.float32, (b,))
    lib = load_library()
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
    return load_library() is not None

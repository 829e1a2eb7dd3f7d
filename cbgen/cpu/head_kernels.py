"""The exact LM heads' kernels (csrc/bf16_head.c, csrc/int16_head.c): tokens from bfloat16 or
int16 logits within a proven bound of the float32 ones, and the int16 head's packing. The heads
that hold their weights and call these are cbgen.cpu.linear's Bf16Head and Int16Head.
"""

from __future__ import annotations

import torch

from cbgen.cpu import build
from cbgen.cpu.checks import check, check_contiguous, library


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
    check("logits", logits, torch.bfloat16, ("M", "V"))
    check_contiguous("logits", logits)
    m, v = logits.shape
    check("hidden", hidden, torch.float32, (m, "K"))
    k = hidden.shape[1]
    check("hidden16", hidden16, torch.bfloat16, (m, k))
    check("weight", weight, torch.float32, (v, k))
    check("weight_residual_norms", weight_residual_norms, torch.float32, (v,))
    check("weight_norms", weight_norms, torch.float32, (v,))
    temp = temperature.to(torch.float32).contiguous()
    seed = seeds.to(torch.int64).contiguous()
    check("temperature", temp, torch.float32, (m,))
    check("seeds", seed, torch.int64, (m,))
    lib = library()
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
    lib = build.load_library()
    return lib is not None and bool(lib.cbgen_head_i16_available())


HEAD_I16_PANEL = 16
"""Vocabulary rows per packed panel of the int16 head."""


def head_i16_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The LM head weight [V, K] float32 packed for head_i16: (q, the int16 panels
    [ceil(V / 16), ceil(K / 2), 16, 2]; scale [ceil(V / 16) * 16], each row's step; the residual
    norms |scale_v q_v - w_v| [ceil(V / 16) * 16], rounded up, 0 past V; W, the largest |q|).
    ValueError for a weight that is not finite."""
    check("weight", weight, torch.float32, ("V", "K"))
    lib = library()
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
    check("q", q, torch.int16, ("P", "K2", HEAD_I16_PANEL, 2))
    check_contiguous("q", q)
    p, k2 = q.shape[:2]
    check("weight", weight, torch.float32, ("V", "K"))
    v, k = weight.shape
    if p != -(-v // HEAD_I16_PANEL) or k2 != -(-k // 2):
        raise ValueError(
            f"q: shape {list(q.shape)} is not the packing of a weight of shape {[v, k]}"
        )
    check("scale", scale, torch.float32, (p * HEAD_I16_PANEL,))
    check("wres", wres, torch.float32, (p * HEAD_I16_PANEL,))
    check("weight_norms", weight_norms, torch.float32, (p * HEAD_I16_PANEL,))
    check("hidden", hidden, torch.float32, ("M", k))
    m = hidden.shape[0]
    lib = library()
    # the hidden state's scale keeps the int32 sums below 2^31 for that range only
    if levels != lib.cbgen_head_i16_levels(k):
        raise ValueError(f"levels: {levels} is not what head_i16_pack packs a hidden size {k} with")
    check("scratch", scratch, torch.float32)
    check_contiguous("scratch", scratch)
    if scratch.numel() < head_i16_scratch(m, v):
        raise ValueError(f"scratch: {scratch.numel()} floats, {head_i16_scratch(m, v)} needed")
    temp = temperature.to(torch.float32).contiguous()
    seed = seeds.to(torch.int64).contiguous()
    check("temperature", temp, torch.float32, (m,))
    check("seeds", seed, torch.int64, (m,))
    h, w = hidden.contiguous(), weight.contiguous()
    for t in (scale, wres, weight_norms):
        check_contiguous("scale, wres and weight_norms", t)
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

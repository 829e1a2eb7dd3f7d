"""GGUF weights run in their blocks (cbgen/cpu/csrc/qgemm.c, cbgen.runtime.cpu_quant): every
kernel path (AVX512-VNNI, AVX2, scalar) gives the bits of a NumPy model of the same arithmetic,
on each build the host runs; a fused layer's parts may each have their own type; a GGUF model
runs quantized by default and dequantized with --dequantize, and the start-up line says which
tensors took which path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.cli import run

from cbgen.cpu import build, quant
from cbgen.engine.engine import Engine
from cbgen.llm import LLM
from cbgen.models.quantized import (
    DequantizingLinear,
    QuantizedEmbedding,
    QuantizedWeight,
    QuantSegment,
)
from cbgen.runtime.cpu import CpuRuntime
from cbgen.runtime.cpu_quant import QuantLinear
from cbgen.sampling_params import SamplingParams

gguf = pytest.importorskip("gguf", reason="the gguf package (a test dependency) is not installed")
pytestmark = pytest.mark.skipif(build.load_library() is None, reason=build.native_status())

NAMES = list(quant.TYPES)
LEGACY = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
SHAPES = [(1, 16, 256), (7, 48, 512), (20, 32, 768), (9, 64, 1536), (17, 16, 256)]
LEGACY_SHAPES = [(1, 16, 32), (7, 48, 96), (17, 16, 64)]


def f16(b: np.ndarray) -> np.ndarray:
    """Two bytes [..., 2] as float16 values -> float32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def file_blocks(name: str, w: np.ndarray) -> torch.Tensor:
    """A weight [n, k] as a GGUF file stores it (uint8 rows): quantized by the gguf package
    where it quantizes the type; the K-quants (it only reads those) as random blocks with
    scales of a trained model's size."""
    qtype = gguf.GGMLQuantizationType[name]
    if name in LEGACY:
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w, qtype)))
    weights, size = quant.BLOCKS[quant.TYPES[name]]
    rng = np.random.default_rng(int(abs(w).sum() * 1000) % 2**32)
    n, blocks = w.shape[0], w.shape[1] // weights
    b = rng.integers(0, 256, (n, blocks, size), dtype=np.uint8)
    scale = (rng.uniform(0.2, 1.0, (n, blocks, 2)) * 0.004).astype(np.float16)
    if name == "Q6_K":
        b[..., 208:210] = scale[..., :1].view(np.uint8)
    else:
        b[..., 0:4] = scale.view(np.uint8).reshape(n, blocks, 4)
    return torch.from_numpy(b.reshape(n, blocks * size))


def decode(name: str, raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A file's blocks as the kernels read them, decoded here from the GGUF block layouts: the
    stored unsigned values u [n, k], each sub-block's float32 scale (d, or d sc_j) and each
    group of 32's min term (m, or dmin m_j; None for types without one)."""
    weights, size = quant.BLOCKS[quant.TYPES[name]]
    n = raw.shape[0]
    b = raw.reshape(n, k // weights, size)
    if name == "Q8_0":
        return b[..., 2:].view(np.int8).astype(np.int32).reshape(n, k) + 128, f16(b[..., :2]), None
    if name in LEGACY:
        two, five = name in ("Q4_1", "Q5_1"), name.startswith("Q5")
        o = 4 if two else 2
        qs = b[..., o + 4 * five :].astype(np.int32)
        lo, hi = qs & 15, qs >> 4
        if five:
            qh = np.ascontiguousarray(b[..., o : o + 4]).view("<u4").astype(np.int64)
            bit = np.arange(16)
            lo = lo | ((qh >> bit) & 1) << 4
            hi = hi | ((qh >> (bit + 16)) & 1) << 4
        u = np.concatenate([lo, hi], -1).reshape(n, k)
        return u, f16(b[..., :2]), (f16(b[..., 2:4]) if two else None)
    d = f16(b[..., 208:210] if name == "Q6_K" else b[..., :2])
    if name == "Q6_K":
        ql, qh = b[..., :128].astype(np.int32), b[..., 128:192].astype(np.int32)
        sc = b[..., 192:208].view(np.int8).astype(np.float32)
        halves = []
        for h in range(2):
            a, c = ql[..., 64 * h : 64 * h + 64], qh[..., 32 * h : 32 * h + 32]
            halves += [
                (a[..., :32] & 15) | (c & 3) << 4,
                (a[..., 32:] & 15) | ((c >> 2) & 3) << 4,
                (a[..., :32] >> 4) | ((c >> 4) & 3) << 4,
                (a[..., 32:] >> 4) | ((c >> 6) & 3) << 4,
            ]
        u = np.concatenate(halves, -1).reshape(n, k)
        return u, (d[..., None] * sc).astype(np.float32).reshape(n, -1), None
    dmin, s = f16(b[..., 2:4]), b[..., 4:16].astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | (s[..., 0:4] >> 6) << 4], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6) << 4], -1)
    qs = b[..., 48:].astype(np.int32) if name == "Q5_K" else b[..., 16:].astype(np.int32)
    qh = b[..., 16:48].astype(np.int32)
    parts = []
    for c in range(4):
        lo, hi = qs[..., 32 * c : 32 * c + 32] & 15, qs[..., 32 * c : 32 * c + 32] >> 4
        if name == "Q5_K":
            lo, hi = lo | ((qh >> 2 * c) & 1) << 4, hi | ((qh >> 2 * c + 1) & 1) << 4
        parts += [lo, hi]
    u = np.concatenate(parts, -1).reshape(n, k)
    scale = (d[..., None] * sc.astype(np.float32)).astype(np.float32).reshape(n, -1)
    return u, scale, (dmin[..., None] * mn.astype(np.float32)).astype(np.float32).reshape(n, -1)


OFFSET = {"Q8_0": 128, "Q4_0": 8, "Q5_0": 16, "Q6_K": 32}


def dequantized(name: str, blocks: torch.Tensor, k: int) -> np.ndarray:
    """The weight the decode describes: scale (u - offset) (+ m, or - dmin m_j)."""
    u, scale, mn = decode(name, blocks.numpy(), k)
    n, sub = u.shape[0], k // scale.shape[1]
    w = np.repeat(scale, sub, 1) * (u - OFFSET.get(name, 0)).astype(np.float32)
    if mn is not None:
        m = np.repeat(mn, 32, 1)
        w = w + m if name in ("Q4_1", "Q5_1") else w - m
    return w.astype(np.float32).reshape(n, k)


def numpy_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x's rows as qgemm.c quantizes them: per block of 32, d = max|x| / 127, q = rint(x / d),
    the block's sum and the sum of its first 16."""
    xb = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.rint((xb * inv[..., None]).astype(np.float32)).astype(np.int32)
    return q, d, q.sum(-1), q[..., :16].sum(-1)


def fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fused multiply-add, a b + c rounded once: the float32 product is exact in
    float64 (24 + 24 bits), and the sum then rounds to float32 as fmaf does but for halfway
    cases of a double rounding, which the float32 sums here do not reach."""
    exact = a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)
    return exact.astype(np.float32)


def numpy_gemm(name: str, blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """qgemm.c's arithmetic in NumPy: exact integer dot products per sub-block, then
    acc = fma(float(isum), scale dx, acc) per sub-block, and acc = fma(+-min, dx sx, acc) per
    group of 32 (m for Q4_1, Q5_1; -(dmin m_j) for Q4_K, Q5_K), in that order."""
    k = x.shape[1]
    q, d, s, low = numpy_q8(x.numpy())
    u, scale, mn = decode(name, blocks.numpy(), k)
    n, kb, sub = u.shape[0], q.shape[1], k // scale.shape[1]
    ub = u.reshape(n, kb, 32)
    off = OFFSET.get(name, 0)
    acc = np.zeros((x.shape[0], n), np.float32)
    for j in range(kb):
        for h in range(32 // sub):
            lo, hi = h * sub, (h + 1) * sub
            xs = s[:, j] if sub == 32 else (low[:, j] if h == 0 else s[:, j] - low[:, j])
            isum = ub[:, j, lo:hi] @ q[:, j, lo:hi].T - off * xs[None, :]
            t = (scale[None, :, j * (32 // sub) + h] * d[:, None, j]).astype(np.float32)
            acc = fma(isum.T.astype(np.float32), t, acc)
        if mn is not None:
            dxs = (d[:, j] * s[:, j].astype(np.float32)).astype(np.float32)
            sign = 1 if name in ("Q4_1", "Q5_1") else -1
            acc = fma(np.broadcast_to(sign * mn[None, :, j], acc.shape), dxs[:, None], acc)
    return torch.from_numpy(acc)


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize(("m", "k"), [(5, 96), (64, 576), (3, 1536)])
def test_activations_are_quantized_as_numpy_rounds_them(m: int, k: int) -> None:
    """Each build's blocks (AVX-512 and AVX2 vectors, 16 and 8 lanes) give the scalar
    rounding's bits: ties to even, saturated ends, zero blocks, a lone large element."""
    rng = np.random.default_rng(m + k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 100, (m, 1))).astype(np.float32)
    x[1, :32] = 0.0  # an all-zero block: scale 0, every q 0
    # a block of scale 1/8 exactly: x / d = 2.5, 3.5 and -2.5, ties that round to even
    x[1, 32:64] = rng.uniform(-1, 1, 32).astype(np.float32)
    x[1, 32:36] = [15.875, 0.3125, 0.4375, -0.3125]
    x[-1, 40] = -1e6  # one element sets the block's scale: the others round to 0
    x[0, k - 1] = 3.0 * np.abs(x[0]).max()  # the last block's last element, negative and positive
    x[0, k - 2] = -x[0, k - 1]
    got = quant.quantize_rows(torch.from_numpy(x))
    assert got is not None
    q, d, s, low = numpy_q8(x)
    assert np.array_equal(got[0].numpy(), q.reshape(m, k))
    assert np.array_equal(got[1].numpy(), d) and np.array_equal(got[2].numpy(), s)
    assert np.array_equal(got[3].numpy(), low)
    assert np.abs(q).max() == 127
    assert got[0][1, 32:36].tolist() == [127, 2, 4, -2]


@pytest.mark.parametrize("name", NAMES)
def test_the_decoded_blocks_are_the_gguf_packages_weights(name: str) -> None:
    """The NumPy model reads each type's blocks as the gguf package dequantizes them."""
    rng = np.random.default_rng(11)
    k = 512
    blocks = file_blocks(name, (rng.standard_normal((16, k)) * 0.1).astype(np.float32))
    want = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[name])
    assert np.array_equal(dequantized(name, blocks, k), want.reshape(16, k).astype(np.float32))


def _case(name: str, m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(m * n + k)
    blocks = file_blocks(name, (rng.standard_normal((n, k)) * 0.1).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    return blocks, x, bias


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize(
    ("name", "m", "n", "k"),
    [(name, *shape) for name in NAMES for shape in SHAPES]
    + [(name, *shape) for name in LEGACY for shape in LEGACY_SHAPES],
)
def test_each_type_gives_the_bits_of_its_numpy_model(name: str, m: int, n: int, k: int) -> None:
    blocks, x, bias = _case(name, m, n, k)
    type_id = quant.TYPES[name]
    packed = quant.pack(type_id, blocks, n, k)
    assert packed is not None
    # the file's bytes (the K-quants' 12 bytes of 6-bit scales and mins as 16 bytes)
    packed_bytes, file_bytes = {"Q4_K": (148, 144), "Q5_K": (180, 176)}.get(name, (1, 1))
    assert packed.numel() * file_bytes == blocks.numel() * packed_bytes
    weight = quant.PackedWeight([(type_id, packed, n)], k)
    want = numpy_gemm(name, blocks, x)
    got, ref = weight.gemm(x), weight.gemm(x, reference=True)
    assert got is not None and ref is not None
    assert torch.equal(ref, want) and torch.equal(got, want), quant.isa()
    with_bias = weight.gemm(x, bias)
    assert with_bias is not None and torch.equal(with_bias, want + bias)
    # close to the float matmul on the dequantized weight (x's 8-bit rounding aside)
    deq = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[name])
    exact = x @ torch.from_numpy(deq.astype(np.float32)).reshape(n, k).T
    assert ((got - exact).norm() / exact.norm()).item() < 0.02


def q2_k_blocks(n: int, k: int, seed: int) -> torch.Tensor:
    """Random Q2_K blocks (a type without a kernel: 84 bytes a 256, d and dmin last)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, k // 256, 84), dtype=np.uint8)
    b[..., 80:84] = (rng.uniform(0.2, 1, (n, k // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))


def test_shapes_and_types_without_a_kernel_are_refused() -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((24, 64)).astype(np.float32)  # 24 rows: not whole panels of 16
    assert quant.pack(quant.TYPES["Q8_0"], file_blocks("Q8_0", w), 24, 64) is None
    q2 = q2_k_blocks(16, 256, 0)
    assert quant.pack(int(gguf.GGMLQuantizationType.Q2_K), q2, 16, 256) is None
    # a K-quant's rows must be whole blocks of 256
    assert not quant.supports(quant.TYPES["Q4_K"], 16, 128)
    with pytest.raises(ValueError, match="blocks: expected uint8"):
        quant.pack(quant.TYPES["Q8_0"], file_blocks("Q8_0", w[:16]), 16, 32)


def test_a_fused_layer_runs_each_part_in_its_own_type() -> None:
    """q, k and v of one qkv projection in three types (as Q4_K_M files mix them): the layer's
    output is each part's, side by side, x quantized once; a part without a kernel (Q2_K
    here) makes the runtime dequantize the layer (and count it)."""
    from cbgen.models.base import Linear
    from cbgen.runtime.cpu_quant import pack_quantized

    rng = np.random.default_rng(3)
    parts = [(name, (rng.standard_normal((r, 256)) * 0.1).astype(np.float32)) for name, r in
             (("Q4_K", 32), ("Q6_K", 16), ("Q4_1", 16), ("Q8_0", 16))]  # fmt: skip
    weight = QuantizedWeight(
        256, [QuantSegment(quant.TYPES[name], file_blocks(name, w)) for name, w in parts]
    )
    method = QuantLinear.pack(weight)
    assert method is not None and method.n == 80
    x = torch.from_numpy(rng.standard_normal((5, 256)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(80).astype(np.float32))
    got = method.apply(x, torch.empty(0), bias)
    want = torch.cat(
        [
            numpy_gemm(name, seg.blocks, x)
            for (name, _), seg in zip(parts, weight.segments, strict=True)
        ],
        dim=1,
    )
    assert torch.equal(got, want + bias)
    # the runtime: the layer gets the method; with a Q2_K part it is dequantized instead
    layers = [Linear(256, 80, bias=False), Linear(256, 256, bias=False)]
    layers[0].method = DequantizingLinear(weight)
    q2 = QuantSegment(int(gguf.GGMLQuantizationType.Q2_K), q2_k_blocks(256, 256, 1))
    layers[1].method = DequantizingLinear(QuantizedWeight(256, [q2]))
    counts = pack_quantized(layers)
    assert isinstance(layers[0].method, QuantLinear)
    assert counts == {"Q4_K": 1, "Q6_K": 1, "Q4_1": 1, "Q8_0": 1, "dequantized Q2_K": 1}
    assert torch.equal(layers[1].weight.data, q2.dequantize())


# ---- a GGUF model end to end ----------------------------------------------------------------

CONFIG = dict(hidden=256, inter=512, layers=2, heads=4, kv_heads=2, vocab=256)


def write_tiny_gguf(path: Path, qtype: str) -> Path:
    """A tiny random Llama in a GGUF file, its linear tensors in qtype, the embedding in Q8_0,
    norms float32; q/k rows interleaved for RoPE as llama.cpp's converter writes them."""
    c = CONFIG
    rng = np.random.default_rng(0)
    head_dim = c["hidden"] // c["heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", c["layers"])
    w.add_uint32("llama.context_length", 512)
    w.add_uint32("llama.embedding_length", c["hidden"])
    w.add_uint32("llama.feed_forward_length", c["inter"])
    w.add_uint32("llama.attention.head_count", c["heads"])
    w.add_uint32("llama.attention.head_count_kv", c["kv_heads"])
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    # a vocabulary transformers can build a tokenizer from (the prompts are token ids)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(c["vocab"] - 3))])
    w.add_token_scores([0.0] * c["vocab"])
    w.add_token_types([2, 3, 3, *([6] * (c["vocab"] - 3))])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def permute(x: np.ndarray, heads: int) -> np.ndarray:
        return x.reshape(heads, 2, -1, x.shape[1]).swapaxes(1, 2).reshape(x.shape)

    def add(name: str, x: np.ndarray, kind: str) -> None:
        if kind == "F32":
            w.add_tensor(name, x.astype(np.float32))
        else:  # the K-quants as random blocks (file_blocks)
            t = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, file_blocks(kind, x.astype(np.float32)).numpy(), raw_dtype=t)

    add("token_embd.weight", rng.standard_normal((c["vocab"], c["hidden"])) * 0.5, "Q8_0")
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(c["hidden"]), "F32")
    kv = c["kv_heads"] * head_dim
    for i in range(c["layers"]):
        shapes = {
            "attn_q": (c["hidden"], c["hidden"]),
            "attn_k": (kv, c["hidden"]),
            "attn_v": (kv, c["hidden"]),
            "attn_output": (c["hidden"], c["hidden"]),
            "ffn_gate": (c["inter"], c["hidden"]),
            "ffn_up": (c["inter"], c["hidden"]),
            "ffn_down": (c["hidden"], c["inter"]),
        }
        for name, shape in shapes.items():
            x = rng.standard_normal(shape) * 0.2
            if name == "attn_q":
                x = permute(x, c["heads"])
            elif name == "attn_k":
                x = permute(x, c["kv_heads"])
            add(f"blk.{i}.{name}.weight", x, qtype)
        add(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(c["hidden"]), "F32")
        add(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(c["hidden"]), "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _engine(path: Path, **options: Any) -> Engine:
    return Engine(
        model=str(path),
        device="cpu",
        kv_cache_memory=8 << 20,
        block_size=4,
        num_threads=1,
        **options,
    )


@pytest.mark.parametrize("qtype", NAMES)
def test_a_gguf_model_runs_in_its_blocks_unless_dequantized(qtype: str, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype)
    quantized, dequantized = _engine(path), _engine(path, dequantize=True)
    model = quantized.model
    assert all(isinstance(layer.method, QuantLinear) for layer in model.linear_layers())
    assert all(layer.weight.numel() == 0 for layer in model.linear_layers())  # no float copy
    assert f"GGUF weights in their blocks ({quant.isa()}): " in quantized.describe()
    assert f"{qtype} x{7 * CONFIG['layers'] + (qtype == 'Q8_0')}" in quantized.describe()
    assert "LM head in its GGUF blocks" in quantized.describe()
    assert "GGUF weights in their blocks" not in dequantized.describe()
    # the embedding (Q8_0) and the tied head: the file's blocks, held once; its rows are the
    # float path's, bit for bit
    embed = model.embed_tokens
    assert isinstance(embed, QuantizedEmbedding) and embed.rows is not None
    assert isinstance(model.head_method, QuantLinear)
    ids = torch.tensor([[0, 5, 255], [17, 3, 3]])
    assert torch.equal(embed(ids), dequantized.model.embed_tokens(ids))
    # resident weights: about the file's tensor bytes (not the 8x of float32 and its copies)
    reader = gguf.GGUFReader(str(path))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    methods = [layer.method for layer in model.linear_layers()] + [model.head_method]
    held = sum(m.packed.nbytes() for m in methods if isinstance(m, QuantLinear))
    held += sum(p.numel() * p.element_size() for p in model.parameters())
    assert held <= 1.15 * file_bytes, (held, file_bytes)
    # teacher-forced top-1 of the two paths of one file: the blocks' arithmetic (x rounded to
    # 8 bits) stays on the dequantized float path's tokens nearly everywhere (the measured
    # distance, against llama.cpp's, is tools/quant_quality.py's)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(3, CONFIG["vocab"], n).tolist() for n in (30, 45, 21, 60, 50)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    top1 = []
    for engine in (quantized, dequantized):
        outs = LLM(engine=engine).generate(seqs, params)
        top1.append(
            [p.top_logprobs[0].token_id for o in outs for p in (o.prompt_logprobs or []) if p]
        )
    agree = sum(a == b for a, b in zip(*top1, strict=True)) / len(top1[0])
    assert agree >= 0.85, f"{qtype}: top-1 agreement with the dequantized path {agree:.3f}"


def test_resuming_with_the_other_choice_is_refused(tmp_path: Path) -> None:
    """A run's rows come from one path: rerunning its output with --dequantize (or without,
    after one with it) is a settings change (exit 5), as any other that changes outputs; the
    summary says which path each tensor type took."""
    model = write_tiny_gguf(tmp_path / "tiny-Q4_0.gguf", "Q4_0")
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(json.dumps({"id": str(i), "prompt": "ab" * (i + 1)}) + "\n" for i in range(3))
    )
    out = tmp_path / "out.parquet"
    args = ["run", str(src), "-o", str(out), "--model", str(model), "--max-tokens", "3",
            "--num-threads", "1", "--kv-cache-memory", str(8 << 20), "--block-size", "4"]  # fmt: skip
    done = run(args)
    assert done.returncode == 0, done.stderr + done.stdout
    (summary_file,) = tmp_path.glob("*.summary.json")
    described = json.loads(summary_file.read_text())["engine_description"]
    assert "GGUF weights in their blocks" in described and "Q4_0 x14" in described
    changed = run([*args, "--dequantize"])
    assert changed.returncode == 5, changed.stderr + changed.stdout
    assert "--dequantize" in changed.stderr


def test_the_one_call_decoder_serves_a_quantized_model_with_the_python_forwards_states(
    tmp_path: Path,
) -> None:
    """Every matmul in its blocks from C (decoder.c, weights 3): the hidden states are the
    layer-by-layer path's, bit for bit, on decodes and prompt chunks alike."""
    path = write_tiny_gguf(tmp_path / "tiny-Q4_K.gguf", "Q4_K")
    engine = _engine(path, max_num_batched_tokens=16)
    runtime = engine.runtime
    assert isinstance(runtime, CpuRuntime) and runtime.decoder is not None
    native, model, backend = runtime.decoder, engine.model, engine.backend
    served: list[int] = []

    def checked(
        input_ids: Any, positions: Any, kv_caches: Any, meta: Any, bf16_dots: bool = False
    ) -> Any:
        got = native(input_ids, positions, kv_caches, meta, bf16_dots)
        if got is not None:
            want = model.forward_layers(input_ids, positions, kv_caches, meta, backend)
            assert torch.equal(got, want)
            served.append(input_ids.shape[0])
        return got

    runtime.decoder = checked  # type: ignore[assignment]
    rng = np.random.default_rng(7)
    seqs = [rng.integers(3, CONFIG["vocab"], n).tolist() for n in (9, 30, 4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = LLM(engine=engine).generate(seqs, params)
    assert all(len(o.output_token_ids) == 8 for o in outs)
    assert len(served) > 5 and max(served) > 1

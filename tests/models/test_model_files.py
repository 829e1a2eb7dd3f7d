"""Broken model files end in one line naming the file and the problem (ModelFileError), never a
traceback: GGUF (fuzzed: every truncation, absurd counts, unknown types), safetensors headers,
config.json and tokenizer files, and `cbgen run` on them in a subprocess.

The GGUF files are written here byte by byte with struct, so these tests need no GGUF writer."""

from __future__ import annotations

import json
import random
import re
import struct
import subprocess
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.cli import cli, cli_env, write_jsonl

from cbgen.models import gguf_file
from cbgen.models.config import ModelConfig
from cbgen.models.errors import ModelFileError
from cbgen.models.gguf_file import GGUFError, GGUFFile
from cbgen.models.loader import iter_safetensors_weights, load_model, load_model_config
from cbgen.models.safetensors_file import check_safetensors
from cbgen.models.source import ModelSource
from cbgen.models.tokenizer import load_tokenizer
from tools.model_shapes import TINY_CHAT_LLAMA

# ---- a GGUF file, byte by byte ---------------------------------------------------------------

U8, U32, F32, BOOL, STRING, ARRAY, U64 = 0, 4, 6, 7, 8, 9, 10
GGML_F32, GGML_F16, GGML_Q8_0 = 0, 1, 8


def s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def array(item_type: int, items: list[bytes]) -> bytes:
    return struct.pack("<IQ", item_type, len(items)) + b"".join(items)


def entry(key: str, vtype: int, value: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + value


def tensor_info(name: str, dims: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


def gguf(
    entries: list[bytes],
    tensors: list[tuple[str, tuple[int, ...], int, bytes]],
    n_tensors: int | None = None,
    n_kv: int | None = None,
    version: int = 3,
    raw_infos: tuple[bytes, ...] = (),
) -> bytes:
    """A GGUF file: metadata entries as bytes, tensors as (name, ggml dims, ggml type, data),
    each tensor's data at a multiple of 32 from the data section's start (also 32-aligned);
    raw_infos: tensor infos as bytes after those, with no data."""
    infos, data = b"", b""
    for name, dims, ggml_type, raw in tensors:
        data += bytes(-len(data) % 32)
        infos += tensor_info(name, dims, ggml_type, len(data))
        data += raw
    infos += b"".join(raw_infos)
    n_tensors = len(tensors) + len(raw_infos) if n_tensors is None else n_tensors
    n_kv = len(entries) if n_kv is None else n_kv
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(entries) + infos
    return head + bytes(-len(head) % 32) + data


F32_DATA = np.arange(8, dtype=np.float32)
F16_DATA = np.arange(8, dtype=np.float16)
Q8_ROW = struct.pack("<e", 0.5) + bytes(range(32))  # one Q8_0 block: a scale and 32 int8


def sample_entries() -> list[bytes]:
    """Every value type: scalars, a string, arrays of numbers, strings and arrays."""
    return [
        entry("general.architecture", STRING, s("llama")),
        entry("llama.block_count", U32, struct.pack("<I", 2)),
        entry("eps", F32, struct.pack("<f", 0.25)),
        entry("flag", BOOL, b"\x01"),
        entry("big", U64, struct.pack("<Q", 2**40)),
        entry("ids", ARRAY, array(U32, [struct.pack("<I", i) for i in (1, 2, 3)])),
        entry("words", ARRAY, array(STRING, [s("a"), s("bc"), s("")])),
        entry("nested", ARRAY, array(ARRAY, [array(U8, [b"\x01", b"\x02"]), array(U8, [b"\x03"])])),
    ]


def sample_tensors() -> list[tuple[str, tuple[int, ...], int, bytes]]:
    return [
        ("f32", (4, 2), GGML_F32, F32_DATA.tobytes()),
        ("f16", (8,), GGML_F16, F16_DATA.tobytes()),
        ("q8", (32, 1), GGML_Q8_0, Q8_ROW),
    ]


def sample() -> bytes:
    return gguf(sample_entries(), sample_tensors())


def write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_the_byte_by_byte_file_reads_back(tmp_path: Path) -> None:
    g = GGUFFile(write(tmp_path / "ok.gguf", sample()))
    assert g.fields == {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "eps": 0.25,
        "flag": True,
        "big": 2**40,
        "ids": [1, 2, 3],
        "words": ["a", "bc", ""],
        "nested": [[1, 2], [3]],
    }
    assert [(t.name, t.shape, t.tensor_type) for t in g.tensors] == [
        ("f32", (4, 2), GGML_F32),
        ("f16", (8,), GGML_F16),
        ("q8", (32, 1), GGML_Q8_0),
    ]
    assert np.array_equal(g.tensors[0].data, F32_DATA.reshape(2, 4))
    assert np.array_equal(g.tensors[1].data, F16_DATA)
    assert g.tensors[2].data.tobytes() == Q8_ROW


@pytest.mark.parametrize("max_array_read", [4096, 2])
def test_every_truncation_raises_only_the_readers_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_array_read: int
) -> None:
    # with max_array_read 2 the 3-item arrays are skipped, not read: the skipping paths are cut too
    monkeypatch.setattr(gguf_file, "_MAX_ARRAY_READ", max_array_read)
    data = sample()
    path = tmp_path / "cut.gguf"
    for cut in range(len(data)):
        path.write_bytes(data[:cut])
        with pytest.raises(GGUFError) as e:
            GGUFFile(str(path))
        assert str(path) in str(e.value) and "truncated" in str(e.value), cut
    fields = GGUFFile(write(path, data)).fields
    assert fields["words"] == (None if max_array_read == 2 else ["a", "bc", ""])
    assert fields["nested"] == [[1, 2], [3]]


def test_random_corruption_raises_only_the_readers_error(tmp_path: Path) -> None:
    """Bytes of the header, metadata and tensor table overwritten at random: the file reads or
    raises GGUFError, nothing else."""
    data = sample()
    table_end = data.index(F32_DATA.tobytes())  # where the tensor data starts
    path = tmp_path / "bad.gguf"
    rng = random.Random(0)
    errors = 0
    for _ in range(600):
        bad = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(table_end)] = rng.choice([0, 1, 0x7F, 0xFF, rng.randrange(256)])
        path.write_bytes(bytes(bad))
        try:
            GGUFFile(str(path))
        except GGUFError:
            errors += 1
    assert errors > 300  # most corruptions are caught, not read as something else


def absurd_files() -> dict[str, tuple[bytes, str]]:
    """A name -> (file, what the error says)."""
    one = [entry("k", U32, struct.pack("<I", 1))]
    return {
        "tensor count": (gguf(one, [], n_tensors=2**63), "counts 9223372036854775808 tensors"),
        "metadata count": (gguf(one, [], n_kv=2**64 - 1), "metadata entries"),
        "key length": (gguf([struct.pack("<Q", 2**63) + b"k"], []), "metadata entry 0 ends at byte"),
        "string length": (gguf([s("k") + struct.pack("<IQ", STRING, 2**63)], []), "'k' ends at byte"),
        "array length": (gguf([entry("k", ARRAY, struct.pack("<IQ", U8, 2**40))], []), "counts 1099511627776 array items"),
        "string array length": (gguf([entry("k", ARRAY, struct.pack("<IQ", STRING, 2**62))], []), "array items"),
        "nested array length": (gguf([entry("k", ARRAY, struct.pack("<IQ", ARRAY, 2**61))], []), "array items"),
        "value type": (gguf([entry("k", 13, b"\x00" * 8)], []), "unknown value type 13"),
        "array item type": (gguf([entry("k", ARRAY, struct.pack("<IQ", 99, 1) + bytes(8))], []), "array of the unknown value type 99"),
        "nesting": (gguf([entry("k", ARRAY, struct.pack("<IQ", ARRAY, 1) * 6 + struct.pack("<IQ", U8, 0))], []), "nested over 4 deep"),
        "n_dims": (gguf(one, [], raw_infos=(tensor_info("t", (1,) * 1000, GGML_F32, 0),)), "1000 dimensions"),
        "dims overflow": (gguf(one, [("t", (2**32, 2**32, 2**32), GGML_F32, bytes(4))]), "runs past the end"),
        "dim past 2**63": (gguf(one, [("t", (2**64 - 1,), GGML_F32, bytes(4))]), "a dimension past 2**63"),
        "zero beside huge dims": (gguf(one, [("t", (0, 2**62, 2**62), GGML_F32, b"")]), "has the shape"),
        "offset": (gguf(one, [], raw_infos=(tensor_info("t", (1,), GGML_F32, 2**64 - 32),)), "runs past the end"),
        "ggml type": (gguf(one, [("t", (1,), 99, bytes(4))]), "unknown ggml type 99"),
        "removed ggml type": (gguf(one, [("t", (32,), 4, bytes(20))]), "unknown ggml type 4"),
        "quantized row": (gguf(one, [("t", (16,), GGML_Q8_0, bytes(34))]), "not a multiple of Q8_0's block of 32"),
        "alignment 0": (gguf([entry("general.alignment", U32, struct.pack("<I", 0))], []), "power of two, got 0"),
        "alignment 3": (gguf([entry("general.alignment", U32, struct.pack("<I", 3))], []), "power of two, got 3"),
        "alignment string": (gguf([entry("general.alignment", STRING, s("32"))], []), "power of two, got '32'"),
        "duplicate key": (gguf([*one, *one], []), "metadata key 'k' appears twice"),
        "duplicate tensor": (gguf(one, [("t", (1,), GGML_F32, bytes(4))] * 2), "a tensor name appears twice"),
        "version 1": (gguf(one, [], version=1), "GGUF version 1 is not supported"),
        "version 4": (gguf(one, [], version=4), "GGUF version 4 is not supported"),
        "magic": (b"GGML" + sample()[4:], "not a GGUF file"),
        "empty": (b"", "truncated"),
    }  # fmt: skip


@pytest.mark.parametrize("case", list(absurd_files()))
def test_absurd_values_raise_one_line_naming_the_file(tmp_path: Path, case: str) -> None:
    data, message = absurd_files()[case]
    path = write(tmp_path / "absurd.gguf", data)
    with pytest.raises(GGUFError) as e:
        GGUFFile(path)
    text = str(e.value)
    assert message in text and path in text and "\n" not in text


def test_absurd_claims_allocate_nothing_like_them(tmp_path: Path) -> None:
    """Reading files that claim 2**40-long arrays and strings allocates no more than a small
    file's worth, in the reader or anywhere it calls."""
    cases = {
        name: absurd_files()[name][0]
        for name in (
            "array length",
            "string array length",
            "string length",
            "tensor count",
            "n_dims",
        )
    }
    cases["long array of huge strings"] = gguf(
        [entry("k", ARRAY, struct.pack("<IQ", STRING, 4096) + struct.pack("<Q", 2**40) * 4096)], []
    )
    for name, data in cases.items():
        path = write(tmp_path / "claims.gguf", data)
        tracemalloc.start()
        try:
            with pytest.raises(GGUFError):
                GGUFFile(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < len(data) + 64 * 1024, (name, peak)


def test_unreadable_gguf_paths(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="cannot read model file"):
        GGUFFile(str(tmp_path))  # a folder


# ---- GGUF metadata -> ModelConfig --------------------------------------------------------------


def llama_entries(**overrides: bytes | None) -> list[bytes]:
    values: dict[str, tuple[int, bytes]] = {
        "general.architecture": (STRING, s("llama")),
        "llama.block_count": (U32, struct.pack("<I", 2)),
        "llama.embedding_length": (U32, struct.pack("<I", 64)),
        "llama.feed_forward_length": (U32, struct.pack("<I", 128)),
        "llama.attention.head_count": (U32, struct.pack("<I", 4)),
        "llama.vocab_size": (U32, struct.pack("<I", 256)),
    }
    out = []
    for key, (vtype, value) in values.items():
        if key in overrides:
            replaced = overrides[key]
            if replaced is None:
                continue
            value = replaced
        out.append(entry(key, vtype, value))
    return out


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({}, None),
        ({"general.architecture": s("gpt2")}, "GGUF architecture 'gpt2' is not supported; cbgen reads"),
        ({"general.architecture": s("phi3")}, "from GGUF files (phi3 runs from its safetensors checkpoint)"),
        ({"llama.block_count": None}, "the metadata has no llama.block_count"),
        ({"llama.attention.head_count": struct.pack("<I", 0)}, "'num_attention_heads' must be a positive integer, got 0"),
        ({"llama.vocab_size": None}, "no llama.vocab_size and no token_embd.weight tensor"),
    ],
)  # fmt: skip
def test_gguf_metadata_errors_name_the_file_and_key(
    tmp_path: Path, overrides: dict[str, bytes | None], message: str | None
) -> None:
    path = write(tmp_path / "meta.gguf", gguf(llama_entries(**overrides), []))
    source = ModelSource("gguf", path, "meta")
    if message is None:
        cfg = load_model_config(source)
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (64, 2, 256)
        return
    with pytest.raises(GGUFError) as e:
        load_model_config(source)
    assert message in str(e.value) and path in str(e.value)


# ---- config.json -----------------------------------------------------------------------------


def config_with(**changes: Any) -> str:
    cfg = {**TINY_CHAT_LLAMA, **changes}
    return json.dumps({k: v for k, v in cfg.items() if v is not ...})


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"model_type": "llama",\n  "hidden_size": 64,,\n}', "is not valid JSON (line 2, column 21: Expecting property name"),
        ("[1, 2]", "must hold a JSON object, not an array"),
        ("", "is not valid JSON (line 1, column 1"),
        (config_with(hidden_size=...), "'hidden_size' is missing"),
        (config_with(hidden_size="64"), "'hidden_size' must be a positive integer, got \"64\""),
        (config_with(num_hidden_layers=0), "'num_hidden_layers' must be a positive integer, got 0"),
        (config_with(vocab_size=256.0), "'vocab_size' must be a positive integer, got 256.0"),
        (config_with(num_key_value_heads=3), "must be a multiple of 'num_key_value_heads' (3)"),
        (config_with(model_type="gpt2"), "model_type 'gpt2' is not supported"),
        (config_with(model_type=...), "model_type None is not supported"),
        (config_with(rms_norm_eps=-1), "'rms_norm_eps' must be a positive number, got -1"),
        (config_with(tie_word_embeddings="false"), "'tie_word_embeddings' must be true or false"),
        (config_with(eos_token_id=[2, "x"]), "'eos_token_id' must be a token id or a list of them"),
        (config_with(bos_token_id=[1]), "'bos_token_id' must be a token id, got [1]"),
        (config_with(rope_scaling=[8.0]), "'rope_scaling' must be an object or null"),
        (config_with(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope scaling 'yarn' is not supported"),
        (config_with(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope scaling 'llama3' needs 'low_freq_factor'"),
    ],
)  # fmt: skip
def test_config_json_errors_name_the_file_and_the_field(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ModelFileError) as e:
        ModelConfig.from_json(path)
    assert str(e.value).startswith(str(path))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_sound_config_json_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        config_with(rope_scaling={"rope_type": "linear", "factor": 2.0}, eos_token_id=[2, 3])
    )
    cfg = ModelConfig.from_json(path)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.eos_token_ids) == (2, 16, [2, 3])
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


# ---- safetensors -------------------------------------------------------------------------------


def safetensors_bytes(header: dict[str, Any], data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


GOOD_HEADER = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}


def with_tensor(**changes: Any) -> dict[str, Any]:
    return {"a": {**GOOD_HEADER["a"], **changes}}


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\x10\x00\x00", "is truncated: it has 3 bytes"),
        (struct.pack("<Q", 2**60) + b"{}", "the header length 1152921504606846976 is over"),
        (struct.pack("<Q", 100) + b"{}", "its header ends at byte 108, the file has 10 bytes"),
        (struct.pack("<Q", 4) + b"nope", "the header is not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "the header is not a JSON object"),
        (safetensors_bytes(with_tensor(dtype="Q4"), bytes(24)), "tensor 'a' has the dtype 'Q4'; cbgen loads F64, F32, F16, BF16"),
        (safetensors_bytes(with_tensor(dtype="I32"), bytes(24)), "the dtype 'I32'"),
        (safetensors_bytes(with_tensor(shape=[2, -3]), bytes(24)), "the shape [2, -3], not a list of sizes"),
        (safetensors_bytes(with_tensor(data_offsets=[24, 0]), bytes(24)), "the data_offsets [24, 0], not [begin, end]"),
        (safetensors_bytes(with_tensor(data_offsets=[0, 2**64]), bytes(24)), "tensor 'a' ends at byte"),
        (safetensors_bytes(GOOD_HEADER, bytes(20)), "is truncated or corrupt: tensor 'a' ends at byte"),
        (safetensors_bytes(with_tensor(shape=[2, 2]), bytes(24)), "its F32 shape [2, 2] needs 16 bytes, its data_offsets cover 24"),
    ],
)  # fmt: skip
def test_safetensors_header_errors_name_the_file(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    with pytest.raises(ModelFileError) as e:
        check_safetensors(path)
    assert message in str(e.value) and str(path) in str(e.value)


def test_every_truncated_safetensors_file_fails_before_loading(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2, 3), "b": torch.zeros(4)}, str(tmp_path / "whole.safetensors"))
    data = (tmp_path / "whole.safetensors").read_bytes()
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"c": torch.ones(1)}, str(folder / "a.safetensors"))  # a sound shard, read first
    for cut in range(len(data)):
        (folder / "b.safetensors").write_bytes(data[:cut])
        with pytest.raises(ModelFileError, match=r"b\.safetensors"):
            next(iter_safetensors_weights(str(folder)))  # before the sound shard's first tensor
    (folder / "b.safetensors").write_bytes(data)
    assert [name for name, _ in iter_safetensors_weights(str(folder))] == ["c", "a", "b"]


def test_the_safetensors_librarys_own_errors_are_wrapped(tmp_path: Path) -> None:
    # sound by our checks, but 4 bytes of the data are not covered by any tensor
    path = tmp_path / "gap.safetensors"
    path.write_bytes(safetensors_bytes(GOOD_HEADER, bytes(28)))
    check_safetensors(path)
    with pytest.raises(
        ModelFileError, match=f"model file {re.escape(str(path))}: .*not fully covered"
    ):
        list(iter_safetensors_weights(str(tmp_path)))


def test_misshapen_or_missing_weights_name_the_model_folder(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(config_with())
    source = ModelSource("hf", str(tmp_path), "tiny")
    cfg = load_model_config(source)
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ModelFileError, match=r"model .*: weight 'embed_tokens.weight' has shape \(3, 3\)"
    ):
        load_model(source, cfg, torch.float32, torch.device("cpu"), 64)
    save_file({"model.norm.weight": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelFileError, match=f"model {re.escape(str(tmp_path))}: missing weights"):
        load_model(source, cfg, torch.float32, torch.device("cpu"), 64)


# ---- tokenizer files -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A four-word tokenizer saved by transformers: tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "file, text, message",
    [
        ("tokenizer.json", "{nope", "tokenizer.json is not valid JSON (line 1, column 2"),
        ("tokenizer.json", "", "tokenizer.json is not valid JSON (line 1, column 1"),
        ("tokenizer.json", '{"model": 3}', "tokenizer.json is not a tokenizer: data did not match"),
        ("tokenizer.json", "[]", "tokenizer.json must hold a JSON object, not an array"),
        ("tokenizer_config.json", "[1]", "tokenizer_config.json must hold a JSON object"),
        ("tokenizer_config.json", '{"a": 1,}', "tokenizer_config.json is not valid JSON"),
    ],
)
def test_broken_tokenizer_files_are_named(
    tmp_path: Path, tokenizer_dir: Path, file: str, text: str, message: str
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    for f in tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    source = ModelSource("hf", str(folder), "model")
    assert load_tokenizer(source)("hi").input_ids == [3]
    (folder / file).write_text(text)
    with pytest.raises(ModelFileError) as e:
        load_tokenizer(source)
    assert message in str(e.value) and str(folder) in str(e.value) and "\n" not in str(e.value)


# ---- the command line --------------------------------------------------------------------------


def test_cbgen_run_on_broken_model_files_says_one_line_and_exits_1(tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(
        gguf(llama_entries(), [("token_embd.weight", (64, 256), GGML_F32, bytes(64 * 256 * 4))])[
            :200
        ]
    )
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(config_with(num_attention_heads="4"))
    cases = [
        (cut, [], f"model file {cut} is truncated or corrupt"),
        (folder, ["--load-format", "dummy"], f"{folder / 'config.json'}: 'num_attention_heads' must be a positive integer"),
    ]  # fmt: skip
    procs = [
        subprocess.Popen(
            cli("run", str(prompts), "-o", str(tmp_path / f"out{i}.parquet"), "--model", str(model),
                "--num-threads", "1", *more),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(),
            stdin=subprocess.DEVNULL,
        )
        for i, (model, more, _) in enumerate(cases)
    ]  # fmt: skip
    for (model, _, message), p in zip(cases, procs, strict=True):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 1, (model, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
        assert "Traceback" not in out + err
    assert not list(tmp_path.glob("out*"))

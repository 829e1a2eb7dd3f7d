"""cbgen's GGUF reader against the gguf package's own reader and writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cbgen.models.gguf_file import GGUFError, GGUFFile

gguf = pytest.importorskip(
    "gguf", reason="the gguf package (an optional test dependency) is not installed"
)


def _write(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("general.name", "tiny ünïcode")
    w.add_bool("flag", True)
    w.add_int64("big", -(2**40))
    w.add_array("short.list", [1, 2, 3])
    w.add_array("short.strings", ["a", "bc", ""])
    w.add_array("long.strings", [f"tok{i}" for i in range(5000)])
    w.add_array("long.ints", list(range(5000)))
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
        w.add_tensor(f"q.{qtype.name}", gguf.quants.quantize(q, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_reads_what_the_gguf_package_reads(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write(path)
    ours, theirs = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    assert ours.fields["llama.block_count"] == 2
    assert ours.fields["general.name"] == "tiny ünïcode"
    assert ours.fields["flag"] is True and ours.fields["big"] == -(2**40)
    assert ours.fields["short.list"] == [1, 2, 3]
    assert ours.fields["short.strings"] == ["a", "bc", ""]
    # long arrays are skipped, and everything after them is still read in place
    assert ours.fields["long.strings"] is None and ours.fields["long.ints"] is None
    header = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the gguf reader's own
    assert set(ours.fields) == set(theirs.fields) - header
    for key, field in theirs.fields.items():
        if key not in header and ours.fields[key] is not None:
            assert ours.fields[key] == pytest.approx(field.contents()), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == int(b.tensor_type)
        assert a.shape == tuple(int(x) for x in b.shape)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
        assert np.array_equal(
            gguf.quants.dequantize(a.data, gguf.GGMLQuantizationType(a.tensor_type)),
            gguf.quants.dequantize(b.data, b.tensor_type),
        )


def test_the_default_model_file_matches_the_gguf_package(smollm2_path: str) -> None:
    ours, theirs = GGUFFile(str(smollm2_path)), gguf.GGUFReader(str(smollm2_path))
    assert len(ours.tensors) == len(theirs.tensors) == 272
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data.shape) == (b.name, int(b.tensor_type), b.data.shape)
        assert np.array_equal(a.data[:2], b.data[:2])
    assert ours.fields["llama.embedding_length"] == 576


def test_rejects_what_is_not_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(str(bad))
    path = tmp_path / "tiny.gguf"
    _write(path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(GGUFError, match="runs past the end"):
        GGUFFile(str(cut))

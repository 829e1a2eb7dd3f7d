"""csrc/cbgen.h, the one declaration of every exported C function, against the ctypes side:
build.SIGNATURES and decoder.py's Structures agree with it, and every way of disagreeing (an
argument's type, an argument left out, a return type, a function on one side only, a struct
field) is caught, naming the function and the argument; the load path refuses such a build
before compiling. The header is parsed, not compiled: only the last test needs a C compiler."""

from __future__ import annotations

import ctypes
import importlib
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from cbgen.cpu import build
from cbgen.cpu.c_header import (
    HeaderError,
    SignatureMismatch,
    check_signatures,
    check_struct,
    parse_header,
)

HEADER_TEXT = build.HEADER.read_text()


def _decoder_module() -> ModuleType:
    """The module of NativeDecoder's ctypes Structures."""
    return importlib.import_module("cbgen.runtime.cpu_decoder")


def _problems(header_text: str, signatures: dict[str, build.Signature]) -> list[str]:
    """The differences check_signatures finds ([] when it passes)."""
    try:
        check_signatures(parse_header(header_text), signatures)
    except SignatureMismatch as e:
        return e.problems
    return []


def _altered(old: str, new: str) -> str:
    """The real header with its one occurrence of old replaced by new."""
    assert HEADER_TEXT.count(old) == 1, old
    return HEADER_TEXT.replace(old, new)


def test_the_signatures_agree_with_the_header() -> None:
    header = parse_header(HEADER_TEXT)
    assert header.functions.keys() == build.SIGNATURES.keys()
    assert build.signature_mismatch() is None
    rope = header.functions["cbgen_rope_f32"]
    assert str(rope.restype) == "void" and len(rope.args) == 8
    assert [str(t) for t, _ in rope.args[4:6]] == ["int64_t", "int64_t *"]


def test_the_decoder_structs_agree_with_the_header() -> None:
    header = parse_header(HEADER_TEXT)
    check_struct(header, "cbgen_layer_f32", _decoder_module()._Layer)
    check_struct(
        header, "cbgen_decoder_f32", _decoder_module()._Decoder
    )  # its layer: POINTER(_Layer)
    from cbgen.cpu.quant import QWeight

    check_struct(header, "cbgen_qweight", QWeight)  # a quantized layer's, for the decoder


@pytest.mark.parametrize(
    ("old", "new", "want"),
    [
        pytest.param(
            "void cbgen_rope_f32(float *x, int64_t row_stride, int64_t T,",
            "void cbgen_rope_f32(float *x, int64_t row_stride, int T,",
            "cbgen_rope_f32 argument 3 (int T): ctypes c_l",  # c_int64 is c_long or c_longlong
            id="an argument's width",
        ),
        pytest.param(
            "int64_t window, float softcap, float *out);",
            "int64_t window, float *out);",
            "cbgen_paged_decode_f32: cbgen.h declares 15 arguments, ctypes 16",
            id="an argument left out",
        ),
        pytest.param(
            "int cbgen_sample_f32(",
            "int64_t cbgen_sample_f32(",
            "cbgen_sample_f32 returns int64_t, ctypes restype c_int, a 4-byte signed integer",
            id="a return type",
        ),
        pytest.param(
            "void cbgen_pack_panels_f32(const float *w, int64_t N, int64_t K, float *wp);",
            "int cbgen_pack_panels_f32(const float *w, int64_t N, int64_t K, float *wp);",
            "cbgen_pack_panels_f32 returns int, ctypes restype None (void)",
            id="void returning a value",
        ),
        pytest.param(
            "float cbgen_exp_sub_sum_f32(float *s, int64_t n, float m);",
            "float cbgen_exp_sub_sum_f32(float *s, int64_t n, double m);",
            "cbgen_exp_sub_sum_f32 argument 3 (double m): ctypes c_float, a 4-byte float",
            id="float for double",
        ),
        pytest.param(
            "int64_t cbgen_head_i16_levels(int64_t K);",
            "int64_t cbgen_head_i16_levels(uint64_t K);",
            "cbgen_head_i16_levels argument 1 (uint64_t K): ctypes c_l",
            id="signedness",
        ),
        pytest.param(
            "int64_t cbgen_decoder_work_f32(const cbgen_decoder_f32 *m, int64_t T, int64_t max_keys);",
            "int64_t cbgen_decoder_work_f32(int64_t m, int64_t T, int64_t max_keys);",
            "cbgen_decoder_work_f32 argument 1 (int64_t m): ctypes c_void_p",
            id="a pointer for an integer",
        ),
        pytest.param(
            "int cbgen_prefill_kernel_preferred(void);",
            "int cbgen_prefill_kernel_preferred(void);\nvoid cbgen_new_kernel(float *x);",
            "cbgen_new_kernel: declared in cbgen.h, but no ctypes signature",
            id="a function without a signature",
        ),
        pytest.param(
            "int cbgen_prefill_kernel_preferred(void);",
            "",
            "cbgen_prefill_kernel_preferred: a ctypes signature, but no declaration in cbgen.h",
            id="a signature without a declaration",
        ),
    ],
)
def test_an_altered_header_is_caught(old: str, new: str, want: str) -> None:
    problems = _problems(_altered(old, new), build.SIGNATURES)
    assert len(problems) == 1 and problems[0].startswith(want), problems


def test_altered_ctypes_signatures_are_caught() -> None:
    signatures = dict(build.SIGNATURES)
    restype, args = signatures["cbgen_small_gemm_f32"]
    # x, M, K, wp, N, bias, blocked_from, y: M as c_int, and y a pointer to double; x a typed
    # float pointer
    altered = [ctypes.POINTER(ctypes.c_float), ctypes.c_int, *args[2:7]]
    signatures["cbgen_small_gemm_f32"] = (restype, [*altered, ctypes.POINTER(ctypes.c_double)])
    signatures["cbgen_head_i16_available"] = (ctypes.c_int, [])  # restype left at the default
    signatures["cbgen_silu_mul_f32"] = (None, args[:3])  # an argument short
    problems = _problems(HEADER_TEXT, signatures)
    assert [p.split(":")[0] for p in problems] == [
        "cbgen_head_i16_available returns int64_t, ctypes restype c_int, a 4-byte signed integer",
        "cbgen_silu_mul_f32",
        "cbgen_small_gemm_f32 argument 2 (int64_t M)",
        "cbgen_small_gemm_f32 argument 8 (float * y)",
    ], problems
    assert "whose pointee: c_double, a 8-byte float" in problems[-1]


def test_an_altered_struct_is_caught() -> None:
    header = parse_header(HEADER_TEXT)
    fields = list(_decoder_module()._Decoder._fields_)
    eps = fields.index(("eps", ctypes.c_float))

    def structure(fields: list[tuple[str, type]]) -> type[ctypes.Structure]:
        return type("Altered", (ctypes.Structure,), {"_fields_": fields})

    as_double = structure([*fields[:eps], ("eps", ctypes.c_double), *fields[eps + 1 :]])
    with pytest.raises(SignatureMismatch, match=r"cbgen_decoder_f32\.eps \(float\)"):
        check_struct(header, "cbgen_decoder_f32", as_double)
    swapped = structure([fields[1], fields[0], *fields[2:]])
    with pytest.raises(SignatureMismatch, match="cbgen_decoder_f32's fields are"):
        check_struct(header, "cbgen_decoder_f32", swapped)
    # a layer struct that lost its last field, reached through the decoder's layer pointer
    short_layer = structure(list(_decoder_module()._Layer._fields_)[:-1])
    pointing = structure([*fields[:-1], ("layer", ctypes.POINTER(short_layer))])
    with pytest.raises(SignatureMismatch, match=r"cbgen_decoder_f32\.layer .*cbgen_layer_f32's"):
        check_struct(header, "cbgen_decoder_f32", pointing)


@pytest.mark.parametrize(
    "text",
    [
        "long cbgen_x(void);",  # a type outside the table
        "unsigned int cbgen_x(void);",
        "static inline int cbgen_x(int a) { return a; }",
        "typedef struct { float a[4]; } s;",
        "int cbgen_x(int (*f)(int));",
        "int cbgen_x(void);\nint cbgen_x(void);",  # declared twice
        "int cbgen_x();",  # no parameter list: (void) is spelled out
    ],
)
def test_the_parser_refuses_what_it_cannot_read(text: str) -> None:
    """Nothing the parser does not understand is skipped: it would go unchecked."""
    with pytest.raises(HeaderError):
        parse_header(text)


def test_the_load_path_refuses_a_mismatch_before_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    altered = tmp_path / "cbgen.h"
    altered.write_text(
        _altered(
            "cbgen_rope_f32(float *x, int64_t row_stride, int64_t T,",
            "cbgen_rope_f32(float *x, int64_t row_stride, int T,",
        )
    )
    monkeypatch.setattr(build, "HEADER", altered)
    # a compiler that cannot run: the check comes first, so it is never asked
    monkeypatch.setattr(build, "find_compiler", lambda: str(tmp_path / "no-such-cc"))
    got = build.build_library(tmp_path / "cache")
    assert got.library is None and got.path is None
    assert got.reason.startswith(
        "ctypes signatures disagree with cbgen.h: cbgen_rope_f32 argument 3"
    )
    assert "\n" not in got.status()
    assert not (tmp_path / "cache").exists()


def test_every_source_includes_the_header_and_declares_nothing_itself() -> None:
    prototype = re.compile(r"^\w[\w\s*]*\bcbgen_\w+\s*\([^;{]*\)\s*;", re.M)
    for source in build._SRCS:
        text = source.read_text()
        assert '#include "cbgen.h"' in text, source.name
        assert prototype.findall(text) == [], source.name


def test_the_cache_key_covers_every_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A header edit must rebuild: every .h in csrc is part of what the key hashes."""
    assert set(build._HEADERS) == set(build.HEADER.parent.glob("*.h")) >= {build.HEADER}
    flags = tuple(build._FLAGS)
    before = build.build_payload(flags)
    copies = [Path(shutil.copy(h, tmp_path)) for h in build._HEADERS]
    monkeypatch.setattr(build, "_HEADERS", copies)
    assert build.build_payload(flags) == before
    (tmp_path / "cbgen.h").write_text(HEADER_TEXT + "/* edited */\n")
    assert build.build_payload(flags) != before


def test_the_compiler_holds_definitions_to_the_header(tmp_path: Path) -> None:
    """A definition that disagrees with its declaration, or an exported function cbgen.h does
    not declare, does not compile with the build's flags."""
    cc = build.find_compiler()
    if cc is None:
        pytest.skip("no C compiler: the definitions are checked by compiling them")
    cases = {
        "int cbgen_sample_f32(void) { return 0; }": "conflicting types",
        "int64_t cbgen_undeclared(void) { return 0; }": "missing-prototypes",
    }
    for body, want in cases.items():
        source = tmp_path / "x.c"
        source.write_text(f'#include "cbgen.h"\n{body}\n')
        done = subprocess.run(
            [cc, *build._FLAGS, "-I", str(build.HEADER.parent), "-fsyntax-only", str(source)],
            capture_output=True,
            text=True,
        )
        assert done.returncode != 0 and want in done.stderr, (body, done.stderr)

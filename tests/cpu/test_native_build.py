"""The C kernels must build wherever there is a C compiler: every test of them is skipped when
build.load_library() gives None, so a source that stops compiling would otherwise pass CI
silently while the engine falls back to its slower torch paths."""

from __future__ import annotations

import ctypes
import platform
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.reference import attention_float64

from cbgen.cpu import build, kernels
from cbgen.cpu.features import cpu_info, isa_refusal

PORTABLE_FLAGS = tuple(f for f in build._FLAGS if f != "-march=native")
"""The build's flags without -march=native, whose macros are whatever the host has."""

VARIANTS = {
    # id: (the target, named in full, and exactly the ISA macros of build._ISA_MACROS it defines)
    "avx512-bf16": (
        ("-march=skylake-avx512", "-mavx512bf16"),
        {"__AVX512F__", "__AVX512BF16__", "__AVX2__", "__FMA__"},
    ),
    "avx512": (("-march=skylake-avx512",), {"__AVX512F__", "__AVX2__", "__FMA__"}),
    "avx2": (("-march=haswell",), {"__AVX2__", "__FMA__"}),
}


@pytest.mark.skipif(build.find_compiler() is None, reason="no C compiler")
def test_every_kernel_source_compiles_and_the_library_loads(tmp_path: Path) -> None:
    cc = build.find_compiler()
    assert cc is not None
    for source, flags in build._SRCS.items():
        done = subprocess.run(
            [cc, *build._FLAGS, *flags, "-c", str(source), "-o", str(tmp_path / "x.o")],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"{source.name} does not compile:\n{done.stderr}"
    assert build.load_library() is not None


def _isa_macros(cc: str, flags: tuple[str, ...]) -> set[str]:
    """Which of the ISA macros the kernels' paths and the status line look at cc defines."""
    macros = build.probe_target(cc, flags).macros
    return {m for m, _ in build._ISA_MACROS if m in macros}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
@pytest.mark.skipif(build.find_compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_kernels_avx512_and_avx2_paths_compile_and_link_on_any_x86_compiler(
    variant: str, tmp_path: Path
) -> None:
    """The kernels keep one code path per ISA (the prefill tiles, small_gemm's tiles and row
    blocks, the decode attention's scores, the bf16 and int16 heads): each must keep compiling,
    and the library linking with nothing left undefined, whatever the host's own build takes.
    Each variant names its target in full (an Ice Lake server's AVX-512 without BF16, a Cooper
    Lake's with it, a Haswell's AVX2), never -march=native, so the same macros on every host.
    Nothing is run."""
    assert "-march=native" in build._FLAGS  # what PORTABLE_FLAGS takes out
    isa, want = VARIANTS[variant]
    cc = build.find_compiler()
    assert cc is not None
    assert _isa_macros(cc, (*PORTABLE_FLAGS, *isa)) == want
    objs = []
    for i, (source, source_flags) in enumerate(build._SRCS.items()):
        objs.append(str(tmp_path / f"{i}.o"))
        done = subprocess.run(
            [cc, *PORTABLE_FLAGS, *source_flags, *isa, "-c", str(source), "-o", objs[-1]],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"{source.name} with {' '.join(isa)}:\n{done.stderr}"
    lib = str(tmp_path / "lib.so")
    done = subprocess.run(
        [cc, "-shared", "-fopenmp", "-Wl,--no-undefined", *objs, "-o", lib, "-lm"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
@pytest.mark.skipif(build.find_compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_the_isa_settings_flags_take_the_native_build_down_to_that_isa(isa: str) -> None:
    """What CBGEN_CPU_ISA=<isa> adds after -march=native leaves no macro above that ISA on any
    host (only the preprocessor runs: this holds on hosts without the ISA too)."""
    cc = build.find_compiler()
    assert cc is not None
    info = cpu_info()
    got = _isa_macros(cc, (*build._FLAGS, *build.isa_flags(isa, info)))
    assert not got & {"__AVX512BF16__", "__AMX_BF16__"}
    assert ("__AVX512F__" in got) is (isa == "avx512" and info.avx512)


@pytest.fixture(scope="module", params=["native", "avx512", "avx2"])
def prefill_build(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> ctypes.CDLL:
    """The kernels as -march=native builds them, and as CBGEN_CPU_ISA=avx512 (no bf16 dot
    products) and avx2 build them (the tiles those CPUs get), where this CPU runs them."""
    if build.find_compiler() is None:
        pytest.skip("no C compiler")
    if request.param == "native":
        lib = build.load_library()
        if lib is None:
            pytest.skip(build.native_status())
        return lib
    info = cpu_info()
    refused = isa_refusal(request.param, info)
    if refused is not None:
        pytest.skip(refused)
    flags = build.isa_flags(request.param, info)
    made = build.build_library(tmp_path_factory.mktemp(f"kernels-{request.param}"), flags)
    assert made.library is not None, made.status()
    return made.library


@pytest.mark.parametrize(
    ("qlen", "ctx", "heads", "kv_heads", "d", "window", "cap"),
    [
        (1, 0, 9, 3, 64, None, None),  # one row, one key
        (7, 0, 9, 3, 64, None, None),  # fewer rows than a register tile
        (37, 16, 9, 3, 64, None, None),  # rows not a multiple of a work item, GQA 3:1
        (50, 100, 9, 3, 128, None, None),  # D = 128 after cached context
        (70, 30, 4, 4, 64, 20, None),  # no GQA (a work item of one head), a window
        (45, 90, 9, 3, 64, 33, 5.0),  # window, cap and context together
        (20, 44, 8, 4, 64, None, 50.0),  # Gemma 2's cap: most scores / cap near 0
        (40, 60, 6, 2, 128, 1, None),  # a window of one key: each row sees itself
        (33, 40, 8, 1, 64, 500, 2.0),  # a window wider than the sequence, GQA 8:1
        (9, 5, 26, 1, 64, None, None),  # a group wider than a work item: split
    ],
)
def test_prefill_kernel_matches_a_float64_softmax(
    prefill_build: ctypes.CDLL,
    monkeypatch: pytest.MonkeyPatch,
    qlen: int,
    ctx: int,
    heads: int,
    kv_heads: int,
    d: int,
    window: int | None,
    cap: float | None,
) -> None:
    monkeypatch.setattr(build, "load_library", lambda extra_flags=(): prefill_build)
    torch.manual_seed(qlen * 7 + ctx)
    q = torch.randn(qlen, heads, d) * 2
    k, v = torch.randn(ctx + qlen, kv_heads, d), torch.randn(ctx + qlen, kv_heads, d)
    got = kernels.prefill_attention_f32(q, k, v, d**-0.5, window, cap)
    assert got is not None
    want = attention_float64(q, k, v, d**-0.5, window, cap)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)

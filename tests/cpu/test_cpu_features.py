"""CPU flags, read from the OS and injected: the fast paths follow what the CPU really has,
never a check that is also true where a feature is only emulated."""

from __future__ import annotations

from pathlib import Path

import pytest

from cbgen.cpu import features
from cbgen.cpu.features import (
    CpuInfo,
    cpu_info,
    parse_cpuinfo,
    read_caches,
    read_cpu_info,
)

XEON_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz
flags\t\t: fpu sse2 avx fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni
cache size\t: 55296 KB

processor\t: 1
model name\t: another line that must not win
flags\t\t: fpu
"""

ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes crc32 atomics fphp asimdhp cpuid asimdrdm sve bf16 i8mm
CPU implementer\t: 0x41
"""


def make_cpu(*flags: str) -> CpuInfo:
    return CpuInfo("test CPU", "x86_64", frozenset(flags))


@pytest.mark.parametrize(
    ("flags", "bf16"),
    [
        (("avx512f", "avx512bw", "avx512_vnni", "avx2", "fma"), False),  # bf16 only emulated
        (("avx2", "fma"), False),
        ((), False),
        (("avx512f", "avx512bw", "avx512_bf16", "avx2", "fma"), True),
        (("amx_bf16", "amx_tile", "avx512f", "avx2", "fma"), True),
    ],
)
def test_bf16_dot_products_only_with_avx512_bf16_or_amx(flags: tuple[str, ...], bf16: bool) -> None:
    assert make_cpu(*flags).bf16_dot is bf16


@pytest.mark.parametrize(
    ("flags", "fast"),
    [
        (("avx512f", "avx512bw", "avx512_vnni"), False),
        (("avx512f", "avx512_bf16"), True),
        (("amx_bf16", "amx_tile"), True),
    ],
)
def test_the_bf16_head_is_chosen_from_the_cpu_flags_not_onednns_check(
    monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...], fast: bool
) -> None:
    """oneDNN says yes on every AVX-512 CPU (it emulates bf16 there): the flags decide."""
    from cbgen.cpu import linear

    monkeypatch.setattr(linear, "bf16_matmul_supported", lambda: True)
    monkeypatch.setattr(linear, "kernel_cpu", lambda: make_cpu(*flags))
    assert linear.bf16_matmul_fast() is fast
    monkeypatch.setattr(linear, "bf16_matmul_supported", lambda: False)
    assert linear.bf16_matmul_fast() is False  # and never where oneDNN cannot run it at all


SAPPHIRE_RAPIDS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_bf16",
                   "amx_tile", "amx_int8", "avx_vnni")  # fmt: skip


@pytest.mark.parametrize(
    ("isa", "kept"),
    [
        ("native", set(SAPPHIRE_RAPIDS)),
        ("avx512", {"avx2", "fma", "avx512f", "avx512bw", "avx512_fp16", "avx_vnni"}),
        ("avx2", {"avx2", "fma", "avx_vnni"}),
    ],
)
def test_a_lower_isa_takes_away_the_flags_above_it(isa: str, kept: set[str]) -> None:
    """CBGEN_CPU_ISA=avx512 on a Sapphire Rapids: no bf16 dot products (AVX-512 BF16 nor AMX),
    so the paths decided by flags take those of an Ice Lake; avx2: no AVX-512 at all."""
    cpu = make_cpu(*SAPPHIRE_RAPIDS)
    assert cpu.has_isa(isa)
    limited = cpu.limited_to(isa)
    assert limited.flags == kept
    assert limited.bf16_dot is (isa == "native") and limited.avx512 is (isa != "avx2")


def test_the_isa_setting_is_refused_where_the_cpu_lacks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from cbgen.cpu import features

    zen3, arm = make_cpu("avx2", "fma"), CpuInfo("arm", "aarch64", frozenset({"asimd", "bf16"}))
    assert (
        features.isa_refusal("avx2", zen3) is None and features.isa_refusal("native", arm) is None
    )
    assert features.isa_refusal("avx512", zen3) == (
        "CBGEN_CPU_ISA=avx512 asks for AVX-512 (avx512f), which this CPU does not have"
    )
    assert features.isa_refusal("avx2", arm) == (
        "CBGEN_CPU_ISA=avx2 asks for AVX2 and FMA, which this CPU does not have"
    )
    assert features.isa_refusal("avx-512", zen3) == (
        "CBGEN_CPU_ISA=avx-512 is not one of native, avx512, avx2"
    )
    monkeypatch.setattr(features, "cpu_info", lambda: make_cpu(*SAPPHIRE_RAPIDS))
    monkeypatch.delenv("CBGEN_CPU_ISA", raising=False)
    assert features.isa_setting() == "native" and features.kernel_cpu().bf16_dot
    monkeypatch.setenv("CBGEN_CPU_ISA", " AVX512 ")
    assert features.isa_setting() == "avx512" and not features.kernel_cpu().bf16_dot
    monkeypatch.setattr(features, "cpu_info", lambda: zen3)
    assert features.kernel_cpu() == zen3  # refused: the CPU as it is (and no kernels)


def test_parse_cpuinfo_takes_the_first_processor() -> None:
    model, flags = parse_cpuinfo(XEON_CPUINFO)
    assert model == "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"
    assert {"avx512f", "avx512_vnni", "avx2", "fma"} <= flags and "avx512_bf16" not in flags
    assert "fpu" in flags and len(flags) == 10
    model, flags = parse_cpuinfo(ARM_CPUINFO)
    assert model == "" and {"asimd", "sve", "bf16"} <= flags


def _sysfs_cache(root: Path, entries: list[tuple[str, str, str]]) -> Path:
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(level + "\n")
        (d / "type").write_text(kind + "\n")
        (d / "size").write_text(size + "\n")
    return root


def test_cpu_info_from_os_files(tmp_path: Path) -> None:
    caches = _sysfs_cache(
        tmp_path / "cache",
        [
            ("1", "Data", "48K"),
            ("1", "Instruction", "32K"),
            ("2", "Unified", "2048K"),
            ("3", "Unified", "32M"),
        ],
    )
    (tmp_path / "cpuinfo").write_text(XEON_CPUINFO)
    info = read_cpu_info(tmp_path / "cpuinfo", caches, machine="x86_64")
    assert info.caches == (("L1d", 48 << 10), ("L2", 2 << 20), ("L3", 32 << 20))
    assert info.cache_bytes("L2") == 2 << 20 and info.cache_bytes("L4") is None
    assert info.avx512 and info.avx2 and not info.bf16_dot
    assert info.describe() == (
        "CPU Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz (x86_64): avx512f avx2 fma, "
        "L1d 48 KiB, L2 2 MiB, L3 32 MiB"
    )


def test_cpu_info_without_os_files_keeps_every_fast_path_off(tmp_path: Path) -> None:
    """Another OS (or a sandbox without /proc): no flags, so no check can be true."""
    info = read_cpu_info(tmp_path / "missing", tmp_path / "missing-cache", machine="arm64")
    assert info.flags == frozenset() and info.caches == ()
    assert not (info.bf16_dot or info.avx512 or info.avx2)
    assert info.model and "no AVX2 or AVX-512" in info.describe()
    # a cache folder with an unreadable entry still gives the others
    caches = _sysfs_cache(tmp_path / "c", [("1", "Data", "32K"), ("2", "Unified", "1024K")])
    (caches / "index0" / "size").unlink()
    assert read_caches(caches) == (("L2", 1 << 20),)


def test_this_cpu_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The OS files are read on the first call; later calls answer from what it read."""
    reads: list[None] = []
    real = features.read_cpu_info

    def counted(*args: object, **kwargs: object) -> CpuInfo:
        reads.append(None)
        return real(*args, **kwargs)

    monkeypatch.setattr(features, "read_cpu_info", counted)
    features.cpu_info.cache_clear()
    try:
        first = cpu_info()
        assert [cpu_info(), cpu_info()] == [first, first] and len(reads) == 1
    finally:
        features.cpu_info.cache_clear()  # the next caller reads the real files again
    assert first.describe().startswith("CPU ")

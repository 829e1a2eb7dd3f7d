"""What this CPU really has, read once from the OS: its model, the instruction-set flags that
decide the fast paths, and its cache sizes.

Every CPU fast path is decided from these flags, never from a library's "supported" check that
is also true where the feature is only emulated: oneDNN reports bfloat16 matmuls on any
AVX-512 CPU, but without AVX512_BF16 or AMX-BF16 it converts every operand to float32 and a
bf16 matmul is about 3x slower than the float32 one.

Linux exposes the flags in /proc/cpuinfo ("flags" on x86, "Features" on arm64) and the caches
under /sys/devices/system/cpu/cpu0/cache; elsewhere the flags are empty and every check is
False, which keeps the plain float32 paths. No torch import here.

CBGEN_CPU_ISA=avx512 or avx2 runs this machine as a CPU of a lower ISA would run: the kernels are
built for it (cbgen.cpu.build) and the paths decided by flags (the bf16 head) see only the flags
that ISA has (kernel_cpu()). The tests use it to run every path a machine can execute; a user
can use it to step around a path that misbehaves. It is refused where the CPU lacks the ISA.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
CACHE_ROOT = Path("/sys/devices/system/cpu/cpu0/cache")

ISA_SETTING = "CBGEN_CPU_ISA"
ISAS = ("native", "avx512", "avx2")
"""What CBGEN_CPU_ISA may name: this CPU's own ISA (the default), AVX-512 without bf16 dot
products (Skylake-X to Ice Lake servers), AVX2 with FMA (Haswell to Zen 3)."""

_ABOVE = {
    "native": (),
    "avx512": ("avx512_bf16", "amx_"),
    "avx2": ("avx512", "amx_"),
}
"""Per ISA, the prefixes of the flags a CPU of that ISA lacks (the AMX units come after
AVX-512 BF16 and have bf16 dot products too)."""

SHOWN_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "avx2", "fma", "asimd", "sve", "bf16")
"""The flags describe() names when present: those some fast path is decided by."""


@dataclass(frozen=True)
class CpuInfo:
    """One CPU's model, flags and per-core cache sizes (as the OS names them: "avx512_bf16",
    not the compiler's "avx512bf16")."""

    model: str
    machine: str
    """platform.machine(): x86_64, aarch64, arm64, ..."""
    flags: frozenset[str]
    caches: tuple[tuple[str, int], ...] = ()
    """(name, bytes) of the data and unified caches cpu0 sees: L1d, L2, L3."""

    @property
    def bf16_dot(self) -> bool:
        """bfloat16 dot products in hardware (x86: AVX512_BF16 or AMX-BF16), so a bf16 matmul
        runs at about twice the float32 rate instead of being emulated."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags and "fma" in self.flags

    def has_isa(self, isa: str) -> bool:
        """This CPU runs what a build for `isa` (one of ISAS) runs."""
        return (
            isa == "native"
            or (isa == "avx512" and self.avx512 and self.avx2)
            or (isa == "avx2" and self.avx2)
        )

    def limited_to(self, isa: str) -> CpuInfo:
        """This CPU as one of ISA `isa` sees it: the flags above that ISA taken away."""
        kept = frozenset(f for f in self.flags if not f.startswith(_ABOVE[isa]))
        return CpuInfo(self.model, self.machine, kept, self.caches)

    def cache_bytes(self, name: str) -> int | None:
        """Size of cache `name` ("L1d", "L2", "L3"), None when the OS does not say."""
        return next((size for n, size in self.caches if n == name), None)

    def describe(self) -> str:
        """One line for the start-up description and the run summary."""
        shown = [f for f in SHOWN_FLAGS if f in self.flags]
        parts = [" ".join(shown) if shown else "no AVX2 or AVX-512"]
        parts += [f"{name} {_size_text(size)}" for name, size in self.caches]
        return f"CPU {self.model} ({self.machine}): {', '.join(parts)}"


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo text; ("", {}) for fields
    it does not have."""
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if not sep:
            continue
        if key in ("model name", "Model Name") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def read_caches(root: Path) -> tuple[tuple[str, int], ...]:
    """The data and unified caches under a sysfs cache folder (index0, index1, ...), by level;
    () when there is no such folder."""
    found: dict[str, int] = {}
    for entry in sorted(root.glob("index*")):
        try:
            level, kind, size = ((entry / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        nbytes = _parse_size(size)
        if kind != "Instruction" and nbytes is not None:
            found.setdefault(f"L{level}d" if kind == "Data" else f"L{level}", nbytes)
    return tuple(sorted(found.items()))


def read_cpu_info(
    cpuinfo: Path = CPUINFO, cache_root: Path = CACHE_ROOT, machine: str | None = None
) -> CpuInfo:
    """This machine's CpuInfo from the given OS files (missing files give empty fields)."""
    try:
        model, flags = parse_cpuinfo(cpuinfo.read_text(errors="replace"))
    except OSError:
        model, flags = "", frozenset()
    machine = machine or platform.machine() or "unknown"
    return CpuInfo(
        model or platform.processor() or "unknown", machine, flags, read_caches(cache_root)
    )


@cache
def cpu_info() -> CpuInfo:
    """This CPU, read once per process."""
    return read_cpu_info()


def isa_setting() -> str:
    """What CBGEN_CPU_ISA asks for, in lower case: "native" when it is unset or empty."""
    return os.environ.get(ISA_SETTING, "").strip().lower() or "native"


def isa_refusal(isa: str, info: CpuInfo) -> str | None:
    """Why the kernels cannot be built for `isa` on the CPU `info`, None when they can."""
    if isa not in ISAS:
        return f"{ISA_SETTING}={isa} is not one of {', '.join(ISAS)}"
    if not info.has_isa(isa):
        lacks = "AVX-512 (avx512f)" if isa == "avx512" else "AVX2 and FMA"
        return f"{ISA_SETTING}={isa} asks for {lacks}, which this CPU does not have"
    return None


def kernel_cpu() -> CpuInfo:
    """This CPU as the kernels and the paths decided by flags take it: cpu_info() limited to
    the ISA CBGEN_CPU_ISA names (all of it unless set; as it is where the setting is refused,
    as the kernels then are not built at all)."""
    info, isa = cpu_info(), isa_setting()
    return info if isa_refusal(isa, info) is not None else info.limited_to(isa)


def _parse_size(text: str) -> int | None:
    """sysfs cache sizes: "48K", "1024K", "32M", or plain bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = units.get(text[-1:].upper(), 1)
    digits = text[:-1] if text[-1:].upper() in units else text
    return int(digits) * scale if digits.isdigit() else None


def _size_text(size: int) -> str:
    if size >= 1 << 20 and size % (1 << 20) == 0:
        return f"{size >> 20} MiB"
    return f"{size >> 10} KiB" if size % (1 << 10) == 0 else f"{size} B"

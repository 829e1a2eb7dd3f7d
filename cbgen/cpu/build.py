"""Build and load the CPU kernels: compiled on first use with the system C compiler and loaded with
ctypes (no torch headers, so a build takes a few seconds). When no compiler is available, or the
build fails, the torch backend falls back to its pure-torch path; results agree to float32
rounding, and greedy tokens are the same.

The library is built with -march=native, so it is only valid on CPUs with the ISA it was built
for. A home folder shared by nodes of several CPU generations must never hand an AVX-512 build
to an AVX2 node (SIGILL), so the cache key is what the code was built for:

    key = sha256(sources, headers, flags, compiler path, `cc --version`, the macros
                 `cc <flags> -E -dM` predefines: __AVX512F__, __AVX512BF16__, __AVX2__, __FMA__,
                 __znver4__, ...)

    <cache>/cbgen_cpu_<key>.so      the library
    <cache>/build-<key>.log         the compiler's command and stderr, when the build failed

CBGEN_CPU_ISA=avx512 or avx2 builds for a lower ISA than this CPU's (-mno-avx512bf16 or
-mno-avx512f after -march=native, so the tuning for the CPU stays): its flags are in the key,
and it is refused, with no library and the reason in the status line, where the CPU lacks it.

Every exported C function is declared once, in csrc/cbgen.h; SIGNATURES gives ctypes the same
signatures, and no build is compiled or loaded while cbgen.cpu.c_header finds them different.
The Python side of each kernel is cbgen.cpu.kernels, gemm or head_kernels (the argument checks
they share: cbgen.cpu.checks).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from cbgen.cpu.c_header import (
    HeaderError,
    Signature,
    SignatureMismatch,
    check_signatures,
    parse_header,
)
from cbgen.cpu.features import ISA_SETTING, CpuInfo, cpu_info, isa_refusal, isa_setting
from cbgen.phases import BUILD, phase

logger = logging.getLogger("cbgen")

_CSRC = Path(__file__).parent / "csrc"
# Each source with its contraction rule: attention, the greedy head's float32 recompute and
# the decode matmul are free to use FMA (they only have to agree with the reference to float32
# rounding); the fused element-wise ops must round exactly like the torch ops they replace.
_SRCS = {
    _CSRC / "paged_decode.c": ("-ffp-contract=fast",),
    # finite math lets the bound's max reductions vectorise; the source checks the logits',
    # the hidden state's and the bounds' exponent bits for inf/NaN itself
    _CSRC / "bf16_head.c": ("-ffp-contract=fast", "-ffinite-math-only"),
    _CSRC / "int16_head.c": ("-ffp-contract=fast", "-ffinite-math-only"),
    _CSRC / "small_gemm.c": ("-ffp-contract=fast",),
    # widen's sums are small_gemm's, FMA for FMA: -ffast-math must not reassociate a k pair
    _CSRC / "small_gemm_bf16.c": ("-ffp-contract=fast", "-fno-associative-math"),
    # every float operation as written (x's scales divided, not multiplied by a reciprocal; no
    # fused multiply-adds), so NumPy's reference gives the same bits
    _CSRC / "qgemm.c": ("-fno-fast-math", "-ffp-contract=off"),
    _CSRC / "prefill_attention.c": ("-ffp-contract=fast",),
    _CSRC / "fused_ops.c": ("-ffp-contract=off",),
    # SiLU with vexp.h's exp: agrees with torch's to a few ulp, like the attention's softmax
    _CSRC / "activation.c": ("-ffp-contract=fast",),
    # temperature sampling: divides by the temperature as torch does (no reciprocal)
    _CSRC / "sample.c": ("-ffp-contract=off", "-fno-reciprocal-math"),
    # a decode step's layers in one call: it only calls the kernels above
    _CSRC / "decoder.c": ("-ffp-contract=off",),
}
HEADER = _CSRC / "cbgen.h"
"""Every function the library exports, declared once: the C files include it, and
signature_mismatch holds SIGNATURES to it."""
# every header in csrc, found rather than listed, so that a header added there is in the cache
# key without anyone remembering to name it here
_HEADERS = sorted(_CSRC.glob("*.h"))
# -Werror=missing-prototypes: a function exported without a declaration in cbgen.h (which every
# source includes) fails the build, so the header stays the whole list of exports
_FLAGS = [
    "-O3",
    "-march=native",
    "-ffast-math",
    "-fno-finite-math-only",
    "-fopenmp",
    "-fPIC",
    "-Werror=missing-prototypes",
]

_ISA_FLAGS = {
    "native": (),
    # AVX-512 without its bf16 dot products: what Skylake-X to Ice Lake servers build
    "avx512": ("-mno-avx512bf16",),
    # every AVX-512 extension depends on avx512f: all of them go with it
    "avx2": ("-mno-avx512f",),
}
"""The flags, after _FLAGS, of a build for each of features.ISAS."""


# (predefined macro, name shown) of the ISA extensions the kernels' speed depends on
_ISA_MACROS = (
    ("__AVX512F__", "avx512f"),
    ("__AVX512BF16__", "avx512bf16"),
    ("__AMX_BF16__", "amx-bf16"),
    ("__AVX2__", "avx2"),
    ("__FMA__", "fma"),
    ("__ARM_NEON", "neon"),
    ("__ARM_FEATURE_SVE", "sve"),
    ("__ARM_FEATURE_BF16", "bf16"),
)


def cache_dir() -> Path:
    """Where built libraries live: $XDG_CACHE_HOME/cbgen/kernels, else ~/.cache/cbgen/kernels."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "cbgen" / "kernels"


@dataclass(frozen=True)
class Target:
    """What a build is for: the compiler (its path and `--version` line) and the macros it
    predefines under the build's flags, which spell out the ISA -march=native resolves to."""

    compiler: str
    version: str
    macros: Mapping[str, str]
    """name -> value of every predefined macro (`cc <flags> -E -dM`)."""

    def key(self, payload: bytes) -> str:
        """16 hex digits naming a build of payload (sources and flags) for this target."""
        text = "\n".join(
            [self.compiler, self.version, *(f"{k} {v}" for k, v in sorted(self.macros.items()))]
        )
        return hashlib.sha256(payload + b"\0" + text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """'x86-64 znver4 avx512f avx512bf16 avx2 fma (gcc 12.2)'."""
        m = self.macros
        arch = (
            "x86-64" if "__x86_64__" in m else "aarch64" if "__aarch64__" in m else "unknown arch"
        )
        tune = next((t.group(1) for t in map(re.compile(r"__tune_(\w+)__$").match, m) if t), None)
        isa = [name for macro, name in _ISA_MACROS if macro in m]
        if "__clang_major__" in m:
            compiler = f"clang {m['__clang_major__']}.{m.get('__clang_minor__', '0')}"
        elif "__GNUC__" in m:
            compiler = f"gcc {m['__GNUC__']}.{m.get('__GNUC_MINOR__', '0')}"
        else:
            compiler = self.version
        return " ".join([arch, *([tune] if tune else []), *isa]) + f" ({compiler})"


class _CommandFailed(Exception):
    """A compiler command that did not succeed: the command line and what it printed."""

    def __init__(self, cmd: Sequence[str], output: str) -> None:
        super().__init__(output.strip().splitlines()[-1] if output.strip() else f"{cmd[0]} failed")
        self.text = f"$ {' '.join(cmd)}\n{output}"


def _run(cmd: Sequence[str]) -> str:
    """stdout of cmd; _CommandFailed when it cannot start or exits non-zero."""
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, errors="replace")
    except OSError as e:
        raise _CommandFailed(cmd, str(e)) from e
    if done.returncode != 0:
        raise _CommandFailed(cmd, done.stderr + done.stdout)
    return done.stdout


@cache
def probe_target(cc: str, flags: tuple[str, ...]) -> Target:
    """The target of a build with these flags (once per process: two compiler calls)."""
    version = (_run([cc, "--version"]).splitlines() or [""])[0].strip()
    macros = {}
    for line in _run([cc, *flags, "-E", "-dM", "-x", "c", os.devnull]).splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) >= 2 and parts[0] == "#define":
            macros[parts[1]] = parts[2] if len(parts) == 3 else ""
    return Target(cc, version, macros)


def _compile(cc: str, flags: Sequence[str], lib_path: Path) -> None:
    """Build the library at lib_path (atomically: concurrent builders never see half a file),
    the sources compiled side by side, one per core this process may use: on first use the
    build is what a user waits for."""
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
        objs = [str(Path(tmp) / f"{i}.o") for i in range(len(_SRCS))]
        commands = [
            [cc, *flags, *source_flags, "-c", str(source), "-o", obj]
            for (source, source_flags), obj in zip(_SRCS.items(), objs, strict=True)
        ]
        with ThreadPoolExecutor(_cores()) as pool:
            list(pool.map(_run, commands))  # the first failure raises
        tmp_lib = Path(tmp) / lib_path.name
        _run([cc, "-shared", "-fopenmp", *objs, "-o", str(tmp_lib), "-lm"])
        tmp_lib.replace(lib_path)


def _cores() -> int:
    """The cores this process may run on (all of them where the OS does not say)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Build:
    """One attempt at the kernel library: the library, or None and why."""

    library: ctypes.CDLL | None
    reason: str
    """'built for <target>' with a library, else why there is none."""
    path: Path | None = None
    """The library file, or the log of a failed build."""

    def status(self) -> str:
        """One line for the start-up description."""
        state = self.reason if self.library is not None else f"unavailable ({self.reason})"
        return f"native CPU kernels: {state}"


def build_payload(flags: Sequence[str]) -> bytes:
    """What a build compiles, besides the target: every source with its flags, the headers
    and the common flags (OSError when a source is missing)."""
    payload = b"".join(p.read_bytes() + " ".join(f).encode() for p, f in _SRCS.items())
    return payload + b"".join(h.read_bytes() for h in _HEADERS) + " ".join(flags).encode()


def isa_flags(isa: str, info: CpuInfo) -> tuple[str, ...]:
    """The flags that take a -march=native build on the CPU `info` down to `isa` (one of
    features.ISAS): AMX's bf16 dot products off too where the CPU has them (a compiler that
    enables them under -march=native knows the flag)."""
    amx = ("-mno-amx-bf16",) if isa != "native" and "amx_bf16" in info.flags else ()
    return (*_ISA_FLAGS[isa], *amx)


def find_compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def build_library(cache: Path, extra_flags: Sequence[str] = ()) -> Build:
    """Build (unless cache already holds the build for this compiler, target and sources) and
    load the kernels, compiled with the default flags plus extra_flags (("-mno-avx512f",):
    the AVX2 build). A failed build leaves the compiler's stderr in cache/build-<key>.log.
    Where SIGNATURES disagree with cbgen.h nothing is compiled or loaded, and the reason lists
    the differences."""
    cc = find_compiler()
    if cc is None:
        return Build(None, "no C compiler")
    flags = (*_FLAGS, *extra_flags)
    try:
        payload = build_payload(flags)
        mismatch = signature_mismatch()
    except OSError as e:  # an install without the sources (they ship as package data)
        return Build(None, f"kernel source missing: {e.filename}")
    if mismatch is not None:  # a bug of this package, which the tests catch too
        return Build(None, mismatch)
    try:
        target = probe_target(cc, flags)
    except _CommandFailed as e:  # named by the compiler's path and the sources alone
        return _failed(cache / f"build-{Target(cc, '', {}).key(payload)}.log", e)
    key = target.key(payload)
    lib_path = cache / f"cbgen_cpu_{key}.so"
    if not lib_path.exists():
        try:
            with phase(BUILD, f"building CPU kernels for {target.describe()}: first use, cached"):
                _compile(cc, flags, lib_path)
        except (_CommandFailed, OSError) as e:
            return _failed(cache / f"build-{key}.log", e)
    try:
        lib = ctypes.CDLL(str(lib_path))
        _declare(lib)
    except (OSError, AttributeError) as e:
        return Build(None, f"cannot load {lib_path}: {e}", lib_path)
    with contextlib.suppress(OSError):  # the log of an earlier attempt that failed
        (cache / f"build-{key}.log").unlink(missing_ok=True)
    return Build(lib, f"built for {target.describe()}", lib_path)


def _failed(log: Path, error: Exception) -> Build:
    """A failed build, what the compiler said kept in log (the error itself in the reason when
    the log cannot be written)."""
    text = error.text if isinstance(error, _CommandFailed) else f"{error}\n"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        tmp = log.with_name(f"{log.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(log)
    except OSError:
        return Build(None, f"build failed: {error}; could not write {log}")
    return Build(None, f"build failed, see {log}", log)


@cache
def _build(extra_flags: tuple[str, ...]) -> Build:
    """The build for this process (for the ISA CBGEN_CPU_ISA names), logged once."""
    isa, info = isa_setting(), cpu_info()
    refused = isa_refusal(isa, info)
    if refused is not None:
        build = Build(None, refused)
    else:
        build = build_library(cache_dir(), (*isa_flags(isa, info), *extra_flags))
        if isa != "native":
            build = replace(build, reason=f"{build.reason}, {ISA_SETTING}={isa}")
    if build.library is not None:
        logger.info("%s", build.status())
    else:
        logger.warning("%s", build.status())
    return build


@cache
def load_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernels for this machine (plus extra_flags), built once per compiler, target ISA,
    sources and flags, loaded once per process; None when that fails (native_status says why)."""
    return _build(tuple(extra_flags)).library


def native_build() -> Build:
    """The default build for this process (the library, its file, or why there is none)."""
    return _build(())


def native_status() -> str:
    """'native CPU kernels: built for x86-64 znver4 avx512f avx512bf16 avx2 fma (gcc 12.2)'
    (then ', CBGEN_CPU_ISA=avx2' where that is set), or 'native CPU kernels:
    unavailable (...)' with the reason (a build log's path, the ISA refused)."""
    return _build(()).status()


_p, _int, _i64, _f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES: dict[str, Signature] = {
    "cbgen_paged_decode_f32": (
        _int,
        [_p, _i64, _p, _p, _p, _i64, _p, *[_i64] * 5, _f32, _i64, _f32, _p],
    ),
    "cbgen_paged_decode_bf16kv": (
        _int,
        [_p, _i64, _p, _p, _p, _i64, _p, *[_i64] * 5, _f32, _i64, _f32, _p],
    ),
    "cbgen_exp_sub_sum_f32": (_f32, [_p, _i64, _f32]),
    "cbgen_add_rmsnorm_f32": (None, [_p, _p, _p, _f32, _i64, _i64, _p]),
    "cbgen_rope_f32": (None, [_p, _i64, _i64, _i64, _i64, _p, _p, _p]),
    "cbgen_rmsnorm_heads_f32": (None, [_p, _i64, _i64, _i64, _i64, _p, _f32]),
    "cbgen_write_kv_f32": (_int, [_p, _i64, _p, _i64, _p, _p, _i64, _p, _i64, _i64]),
    "cbgen_write_kv_bf16": (_int, [_p, _i64, _p, _i64, _p, _p, _i64, _p, _i64, _i64]),
    "cbgen_head_bf16": (
        _i64,
        [_p, _i64, _i64, _p, _p, _i64, _p, _p, _p, *[_f32] * 4, _p, _p, _i64, _p],
    ),
    "cbgen_head_i16_available": (_i64, []),
    "cbgen_head_i16_preferred": (_i64, []),
    "cbgen_head_i16_levels": (_i64, [_i64]),
    "cbgen_head_i16_pack": (_int, [_p, _i64, _i64, _i64, _p, _p, _p]),
    "cbgen_head_i16": (
        _i64,
        [_p, _i64, _i64, _p, _p, _i64, _i64, _p, _p, _p, *[_f32] * 4, _p, _p, _i64, _p, _p],
    ),
    "cbgen_pack_panels_f32": (None, [_p, _i64, _i64, _p]),
    "cbgen_small_gemm_f32": (None, [_p, _i64, _i64, _p, _i64, _p, _i64, _p]),
    "cbgen_small_gemm_max_rows": (_i64, []),
    "cbgen_small_gemm_blocked_rows": (_i64, []),
    "cbgen_small_gemm_gated_f32": (_int, [_p, _i64, _i64, _p, _i64, _int, _p]),
    "cbgen_q_isa": (_i64, []),
    "cbgen_q_packed_bytes": (_i64, [_int, _i64, _i64]),
    "cbgen_q_pack": (_int, [_int, _p, _i64, _i64, _p]),
    "cbgen_q8_quantize": (None, [_p, _i64, _i64, _p, _p, _p, _p]),
    "cbgen_q_gemm": (_int, [_i64, _p, _p, _p, _p, _i64, _i64, _p, _p, _i64]),
    "cbgen_q_rows": (_int, [_int, _p, _i64, _i64, _p, _i64, _p]),
    "cbgen_bf16_native": (_i64, []),
    "cbgen_panel_k_bf16": (_i64, [_i64]),
    "cbgen_pack_panels_bf16": (None, [_p, _i64, _i64, _p]),
    "cbgen_small_gemm_bf16": (_int, [_p, _i64, _i64, _p, _i64, _p, _int, _i64, _p]),
    "cbgen_small_gemm_blocked_bf16w": (_int, [_p, _i64, _i64, _p, _i64, _p, _p]),
    "cbgen_small_gemm_gated_bf16w": (_int, [_p, _i64, _i64, _p, _i64, _int, _p]),
    "cbgen_small_gemm_gated_bf16_dot": (_int, [_p, _i64, _i64, _p, _i64, _int, _p]),
    "cbgen_prefill_attention_f32": (_int, [_p, _i64, _p, _p, _p, *[_i64] * 6, _f32, _i64, _f32]),
    "cbgen_prefill_attention_bf16": (_int, [_p, _i64, _p, _p, _p, *[_i64] * 6, _f32, _i64, _f32]),
    "cbgen_native_prefill_rows": (_i64, []),
    "cbgen_prefill_kernel_preferred": (_int, []),
    "cbgen_silu_mul_f32": (None, [_p, _i64, _i64, _p]),
    "cbgen_gelu_tanh_mul_f32": (None, [_p, _i64, _i64, _p]),
    "cbgen_sample_f32": (_int, [_p, _i64, _i64, _i64, _p, _p, _p]),
    "cbgen_decoder_work_f32": (_i64, [_p, _i64, _i64]),
    "cbgen_decoder_forward_f32": (_int, [_p, _i64, _p, _p, _p, _p, _p, _p]),
}
"""name -> (restype, argtypes) of every function cbgen.h declares, as ctypes converts the
arguments: pointers are c_void_p (callers pass tensor.data_ptr()), int is c_int, int64_t c_int64.
signature_mismatch() holds them to the header."""


def signature_mismatch() -> str | None:
    """Why SIGNATURES disagree with cbgen.h (every difference, on one line), or None when they
    agree.

    build_library asks this before it compiles or loads anything, so a library whose ctypes
    signatures differ from its C declarations is never called (a wrong type corrupts arguments
    or memory silently). Both are files of this package, so the answer changes only when the
    package does, and tests/cpu/test_c_header.py asks it too; it runs at every build anyway, so that
    a source tree edited on either side without running the tests still never calls through a
    wrong type, because it is cheap: parsing the header and comparing its 26 functions took
    ~1.5 ms the first time in a process and ~0.7 ms after, and importing c_header ~4 ms (on a
    busy 2-core box), against the second or more that importing torch takes at every start.
    """
    try:
        check_signatures(parse_header(HEADER.read_text()), SIGNATURES)
    except HeaderError as e:
        return f"cannot read {HEADER.name}: {e}"
    except SignatureMismatch as e:  # one line: it ends the status line
        return f"ctypes signatures disagree with {HEADER.name}: {'; '.join(e.problems)}"
    return None


def _declare(lib: ctypes.CDLL) -> None:
    """Give ctypes the C signatures (SIGNATURES) to convert the arguments."""
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes

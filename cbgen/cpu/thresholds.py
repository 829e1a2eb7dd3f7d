"""What this machine's build answers about its own tiles: the row counts small_gemm serves by
default, and how the cpu attention backend splits prompt chunks. cbgen.cpu.tuning measures the
row thresholds on the machine itself; the runtime holds what it found (CpuThresholds).
"""

from __future__ import annotations

import functools

from cbgen.cpu import build


def build_small_gemm_max_rows() -> int:
    """Up to this many rows small_gemm beats oneDNN's packed matmul with the tiles of this
    machine's build (0 without the kernels); the build answers, since the tiles are chosen per
    ISA when it is compiled. With AVX-512 (16-row tiles, measured over a whole model's layers
    from cold caches: 1.6x at 1 row, 1.4x at 8, 1.1-1.2x at 29-512, even at 640, 2 % slower at
    1024) and with AVX2 (6-row tiles; in packed row blocks from 96 rows on par with oneDNN up
    to 2,048): docs/PERFORMANCE.md. The build's default: the runtime uses what cbgen.cpu.tuning
    measured on this machine where it could (cbgen.runtime.cpu.CpuThresholds)."""
    lib = build.load_library()
    return 0 if lib is None else int(lib.cbgen_small_gemm_max_rows())


def build_small_gemm_blocked_rows() -> int:
    """From this many rows on, by this build's default, small_gemm copies the rows in blocks
    that stay in L2 while the weights stream past (0 without the kernels); fewer rows stream
    from where they are while each weight panel sits in L2 and the next is prefetched. Both
    give the same bits. The runtime passes what the tuning measured (CpuThresholds)."""
    lib = build.load_library()
    return 0 if lib is None else int(lib.cbgen_small_gemm_blocked_rows())


@functools.cache
def prefill_split() -> tuple[int, bool]:
    """How the cpu attention backend splits prompt chunks with this machine's build: (rows,
    kernel). With `kernel`, every prompt chunk goes to prefill_attention_f32 (batch invariance:
    see cbgen.attention.cpu_backend); without, a chunk whose query tokens read at most `rows`
    K/V rows in all goes to the decode kernel, one token at a time, and a larger one to torch's
    SDPA (so too where the prefill kernel does not take the model's heads). The build answers,
    since the kernels' tiles are chosen per ISA when it is compiled (docs/PERFORMANCE.md: 8192
    and the kernel, with AVX-512 and with AVX2). (8192, True) without the kernels, where every
    chunk takes torch's path anyway."""
    lib = build.load_library()
    if lib is None:
        return 8192, True
    return int(lib.cbgen_native_prefill_rows()), bool(lib.cbgen_prefill_kernel_preferred())

"""Thresholds measured on the machine itself, once per kernel build.

The kernels' tiles are chosen per ISA when they are compiled, and each build carries a default
for where small_gemm stops beating oneDNN's packed matmul (small_gemm.c MAX_ROWS). Where that
crossover falls also depends on the cache sizes, the memory bandwidth and oneDNN's own kernels
for the CPU, which one ISA covers many of. So at first use, in the same cache as the build and
under the same key, a short pass times both paths on a layer-sized weight and keeps the largest
row count up to which small_gemm is not slower; later processes read it back. Before that it
times small_gemm's two paths at decode sizes (row tiles straight from the batch, or packed
row blocks: the same bits) and keeps the row count from which the blocks are never slower. Where the build
has the int16 LM head and the CPU no bf16 dot products, the same pass times the int16 head
against the float32 one (small_gemm and argmax) and keeps the faster.

CBGEN_CPU_TUNING=off keeps the build's defaults (what the tests use, so a noisy machine cannot
change which path a test takes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from cbgen.cpu import build, gemm, head_kernels
from cbgen.cpu.linear import (
    Int16Head,
    bf16_matmul_fast,
    onednn_packing_available,
    pack_weight,
    packed_linear,
)
from cbgen.phases import TUNE, phase

logger = logging.getLogger("cbgen")

VERSION = 4
"""Bumped when what is measured changes: an older file is measured again."""

ROWS: tuple[int, ...] = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 2048)
"""The row counts the pass tries (decode batches, the mixed steps of chunked prefill, and a
whole default step budget of prompt tokens)."""

SHAPE = (1536, 576)
"""[N, K] of the weight timed: a 135M-class MLP projection, whose panels (3.5 MiB) outgrow
the L2 caches of every current CPU, as a whole layer's weights do."""

WEIGHTS = 10
"""How many of them one pass goes through: 35 MiB of panels, beyond a 32 MiB L3."""

SLACK = 1.10
"""small_gemm keeps a row count unless it is clearly slower there (by more than this, twice)."""

BUSY_LOAD = 0.5
"""Share of the CPUs busy with other work above which the pass does not measure (another job's
noise would be kept for good): the build's default serves this process and a later start
measures."""


LAYER_SHAPES: tuple[tuple[int, int], ...] = ((832, 576), (576, 576), (3072, 576), (576, 1536))
"""[N, K] of a 135M-class layer's four matmuls (QKV, output, gate-up, down)."""

LAYERS = 3
"""How many such layers the decode-size timings go through: 42 MiB of panels, past a 32 MiB L3."""

BLOCKED_TRIED: tuple[int, ...] = (8, 16, 24, 32, 48, 64)
"""Decode batches at which the pass times small_gemm's two paths (row tiles straight from x
with the next panel prefetched, or packed row blocks): where the weights' stream from memory
bounds the step the first wins, with more rows the second."""

HEAD_SHAPE = (16384, 576)
"""[V, K] of the LM head timed (a third of SmolLM2's: 36 MiB of float32 panels)."""

HEAD_ROWS = 64
"""Rows of the head's batch timed: a full decode batch, where the head costs most."""


@dataclass(frozen=True)
class Tuning:
    small_gemm_max_rows: int
    source: str
    """'measured' (this machine, now or earlier), 'build default' or why it is the default."""
    int16_head: bool = False
    """The LM head takes int16 logits (linear.Int16Head) where the CPU has no bf16 dot products."""
    blocked_rows: int = 0
    """small_gemm packs rows in blocks from this many on (0: the build's default,
    thresholds.build_small_gemm_blocked_rows)."""

    def describe(self) -> str:
        head = ", int16 LM head" if self.int16_head else ""
        blocks = f" (row blocks from {self.blocked_rows})" if self.blocked_rows else ""
        return f"small_gemm up to {self.small_gemm_max_rows} rows{blocks}{head} ({self.source})"


def crossover(
    rows: Sequence[int], native_s: Sequence[float], onednn_s: Sequence[float], slack: float = SLACK
) -> int:
    """The largest row count up to which the native path is never more than `slack` times
    slower than oneDNN at any row count tried (0 when it is slower at the first)."""
    best = 0
    for r, a, b in zip(rows, native_s, onednn_s, strict=False):
        if a > b * slack:
            break
        best = r
    return best


def blocked_from(rows: Sequence[int], tiles_s: Sequence[float], blocked_s: Sequence[float]) -> int:
    """The smallest row count from which the blocked path is never slower at any size tried
    (0 when it is slower at the largest: the build's default stays)."""
    best = 0
    for r, a, b in reversed(list(zip(rows, tiles_s, blocked_s, strict=True))):
        if b > a:
            break
        best = r
    return best


def _best_times(fns: Sequence[Callable[[], object]], reps: int) -> list[float]:
    """The fastest of reps timings of each fn, taken in turns (fn 0, fn 1, fn 0, ...) so that
    whatever else runs on the machine slows both alike; the minimum is the least disturbed."""
    for fn in fns:
        fn()  # warm: oneDNN's primitive cache, page faults
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def measure(reps: int = 5, blocked_from: int = 0) -> tuple[list[float], list[float]] | None:
    """Seconds per pass over WEIGHTS layer-sized weights (more than a last-level cache holds,
    so the weights stream from memory as a model's do) at each ROWS size, through small_gemm and
    through oneDNN's packed matmul, up to the first size where small_gemm loses; None when
    either path is unavailable here."""
    if not onednn_packing_available():
        return None
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(SHAPE, generator=gen) for _ in range(WEIGHTS)]
    packed = [pack_weight(w) for w in weights]
    panels = [p for p in map(gemm.pack_panels, weights) if p is not None]
    del weights
    if len(panels) < WEIGHTS:
        return None
    native, onednn = [], []
    for r in ROWS:
        x = torch.randn(r, SHAPE[1], generator=gen)

        def native_pass(x: torch.Tensor = x) -> None:
            for p in panels:
                gemm.small_gemm(x, p, None, blocked_from)

        def onednn_pass(x: torch.Tensor = x) -> None:
            for w in packed:
                packed_linear(x, w, None)

        a, b = _best_times([native_pass, onednn_pass], reps)
        if a > b * SLACK:  # a loss counts when a second look agrees
            a, b = _best_times([native_pass, onednn_pass], reps)
        native.append(a)
        onednn.append(b)
        if a > b * SLACK:
            break
    return native, onednn


def measure_blocked(reps: int = 5) -> tuple[list[float], list[float]] | None:
    """Seconds per pass over LAYERS layers' weights at each BLOCKED_TRIED size, through
    small_gemm's row tiles and through its packed row blocks (the same bits); None without
    the kernels."""
    gen = torch.Generator().manual_seed(1)
    shapes = LAYER_SHAPES * LAYERS
    panels = [gemm.pack_panels(torch.randn(shape, generator=gen)) for shape in shapes]
    if any(p is None for p in panels):
        return None
    tiles, blocked = [], []
    for r in BLOCKED_TRIED:
        xs = {k: torch.randn(r, k, generator=gen) for k in {k for _, k in shapes}}

        def layers(blocked_from: int, xs: dict[int, torch.Tensor] = xs) -> None:
            for (_, k), p in zip(shapes, panels, strict=True):
                gemm.small_gemm(xs[k], p, None, blocked_from)  # type: ignore[arg-type]

        def tiles_pass(r: int = r) -> None:
            layers(r + 1)

        def blocked_pass() -> None:
            layers(1)

        a, b = _best_times([tiles_pass, blocked_pass], reps)
        tiles.append(a)
        blocked.append(b)
    return tiles, blocked


def measure_head(reps: int = 5) -> tuple[float, float]:
    """Seconds of a greedy LM head over HEAD_ROWS rows: the float32 one (small_gemm, argmax)
    and the int16 one, taken in turns."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(HEAD_SHAPE, generator=gen) * 0.05
    hidden = torch.randn(HEAD_ROWS, HEAD_SHAPE[1], generator=gen)
    panels = gemm.pack_panels(weight)
    if panels is None:
        raise RuntimeError("the head's timing needs the native kernels")
    head = Int16Head(weight)
    zeros = torch.zeros(HEAD_ROWS)
    seeds = torch.zeros(HEAD_ROWS, dtype=torch.int64)

    def float32_head() -> None:
        gemm.small_gemm(hidden, panels, None).argmax(-1)

    def int16_head() -> None:
        head(hidden, zeros, seeds)

    float32_s, int16_s = _best_times([float32_head, int16_head], reps)
    return float32_s, int16_s


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot (/proc/stat), None where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def _load_per_cpu(interval: float = 0.3) -> float:
    """The share of the CPUs other processes keep busy now: /proc/stat over `interval` seconds
    while this process sleeps. Not the load average: its minute-long memory still holds a job
    that has just ended (the peer comparison's matmul peak, say), and would turn the tuning
    down for the next minute. The load average where /proc/stat is unreadable."""
    before = _cpu_times()
    if before is not None:
        time.sleep(interval)
        after = _cpu_times()
        if after is not None and after[1] > before[1]:
            return (after[0] - before[0]) / (after[1] - before[1])
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def tuning_path(library: Path) -> Path:
    """Beside the library, under its key: a rebuild for another CPU or source is tuned anew."""
    return library.with_suffix(".tuning.json")


def read(path: Path) -> Tuning | None:
    """A tuning written by this version, or None (absent, unreadable, another version)."""
    try:
        data = json.loads(path.read_text())
        if data.get("version") != VERSION:
            return None
        rows = data["small_gemm_max_rows"]
        int16_head = data["int16_head"]
        blocked = data["blocked_rows"]
        if type(rows) is not int or rows < 0 or type(int16_head) is not bool:
            return None
        if type(blocked) is not int or blocked < 0:
            return None
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    return Tuning(rows, "measured", int16_head, blocked)


def write(
    path: Path,
    tuning: Tuning,
    native_s: Sequence[float],
    onednn_s: Sequence[float],
    head_s: tuple[float, float] | None = None,
    blocked_s: tuple[Sequence[float], Sequence[float]] | None = None,
) -> None:
    """Atomically, with the timings it came from (for whoever wonders why)."""
    data = {
        "version": VERSION,
        **asdict(tuning),
        "shape": list(SHAPE),
        "rows": list(ROWS),
        "small_gemm_s": [round(t, 7) for t in native_s],
        "onednn_s": [round(t, 7) for t in onednn_s],
    }
    if blocked_s is not None:
        data["blocked_tried"] = list(BLOCKED_TRIED)
        data["row_tiles_s"] = [round(t, 7) for t in blocked_s[0]]
        data["row_blocks_s"] = [round(t, 7) for t in blocked_s[1]]
    if head_s is not None:
        data["head_shape"] = [HEAD_ROWS, *HEAD_SHAPE]
        data["float32_head_s"], data["int16_head_s"] = (round(t, 7) for t in head_s)
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
    except OSError as e:  # a read-only cache: measured again next time
        logger.debug("could not keep the CPU tuning in %s: %s", path, e)
        with contextlib.suppress(OSError):
            tmp.unlink()


def tune(library: Path, default: int, int16_head: bool | None = None) -> Tuning:
    """The tuning for the build at `library`: read back, or measured now and kept.
    int16_head: the build's default for the head, None where the int16 head is not a choice
    (not in the build, or the CPU has bf16 dot products)."""
    path = tuning_path(library)
    found = read(path)
    if found is not None:
        return found if int16_head is not None else replace(found, int16_head=False)
    head = bool(int16_head)
    load = _load_per_cpu()
    if load > BUSY_LOAD:
        return Tuning(default, f"build default: machine busy ({load:.0%} of the CPUs)", head)
    with phase(TUNE, "tuning CPU kernels for this machine: first use, kept beside the build"):
        blocked_s = measure_blocked()
        blocked = blocked_from(BLOCKED_TRIED, *blocked_s) if blocked_s else 0
        timings = measure(blocked_from=blocked)  # small_gemm as it will run
        if timings is None:
            return Tuning(default, "build default: oneDNN packing unavailable", head)
        native_s, onednn_s = timings
        head_s = measure_head() if int16_head is not None else None
    if head_s is not None:
        head = head_s[1] < head_s[0]
    tuning = Tuning(crossover(ROWS, native_s, onednn_s), "measured", head, blocked)
    write(path, tuning, native_s, onednn_s, head_s, blocked_s)
    logger.info("CPU tuning: %s, kept in %s", tuning.describe(), path)
    return tuning


def for_this_machine() -> Tuning | None:
    """The tuning of this machine's kernel build (None without the kernels): read back from
    beside the build, or measured now and kept there; the build's defaults under
    CBGEN_CPU_TUNING=off. It sets nothing: the runtime holds the thresholds
    (cbgen.runtime.cpu.CpuThresholds) and decides the head from it."""
    b = build.native_build()
    if b.library is None or b.path is None:
        return None
    default = int(b.library.cbgen_small_gemm_max_rows())
    head: bool | None = None
    if head_kernels.head_i16_available() and not bf16_matmul_fast():
        head = bool(b.library.cbgen_head_i16_preferred())
    if os.environ.get("CBGEN_CPU_TUNING", "").lower() in ("off", "0", "no", "false"):
        return Tuning(default, "build default: CBGEN_CPU_TUNING=off", bool(head))
    return tune(b.path, default, head)

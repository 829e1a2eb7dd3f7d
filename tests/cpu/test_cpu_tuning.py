"""The per-machine tuning pass: the crossover it picks, the file it keeps beside the kernel
build, and the thresholds each engine's runtime then holds."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from cbgen.cpu import build, gemm, head_kernels, thresholds, tuning
from cbgen.cpu.linear import onednn_packing_available
from cbgen.engine.engine import Engine
from cbgen.runtime.cpu import CpuRuntime
from cbgen.runtime.cpu_linear import CpuThresholds

no_kernels = pytest.mark.skipif(build.load_library() is None, reason=build.native_status())
no_onednn = pytest.mark.skipif(
    not onednn_packing_available(), reason="no oneDNN packed matmul in this torch build"
)


def needs_kernels(test: Callable[..., None]) -> Callable[..., None]:
    """Skipped, with the reason that is true here, without the kernels or oneDNN's packing."""
    return no_onednn(no_kernels(test))


def test_blocks_start_where_they_stop_losing_for_good() -> None:
    rows = [8, 16, 32, 64]
    assert tuning.blocked_from(rows, [1, 2, 4, 8], [2, 2, 3, 7]) == 16  # ties count as no loss
    assert tuning.blocked_from(rows, [1, 2, 4, 8], [0.5, 3, 3, 7]) == 32  # a win below a loss
    assert tuning.blocked_from(rows, [1, 2, 4, 8], [2, 3, 5, 9]) == 0  # the build's default
    assert tuning.blocked_from(rows, [1, 2, 4, 8], [1, 2, 4, 8]) == 8


@needs_kernels
def test_measure_blocked_times_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row count runs every layer's weights through the row tiles (row blocks from past it)
    and through the row blocks (from 1 row on): a warm-up and reps timed passes each."""
    calls: list[tuple[int, int]] = []
    real = gemm.small_gemm

    def counted(x: torch.Tensor, panels: torch.Tensor, bias: None, blocked_from: int) -> Any:
        calls.append((x.shape[0], blocked_from))
        return real(x, panels, bias, blocked_from)

    monkeypatch.setattr(gemm, "small_gemm", counted)
    got = tuning.measure_blocked(reps=2)
    assert got is not None
    tiles, blocked = got
    assert len(tiles) == len(blocked) == len(tuning.BLOCKED_TRIED)
    assert all(math.isfinite(t) and t > 0 for t in (*tiles, *blocked))
    weights = len(tuning.LAYER_SHAPES) * tuning.LAYERS
    passes = 1 + 2  # the warm-up, then reps
    assert calls == [
        (rows, blocked_from)
        for rows in tuning.BLOCKED_TRIED
        for _ in range(passes)
        for blocked_from in (rows + 1, 1)  # in turns: the tiles, then the blocks
        for _ in range(weights)
    ]


def test_crossover_keeps_the_largest_row_count_before_the_first_loss() -> None:
    rows = [16, 32, 64, 128]
    assert tuning.crossover(rows, [1, 2, 4, 8], [2, 3, 4, 9]) == 128
    assert tuning.crossover(rows, [1, 2, 5, 8], [2, 3, 4, 9]) == 32  # lost at 64: stop there
    assert tuning.crossover(rows, [1, 2, 4.1, 1], [2, 3, 4, 9]) == 128  # within the slack
    assert tuning.crossover(rows, [3, 1, 1, 1], [2, 9, 9, 9]) == 0


@needs_kernels
def test_tune_measures_once_and_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = tmp_path / "cbgen_cpu_0123456789abcdef.so"
    calls: list[int] = []
    real = tuning.measure

    def counted(reps: int = 5, blocked_from: int = 0) -> tuple[list[float], list[float]] | None:
        calls.append(reps)
        return real(reps=1, blocked_from=blocked_from)

    monkeypatch.setattr(tuning, "measure", counted)
    monkeypatch.setattr(tuning, "_load_per_cpu", lambda: 0.0)
    first = tuning.tune(lib, default=7)
    assert first.source == "measured" and calls == [5]
    kept = json.loads(tuning.tuning_path(lib).read_text())
    assert kept["small_gemm_max_rows"] == first.small_gemm_max_rows
    assert 1 <= len(kept["small_gemm_s"]) == len(kept["onednn_s"]) <= len(tuning.ROWS)
    assert kept["small_gemm_max_rows"] == tuning.crossover(
        tuning.ROWS, kept["small_gemm_s"], kept["onednn_s"]
    )
    assert tuning.tune(lib, default=7) == first and calls == [5]  # read back, not measured

    # a file of another version, or a broken one, is measured again
    for text in (json.dumps({**kept, "version": tuning.VERSION + 1}), "{not json", "[]"):
        tuning.tuning_path(lib).write_text(text)
        assert tuning.tune(lib, default=7).source == "measured"
    assert len(calls) == 4


@needs_kernels
def test_tune_times_the_int16_head_where_it_is_a_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The faster head is kept with its timings; where the int16 head is no choice (None: not in
    the build, or bf16 dot products) it is neither timed nor taken, even from a file that says so."""
    monkeypatch.setattr(tuning, "measure", lambda reps=5, blocked_from=0: ([1.0], [2.0]))
    monkeypatch.setattr(tuning, "measure_blocked", lambda reps=5, blocked_from=0: None)
    monkeypatch.setattr(tuning, "_load_per_cpu", lambda: 0.0)
    for times, want in (((2.0, 1.0), True), ((1.0, 2.0), False)):
        monkeypatch.setattr(tuning, "measure_head", lambda reps=5, t=times: t)
        lib = tmp_path / f"{want}.so"
        got = tuning.tune(lib, default=7, int16_head=not want)
        assert got == tuning.Tuning(16, "measured", want)
        kept = json.loads(tuning.tuning_path(lib).read_text())
        assert (kept["float32_head_s"], kept["int16_head_s"]) == times
        assert kept["head_shape"] == [tuning.HEAD_ROWS, *tuning.HEAD_SHAPE]
        assert tuning.tune(lib, default=7, int16_head=not want) == got  # read back
    assert tuning.tune(tmp_path / "True.so", default=7, int16_head=None).int16_head is False

    def fail(reps: int = 5) -> None:
        raise AssertionError("timed a head that is no choice here")

    monkeypatch.setattr(tuning, "measure_head", fail)
    got = tuning.tune(tmp_path / "none.so", default=7, int16_head=None)
    assert got == tuning.Tuning(16, "measured", False)
    assert "int16_head_s" not in json.loads(tuning.tuning_path(tmp_path / "none.so").read_text())


@no_kernels
@pytest.mark.skipif(
    build.load_library() is not None and not head_kernels.head_i16_available(),
    reason="no int16 head in this build (x86-64 with AVX2)",
)
def test_measure_head_times_both_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both heads over the same rows, in turns: a warm-up, then reps timed passes each."""
    calls: list[tuple[str, int]] = []
    real = gemm.small_gemm

    def float32_matmul(x: torch.Tensor, panels: torch.Tensor, bias: None, *rest: int) -> Any:
        calls.append(("float32", x.shape[0]))
        return real(x, panels, bias, *rest)

    class Int16Counted(tuning.Int16Head):
        def __call__(self, hidden: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
            calls.append(("int16", hidden.shape[0]))
            return super().__call__(hidden, *args)

    monkeypatch.setattr(gemm, "small_gemm", float32_matmul)
    monkeypatch.setattr(tuning, "Int16Head", Int16Counted)
    float32_s, int16_s = tuning.measure_head(reps=2)
    assert all(math.isfinite(t) and t > 0 for t in (float32_s, int16_s))
    assert calls == [("float32", tuning.HEAD_ROWS), ("int16", tuning.HEAD_ROWS)] * (1 + 2)


def test_tune_without_onednn_keeps_the_build_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning, "measure", lambda reps=5, blocked_from=0: None)
    monkeypatch.setattr(tuning, "_load_per_cpu", lambda: 0.0)
    got = tuning.tune(tmp_path / "x.so", default=96)
    assert got.small_gemm_max_rows == 96 and got.source.startswith("build default")
    assert not tuning.tuning_path(tmp_path / "x.so").exists()


def test_a_busy_machine_is_not_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(reps: int = 5) -> None:
        raise AssertionError("measured on a busy machine")

    monkeypatch.setattr(tuning, "measure", fail)
    monkeypatch.setattr(tuning, "_load_per_cpu", lambda: 0.8)
    got = tuning.tune(tmp_path / "x.so", default=96)
    assert got == tuning.Tuning(96, "build default: machine busy (80% of the CPUs)")
    assert not tuning.tuning_path(tmp_path / "x.so").exists()  # measured at a later start


@needs_kernels
def test_the_runtime_holds_the_tuned_thresholds_and_the_start_up_line_names_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Callable[[str], Path]
) -> None:
    """The tuning kept beside the build is read back by each engine's runtime, which holds
    its thresholds (no process global changes: another runtime keeps its own), and the
    start-up line says what it took."""
    native = build.native_build()
    assert native.path is not None
    lib_copy = tmp_path / native.path.name
    monkeypatch.setattr(
        build, "native_build", lambda: build.Build(native.library, native.reason, lib_copy)
    )
    tuning.tuning_path(lib_copy).write_text(
        json.dumps(
            {
                "version": tuning.VERSION,
                "small_gemm_max_rows": 48,
                "source": "measured",
                "int16_head": False,
                "blocked_rows": 24,
            }
        )
    )
    monkeypatch.setenv("CBGEN_CPU_TUNING", "on")
    assert tuning.for_this_machine() == tuning.Tuning(48, "measured", False, 24)
    engine = Engine(model=str(tiny_model_dir("llama")), device="cpu", kv_cache_memory=1 << 20)
    runtime = engine.runtime
    assert isinstance(runtime, CpuRuntime)
    assert runtime.thresholds == CpuThresholds(48, 24)
    assert ", small_gemm up to 48 rows (row blocks from 24) (measured)" in engine.describe()
    monkeypatch.setenv("CBGEN_CPU_TUNING", "off")
    other = Engine(model=str(tiny_model_dir("llama")), device="cpu", kv_cache_memory=1 << 20)
    assert isinstance(other.runtime, CpuRuntime)
    default = CpuThresholds(
        thresholds.build_small_gemm_max_rows(), thresholds.build_small_gemm_blocked_rows()
    )
    assert other.runtime.thresholds == default and runtime.thresholds == CpuThresholds(48, 24)


def test_the_busy_share_is_what_the_cpus_did_while_the_pass_waited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (busy, total) ticks since boot, read before and after the wait: 30 of 100 ticks busy
    samples = iter([(5_000, 20_000), (5_030, 20_100)])
    monkeypatch.setattr(tuning, "_cpu_times", lambda: next(samples))
    assert tuning._load_per_cpu(interval=0.0) == pytest.approx(0.3)
    # where /proc/stat cannot be read: the load average per CPU
    monkeypatch.setattr(tuning, "_cpu_times", lambda: None)
    monkeypatch.setattr(tuning.os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    monkeypatch.setattr(tuning.os, "cpu_count", lambda: 2)
    assert tuning._load_per_cpu(interval=0.0) == pytest.approx(1.5)


def test_cpu_times_reads_this_machine() -> None:
    times = tuning._cpu_times()
    if times is None:
        pytest.skip("no /proc/stat here")
    busy, total = times
    assert 0 <= busy <= total and total > 0

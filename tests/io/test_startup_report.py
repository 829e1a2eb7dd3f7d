"""What a run tells about its start-up: each phase as it begins (a line in plain mode, the
spinner line of the live view, nothing under --quiet), the seconds of each kind in the summary
(printed and in this_run.startup_s), the slowest worker's for each kind, and a real (tiny)
engine's phases heard in order by the display."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from cbgen.config import EngineConfig
from cbgen.display import Display, LiveDisplay, LogDisplay, ProgressSnapshot, format_startup
from cbgen.io.part import RunPlan, generate_part, merge_stats
from cbgen.io.rows import ColumnSpec
from cbgen.io.stop import StopFlag
from cbgen.io.summary import format_summary
from cbgen.io.writer import OutputLayout
from cbgen.phases import BUILD, LOAD, TUNE
from cbgen.sampling_params import SamplingParams

BUILDING = "building CPU kernels for x86-64 znver4 avx512f avx2 fma (gcc 12.2): first use, cached"


def test_plain_mode_prints_each_phase_as_it_begins_and_quiet_mode_nothing() -> None:
    out = io.StringIO()
    log = LogDisplay(10.0, out)
    log.phase(BUILD, BUILDING, None)
    log.phase(BUILD, BUILDING, 20.1)
    log.phase(LOAD, "loading model smollm2-135m-instruct", None)
    assert out.getvalue() == f"[cbgen] {BUILDING}\n[cbgen] loading model smollm2-135m-instruct\n"
    quiet = io.StringIO()
    Display(quiet).phase(TUNE, "tuning", None)
    assert quiet.getvalue() == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_live_view_shows_the_running_phase_then_clears_it_for_the_rows() -> None:
    out = _Terminal()
    live = LiveDisplay(out)
    live.phase(LOAD, "preparing the model for cpu", None)
    live.phase(TUNE, "tuning CPU kernels for this machine", None)
    shown = out.getvalue()
    assert (
        "preparing the model for cpu" in shown
        and "tuning CPU kernels for this machine  0s" in shown
    )
    live.phase(TUNE, "tuning CPU kernels for this machine", 25.0)
    assert out.getvalue()[len(shown) :].count("preparing the model for cpu  0s") == 1  # back to it
    live.message("model tiny on cpu")  # above the spinner line
    live.start()  # the spinner line goes, the rows come
    live.phase(LOAD, "unseen: the view has started", None)
    live.stop(ProgressSnapshot.empty(64, 12))
    text = out.getvalue()
    assert "model tiny on cpu" in text and "rows 0/12" in text
    assert "unseen" not in text


def test_a_live_view_stopped_during_start_up_ends_its_spinner() -> None:
    live = LiveDisplay(_Terminal())
    live.phase(BUILD, BUILDING, None)
    live.stop()  # e.g. the engine failed to start
    assert live._phase_live is None


def test_the_start_up_line_names_the_kinds_that_took_time() -> None:
    startup = {"total": 48.2, "build": 20.1, "tune": 25.3, "load": 2.1, "other": 0.7}
    assert format_startup(startup) == "start-up 48.2s: build 20.1s, tune 25.3s, load 2.1s"
    warm = {"total": 3.1, "build": 0.0, "tune": 0.0, "load": 2.9, "other": 0.2}
    assert format_startup(warm) == "start-up 3.1s: load 2.9s"
    assert format_startup({"total": 75.0, "build": 0.2}) == "start-up 1m15s"


def _summary(this_run: dict[str, Any]) -> dict[str, Any]:
    run = {"rows_generated": 12, "rows_resumed": 0, "rows_per_s": 0.5}
    run.update(output_tokens_per_s=11.0, total_tokens_per_s=26.0, **this_run)
    return {
        "output": "out.parquet",
        "rows": {"output": 12, "ok": 12, "failed": 0, "input_rows": 12},
        "error_rate": 0.0,
        "tokens": {"prompt": 403, "completion": 305, "cached": 128, "cache_hit_rate": 0.3},
        "total_preemptions": 0,
        "this_run": run,
        "wall_s": 72.0,
        "latency_s": {},
    }


def test_the_summary_says_how_long_start_up_took_and_of_what() -> None:
    startup = {"total": 48.0, "build": 20.0, "tune": 25.0, "load": 2.0, "other": 1.0}
    text = format_summary(_summary({"load_s": 48.0, "startup_s": startup}))
    assert "this run: 1m12s wall (start-up 48.0s: build 20.0s, tune 25.0s, load 2.0s), " in text
    older = format_summary(_summary({"load_s": 4.0}))  # a summary from before the phases
    assert "this run: 1m12s wall (start-up 4.0s), " in older


def test_workers_start_up_merges_kind_by_kind_taking_the_slowest() -> None:
    a = {
        "rows_generated": 5,
        "load_s": 30.0,
        "startup_s": {"total": 30.0, "build": 20.0, "tune": 0.0},
    }
    b = {
        "rows_generated": 7,
        "load_s": 28.0,
        "startup_s": {"total": 28.0, "build": 1.0, "tune": 25.0},
    }
    merged = merge_stats([a, b])
    assert merged["rows_generated"] == 12 and merged["load_s"] == 30.0
    assert merged["startup_s"] == {"total": 30.0, "build": 20.0, "tune": 25.0}


class _Recorder(Display):
    def __init__(self) -> None:
        super().__init__(io.StringIO())
        self.phases: list[tuple[str, str, float | None]] = []

    def phase(self, kind: str, text: str, seconds: float | None) -> None:
        self.phases.append((kind, text, seconds))


def test_a_run_hears_its_engines_phases_and_keeps_their_seconds(
    tmp_path: Path, chat_model: Path
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"hi {i}"}) + "\n" for i in range(3)))
    layout = OutputLayout.build(str(src), None, None)
    layout.prepare()
    config = EngineConfig(
        model=str(chat_model),
        load_format="dummy",
        device="cpu",
        kv_cache_memory=16 << 20,
        num_threads=1,
    )
    plan = RunPlan(str(src), ColumnSpec(), layout, config, SamplingParams(max_tokens=2))
    display = _Recorder()
    ready: list[dict[str, float]] = []
    result = generate_part(
        plan,
        plan.row_filter,
        display,
        StopFlag(),
        on_ready=lambda describe, startup, done: ready.append(startup),
    )
    assert result.completed
    loads = [(text, seconds is None) for kind, text, seconds in display.phases if kind == LOAD]
    assert loads == [
        ("loading model cbgen-run-tiny-chat", True),
        ("loading model cbgen-run-tiny-chat", False),
        ("preparing the model for cpu", True),
        ("preparing the model for cpu", False),
    ]
    startup = result.stats["startup_s"]
    assert ready == [startup]
    assert set(startup) == {"total", "build", "tune", "load", "other"}
    assert startup["total"] == result.stats["load_s"] > 0
    assert startup["tune"] == 0.0  # CBGEN_CPU_TUNING=off in the suite
    assert 0 < startup["load"] <= startup["total"]
    assert abs(sum(v for k, v in startup.items() if k != "total") - startup["total"]) < 1e-6

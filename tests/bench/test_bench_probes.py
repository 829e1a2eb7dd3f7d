"""`cbgen bench`'s views inside a run (cbgen.bench.probes, cbgen.bench.structured): --profile's
window of steps, --alternate's two paths two steps at a time, --structured's JSON schema; the
switching on a stand-in runtime, then each end to end on the tiny-llama shape."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from cbgen.bench.command import Column, bench, run_bench
from cbgen.bench.probes import AlternateSpec, Alternation, parse_alternate
from cbgen.bench.runner import StepRecord
from cbgen.bench.structured import parse_structured
from cbgen.config import EngineConfig
from cbgen.cpu import build, head_kernels
from cbgen.engine.engine import Engine
from cbgen.runtime.cpu_linear import CpuThresholds

TINY = [
    "--model", "tiny-llama", "--load-format", "dummy", "--num-threads", "1",
    "--kv-cache-memory", "1MiB", "--num-warmup", "0", "--workload", "random",
    "--range-ratio", "0", "--max-num-seqs", "2",
]  # fmt: skip
NO_KERNELS = pytest.mark.skipif(build.load_library() is None, reason=build.native_status())


def invoke(*args: str, code: int = 0) -> Any:
    app = typer.Typer()
    app.command()(bench)
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == code, (result.output, result.exception)
    return result


def step(prefill: int, decode: int, duration_s: float) -> StepRecord:
    return StepRecord(
        t_s=0.0, duration_s=duration_s, num_running=decode, num_scheduled=decode, num_waiting=0,
        num_kv_blocks_used=0, num_kv_blocks_total=1, num_prefill_tokens=prefill,
        num_decode_tokens=decode, num_cached_tokens=0, num_preempted=0,
    )  # fmt: skip


# ---- the switching, on a stand-in runtime ----------------------------------------------------
def cpu_runtime(**fields: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(
        name="cpu", exact_head=None, decoder=object(), thresholds=CpuThresholds(64, 96)
    )
    return SimpleNamespace(**(base | fields))


class FakeHead:
    pass


@pytest.mark.parametrize(
    ("spec", "attribute", "own", "other"),
    [
        ("exact_head", "exact_head", "head", None),
        ("decoder", "decoder", "decoder", None),
        ("small_gemm_max_rows=1", "small_gemm_max_rows", 64, 1),
        ("blocked-rows=7", "blocked_rows", 96, 7),
    ],
)
def test_alternation_takes_each_path_two_steps_at_a_time_and_puts_the_engines_back(
    spec: str, attribute: str, own: Any, other: Any
) -> None:
    head, decoder = FakeHead(), object()
    runtime = cpu_runtime(exact_head=head, decoder=decoder)
    own = {"head": head, "decoder": decoder}.get(own, own)
    holder = runtime.thresholds if attribute.endswith("rows") else runtime
    alternation = Alternation(runtime, parse_alternate(spec))  # type: ignore[arg-type]
    seen = []
    for i in range(7):
        alternation.before_step(i)
        seen.append(getattr(holder, attribute))
    assert seen == [own, own, other, other, own, own, other]
    assert alternation.flags == [True, True, False, False, True, True, False]
    alternation.finish()
    assert getattr(holder, attribute) == own


def test_alternation_labels_and_figures_each_paths_steps() -> None:
    runtime = cpu_runtime(exact_head=FakeHead())
    alternation = Alternation(runtime, AlternateSpec("exact_head"))  # type: ignore[arg-type]
    # steps 0-1 and 4-5 the exact head, 2-3 and 6 the float32 one
    steps = [
        step(20, 0, 1.0), step(0, 4, 0.1), step(10, 2, 0.6), step(0, 4, 0.3),
        step(0, 4, 0.2), step(0, 3, 0.1), step(0, 4, 0.5),
    ]  # fmt: skip
    for i in range(len(steps)):
        alternation.before_step(i)
    s = alternation.summary(steps)
    assert (s["with"], s["without"], s["decode_batch"]) == ("FakeHead", "float32 head", 4)
    exact, f32 = s["sides"]["FakeHead"], s["sides"]["float32 head"]
    assert (exact["steps"], exact["decode_steps_at_batch"], exact["prompt_steps"]) == (4, 2, 1)
    assert exact["decode_step_median_s"] == pytest.approx(0.15)  # of 0.1 and 0.2
    assert exact["decode_tokens_per_s"] == pytest.approx(11 / 0.4)
    assert exact["prompt_steps_tokens_per_s"] == pytest.approx(20.0)
    assert (f32["steps"], f32["decode_steps_at_batch"], f32["prompt_steps"]) == (3, 2, 1)
    assert f32["decode_step_median_s"] == pytest.approx(0.4)
    assert f32["prompt_steps_tokens_per_s"] == pytest.approx(12 / 0.6)
    text = Alternation.report("continuous", s)
    assert "FakeHead: decode step at batch 4 median 150.00 ms (2 steps)" in text
    assert "float32 head / FakeHead decode step: 2.667x" in text


@pytest.mark.parametrize(
    ("runtime", "spec", "message"),
    [
        (cpu_runtime(), "exact_head", "no exact LM head"),
        (cpu_runtime(decoder=None), "decoder", "no one-call decoder"),
        (SimpleNamespace(name="torch", exact_head=None), "decoder", "a path of the CPU runtime"),
        (SimpleNamespace(name="cuda", exact_head=None), "blocked_rows=4", "this one is cuda"),
        (cpu_runtime(thresholds=CpuThresholds(0)), "small_gemm_max_rows=8", "no CPU kernels"),
        (cpu_runtime(), "blocked_rows=96", "96 is this engine's own"),
    ],
)
def test_alternation_refuses_a_path_the_runtime_lacks(
    runtime: SimpleNamespace, spec: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Alternation(runtime, parse_alternate(spec))  # type: ignore[arg-type]


def test_alternate_and_structured_options_are_parsed_or_refused(tmp_path: Path) -> None:
    assert parse_alternate("decoder") == AlternateSpec("decoder")
    assert parse_alternate("small-gemm-max-rows=256") == AlternateSpec("small_gemm_max_rows", 256)
    for bad, message in (
        ("head", "not a path to alternate"),
        ("decoder=2", "takes no value"),
        ("blocked_rows", "needs a row count"),
        ("blocked_rows=x", "needs a row count"),
        ("small_gemm_max_rows=0", "must be >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_alternate(bad)
    half = parse_structured("json", 0.5)
    assert [half.constrained(i) for i in range(6)] == [False, True] * 3
    third = parse_structured("json", 1 / 3)
    assert [i for i in range(9) if third.constrained(i)] == [2, 5, 8]
    assert all(parse_structured("json", 1.0).constrained(i) for i in range(5))
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text("{")
    for source, share, message in (
        ("json", 0.0, "must be in"),
        ("json", 1.5, "must be in"),
        ("yaml", 1.0, "is neither"),
        (str(tmp_path / "list.json"), 1.0, "is an object"),
        (str(tmp_path / "broken.json"), 1.0, "not valid JSON"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_structured(source, share)


def test_bench_refuses_bad_probe_options_with_its_usage_exit_code(tmp_path: Path) -> None:
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "string", "pattern": "("}')  # does not compile
    # the last two are found once the model is loaded, before any run
    for args, message in (
        (["--profile", "perf"], "profile: must be one of torch, cprofile"),
        (["--profile", "torch", "--profile-steps", "0"], "profile_steps: must be >= 1"),
        (["--profile", "torch", "--profile-after", "-1"], "profile_after: must be >= 0"),
        (["--alternate", "heads"], "alternate: 'heads' is not a path"),
        (["--structured-share", "0.5"], "structured_share: needs --structured"),
        (["--structured", str(schema)], "structured_outputs: the json does not compile"),
        (
            ["--alternate", "exact_head", "--dtype", "bfloat16"],
            "alternate: exact_head: this engine has no exact LM head",
        ),
    ):
        result = invoke(*TINY, "--num-prompts", "1", *args, code=2)
        assert f"error: {message}" in result.output, (args, result.output)


# ---- end to end --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["cprofile", "torch"])
def test_bench_profiles_a_window_of_the_timed_steps(kind: str, tmp_path: Path) -> None:
    js = tmp_path / "b.json"
    result = invoke(
        *TINY, "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
        "--profile", kind, "--profile-after", "1", "--profile-steps", "5", "--output-json", str(js),
    )  # fmt: skip
    # Step 0 prefills both prompts (and samples their first tokens), steps 1-2 decode both: the
    # run ends inside the window, which then covers the two decode steps.
    profile = json.loads(js.read_text())["results"]["continuous"]["profile"]
    assert {k: profile[k] for k in ("kind", "first_step", "steps", "decode_tokens")} == {
        "kind": kind,
        "first_step": 1,
        "steps": 2,
        "decode_tokens": 4,
    }
    assert profile["prefill_tokens"] == 0 and profile["seconds"] > 0
    assert f"profile of continuous ({kind}): steps 1-2 of the timed run" in result.output
    table = "function calls" if kind == "cprofile" else "Self CPU time total"
    assert table in result.output


def test_bench_profile_after_the_runs_end_profiles_nothing_and_says_so() -> None:
    result = invoke(
        *TINY, "--num-prompts", "1", "--input-len", "4", "--output-len", "2",
        "--profile", "cprofile", "--profile-after", "50",
    )  # fmt: skip
    assert "the run ended before step 50; nothing profiled" in result.output


def force_exact_head(head: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime made to give models the exact LM head `head` ("Bf16Head" or "Int16Head"),
    whichever this CPU's flags, build and tuning would choose; skipped where it cannot run."""
    from cbgen.cpu import tuning
    from cbgen.cpu.linear import bf16_matmul_supported
    from cbgen.runtime import cpu as cpu_runtime

    if build.load_library() is None:
        pytest.skip(build.native_status())
    if head == "Bf16Head" and not bf16_matmul_supported():
        pytest.skip("no oneDNN bf16 matmul on this CPU (AVX-512 needed)")
    if head == "Int16Head" and not head_kernels.head_i16_available():
        pytest.skip("no int16 head in this build (x86-64 with AVX2)")
    monkeypatch.setattr(cpu_runtime, "bf16_matmul_fast", lambda: head == "Bf16Head")
    tuned = tuning.for_this_machine()
    assert tuned is not None
    forced = dataclasses.replace(tuned, int16_head=head == "Int16Head")
    monkeypatch.setattr(tuning, "for_this_machine", lambda: forced)


@pytest.mark.parametrize(
    ("spec", "with_it", "without"),
    [
        pytest.param("exact_head", "Bf16Head", "float32 head", id="head-bf16"),
        pytest.param("exact_head", "Int16Head", "float32 head", id="head-int16"),
        pytest.param("decoder", "one C call", "Python forward", marks=NO_KERNELS),
        pytest.param(
            "blocked_rows=1",
            r"row blocks from \d+ rows",
            "row blocks from 1 rows",
            marks=NO_KERNELS,
        ),
        pytest.param(
            "small_gemm_max_rows=1",
            r"small_gemm up to \d+ rows",
            "small_gemm up to 1 rows",
            marks=NO_KERNELS,
        ),
    ],
)
def test_bench_alternates_two_paths_of_a_real_engine(
    spec: str,
    with_it: str,
    without: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The exact LM heads (each forced) against the float32 one; the forward pass in one C call
    against the Python one; small_gemm's thresholds against one row."""
    if spec == "exact_head":
        force_exact_head(with_it, monkeypatch)
    config = EngineConfig(
        model="tiny-llama", load_format="dummy", num_threads=1, kv_cache_memory=1 << 20,
        max_num_seqs=2,
    )  # fmt: skip
    engine = Engine(config)
    runtime = engine.runtime
    before = (runtime.exact_head, getattr(runtime, "decoder", None))
    thresholds = copy.copy(getattr(runtime, "thresholds", None))
    options = dict(num_prompts=2, seed=0, input_len=8, output_len=9, range_ratio=0.0)
    doc = run_bench(
        "random", options, config, [Column("continuous", "continuous", {})], num_warmup=0,
        weights=engine, alternate=parse_alternate(spec),
    )  # fmt: skip
    out = capsys.readouterr().out
    # steps 0-1 with it, 2-3 without, ...: the prompts' step (0) went to the engine's own path,
    # and of the 8 decode steps at batch 2 (1-8), 4 each
    s = doc["results"]["continuous"]["alternation"]
    assert re.fullmatch(with_it, s["with"]) and s["without"] == without and s["decode_batch"] == 2
    mine, other = s["sides"][s["with"]], s["sides"][without]
    assert (mine["steps"], mine["prompt_steps"], mine["decode_steps_at_batch"]) == (5, 1, 4)
    assert (other["steps"], other["prompt_steps"], other["decode_steps_at_batch"]) == (4, 0, 4)
    for label in (with_it, without):
        assert re.search(rf"  {label}: decode step at batch 2 median [\d.]+ ms \(4 steps\)", out)
    # the shared runtime has its own paths back
    assert (runtime.exact_head, getattr(runtime, "decoder", None)) == before
    assert getattr(runtime, "thresholds", None) == thresholds


def test_bench_structured_constrains_the_share_of_requests_it_is_given(tmp_path: Path) -> None:
    schema, js, pqt = tmp_path / "bool.json", tmp_path / "b.json", tmp_path / "b.parquet"
    schema.write_text('{"type": "boolean"}')
    invoke(
        *TINY, "--num-prompts", "4", "--input-len", "6", "--output-len", "12",
        "--structured", str(schema), "--structured-share", "0.5",
        "--output-json", str(js), "--output-parquet", str(pqt),
    )  # fmt: skip
    doc = json.loads(js.read_text())
    assert doc["workload"]["structured"] == {
        "schema": str(schema),
        "share": 0.5,
        "constrained_requests": 2,
    }
    rows = pq.read_table(pqt).to_pylist()
    assert [r["id"] for r in rows] == [f"random-{i}" for i in range(4)]
    # Requests 1 and 3 answer true or false (at most 6 tokens of this vocabulary) and stop;
    # 0 and 2 run to their length, EOS ignored as always
    for i, r in enumerate(rows):
        if i % 2:
            assert r["finish_reason"] == "stop" and 1 <= r["output_tokens"] <= 6, r
        else:
            assert r["finish_reason"] == "length" and r["output_tokens"] == 12, r
    result = doc["results"]["continuous"]
    assert result["output_tokens"] == sum(r["output_tokens"] for r in rows)


def test_bench_structured_json_runs_the_benchs_own_schema(tmp_path: Path) -> None:
    js = tmp_path / "b.json"
    invoke(
        *TINY, "--num-prompts", "2", "--input-len", "6", "--output-len", "8",
        "--structured", "json", "--output-json", str(js),
    )  # fmt: skip
    doc = json.loads(js.read_text())
    assert doc["workload"]["structured"]["constrained_requests"] == 2
    assert doc["results"]["continuous"]["num_errors"] == 0

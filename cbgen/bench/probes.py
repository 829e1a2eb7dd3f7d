"""What `cbgen bench` can watch inside a timed run: step hooks (runner.StepHook).

  StepProfiler  --profile torch|cprofile: torch's profiler or cProfile over a window of the
                run's steps (--profile-after, --profile-steps); its table is printed after
                the bench's, and the run's figures include the slowed steps
  Alternation   --alternate PATH: the runtime's own path and another, two steps each in turn,
                in one run. A neighbour's burst or the machine's drift then falls on both, so
                their step times compare where two runs on a shared machine would not:

        step   0  1  2  3  4  5  6  7  8 ...
        path   A  A  B  B  A  A  B  B  A       A: the runtime's (with), B: the alternative

The alternation reads the runtime only through what it states (engine.runtime: exact_head; on
the CPU decoder and thresholds), and puts the runtime's own path back when the run ends: the
engines of a bench share one runtime.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cbgen.bench.runner import RunResult, StepHook, StepRecord
from cbgen.engine.outputs import StepStats

if TYPE_CHECKING:  # the bench reads the engine's runtime, it does not import the package
    from cbgen.runtime.base import Runtime

PROFILERS = ("torch", "cprofile")
PROFILE_ROWS = 30
"""Rows of the profile's table: torch's ops by self time, or cProfile's calls by tottime."""

ALTERNATES = ("exact_head", "decoder", "small_gemm_max_rows", "blocked_rows")
"""--alternate's paths; the last two, the CpuThresholds fields, take =ROWS (docs/BENCH.md)."""


@dataclass(frozen=True)
class ProfileSpec:
    """--profile, --profile-steps, --profile-after; ValueError naming what is wrong."""

    kind: str
    steps: int = 10
    after: int = 10

    def __post_init__(self) -> None:
        if self.kind not in PROFILERS:
            raise ValueError(f"profile: must be one of {', '.join(PROFILERS)}, got {self.kind!r}")
        if self.steps < 1:
            raise ValueError(f"profile_steps: must be >= 1, got {self.steps}")
        if self.after < 0:
            raise ValueError(f"profile_after: must be >= 0, got {self.after}")


class StepProfiler:
    """torch's profiler (ops; CUDA kernels too on a GPU) or cProfile (Python calls, the C
    kernels by call site) over steps [after, after + steps) of a timed run, or those of them
    the run had."""

    def __init__(self, spec: ProfileSpec, cuda: bool = False) -> None:
        self.kind, self.after, self.steps, self.cuda = spec.kind, spec.after, spec.steps, cuda
        self.seen: list[StepStats] = []
        self.table = ""
        self._torch: torch.profiler.profile | None = None
        self._cprofile: cProfile.Profile | None = None

    def before_step(self, index: int) -> None:
        if index != self.after:
            return
        if self.kind == "torch":
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch = torch.profiler.profile(activities=activities)
            self._torch.__enter__()
        else:
            self._cprofile = cProfile.Profile()
            self._cprofile.enable()

    def after_step(self, index: int, stats: StepStats) -> None:
        if self._torch is None and self._cprofile is None:
            return
        if index + 1 == self.after + self.steps:
            self._stop()  # first: what follows is not the step's
        self.seen.append(stats)

    def finish(self) -> None:
        self._stop()  # the run ended inside the window

    def _stop(self) -> None:
        if self._torch is not None:
            self._torch.__exit__(None, None, None)
            sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
            self.table = self._torch.key_averages().table(sort_by=sort, row_limit=PROFILE_ROWS)
            self._torch = None
        if self._cprofile is not None:
            self._cprofile.disable()
            out = io.StringIO()
            stats = pstats.Stats(self._cprofile, stream=out)
            stats.sort_stats("tottime").print_stats(PROFILE_ROWS)
            self.table = out.getvalue()
            self._cprofile = None

    def summary(self) -> dict[str, Any]:
        """The profiled window, for the JSON (the table is printed, not kept)."""
        return {
            "kind": self.kind,
            "first_step": self.after,
            "steps": len(self.seen),
            "decode_tokens": sum(s.num_decode_tokens for s in self.seen),
            "prefill_tokens": sum(s.num_prefill_tokens for s in self.seen),
            "seconds": sum(s.duration_s for s in self.seen),
        }

    def report(self, label: str) -> str:
        """A heading and the table (or why there is none)."""
        if not self.seen:
            return (
                f"profile of {label}: the run ended before step {self.after}; nothing profiled "
                "(lower --profile-after)"
            )
        s = self.summary()
        last = self.after + s["steps"] - 1
        return (
            f"profile of {label} ({self.kind}): steps {self.after}-{last} of the timed run, "
            f"{s['prefill_tokens']} prompt + {s['decode_tokens']} decode tokens, "
            f"{s['seconds']:.3f} s\n{self.table}"
        )


@dataclass(frozen=True)
class AlternateSpec:
    name: str
    """A key of ALTERNATES."""
    rows: int | None = None
    """The alternative's row count (the two thresholds)."""


def parse_alternate(text: str) -> AlternateSpec:
    """'exact_head', 'decoder', 'small_gemm_max_rows=256' or 'blocked_rows=1' ('-' for '_'
    too); ValueError naming what is wrong."""
    name, sep, value = text.partition("=")
    name = name.strip().replace("-", "_")
    paths = "exact_head, decoder, small_gemm_max_rows=ROWS, blocked_rows=ROWS"
    if name not in ALTERNATES:
        raise ValueError(f"alternate: {name!r} is not a path to alternate; one of {paths}")
    if name in ("exact_head", "decoder"):
        if sep:
            raise ValueError(f"alternate: {name} takes no value, got {text!r}")
        return AlternateSpec(name)
    try:
        rows = int(value)
    except ValueError:
        raise ValueError(
            f"alternate: {name} needs a row count, {name}=ROWS; got {text!r}"
        ) from None
    if rows < 1:
        raise ValueError(f"alternate: {name}: ROWS must be >= 1, got {rows}")
    return AlternateSpec(name, rows)


class Alternation:
    """Steps 0-1 of a timed run take the runtime's own path, steps 2-3 the alternative, and so
    on (flags[i]: step i took the runtime's own). ValueError where the runtime has no such
    path: the engine's device, dtype, model or build decides what it has."""

    def __init__(self, runtime: Runtime, spec: AlternateSpec) -> None:
        self.spec = spec
        self.flags: list[bool] = []
        self.set_path: Callable[[bool], None]
        cpu_only = (
            f"alternate: {spec.name} is a path of the CPU runtime; this one is {runtime.name}"
        )
        if spec.name == "exact_head":
            head = runtime.exact_head
            if head is None:
                raise ValueError(
                    "alternate: exact_head: this engine has no exact LM head (one takes float32 "
                    "weights, the CPU kernels, and bf16 dot products or the int16 head where "
                    "the tuning chose it)"
                )
            self.set_path = _switch(runtime, "exact_head")
            self.labels = (type(head).__name__, "float32 head")
        elif spec.name == "decoder":
            if runtime.name != "cpu":
                raise ValueError(cpu_only)
            if getattr(runtime, "decoder", None) is None:
                raise ValueError(
                    "alternate: decoder: this engine has no one-call decoder (it needs the CPU "
                    "kernels, float32 weights and a Llama- or Gemma-type model)"
                )
            self.set_path = _switch(runtime, "decoder")
            self.labels = ("one C call", "Python forward")
        else:
            thresholds = getattr(runtime, "thresholds", None)
            if thresholds is None:
                raise ValueError(cpu_only)
            tuned = int(getattr(thresholds, spec.name))
            if tuned == 0:
                raise ValueError(f"alternate: {spec.name}: no CPU kernels in this engine")
            if tuned == spec.rows:
                raise ValueError(
                    f"alternate: {spec.name}: {tuned} is this engine's own; give another row count"
                )
            other = spec.rows

            def set_rows(on: bool) -> None:
                setattr(thresholds, spec.name, tuned if on else other)

            self.set_path = set_rows
            label = (
                "small_gemm up to {} rows"
                if spec.name == "small_gemm_max_rows"
                else "row blocks from {} rows"
            )
            self.labels = (label.format(tuned), label.format(other))

    def before_step(self, index: int) -> None:
        self.flags.append(index // 2 % 2 == 0)
        self.set_path(self.flags[-1])

    def after_step(self, index: int, stats: StepStats) -> None:
        pass

    def finish(self) -> None:
        self.set_path(True)

    def summary(self, steps: Sequence[StepRecord]) -> dict[str, Any]:
        """Each path's figures over the steps that took it: the median decode-only step at the
        run's largest decode batch, decode tokens/s over every decode-only step, and tokens/s
        over the steps with prompt tokens in them."""
        decodes = [s for s in steps if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
        batch = max((s.num_decode_tokens for s in decodes), default=0)
        sides = {}
        for label, on in zip(self.labels, (True, False), strict=True):
            mine = [s for s, f in zip(steps, self.flags, strict=True) if f is on]
            dec = [s for s in mine if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
            full = [s.duration_s for s in dec if s.num_decode_tokens == batch]
            prompt = [s for s in mine if s.num_prefill_tokens > 0]
            sides[label] = {
                "steps": len(mine),
                "decode_steps_at_batch": len(full),
                "decode_step_median_s": statistics.median(full) if full else None,
                "decode_tokens_per_s": _rate(dec),
                "prompt_steps": len(prompt),
                "prompt_steps_tokens_per_s": _rate(prompt),
            }
        return {
            "path": self.spec.name,
            "alternative_rows": self.spec.rows,
            "decode_batch": batch,
            "with": self.labels[0],
            "without": self.labels[1],
            "sides": sides,
        }

    @staticmethod
    def report(label: str, summary: dict[str, Any]) -> str:
        """Lines for the terminal: each path's figures, then their ratio."""
        lines = [
            f"{label}: steps alternate two at a time between {summary['with']} (the engine's) "
            f"and {summary['without']}"
        ]
        sides = summary["sides"]
        for name, s in sides.items():
            median = s["decode_step_median_s"]
            step = "-" if median is None else f"{1e3 * median:.2f} ms"
            lines.append(
                f"  {name}: decode step at batch {summary['decode_batch']} median {step} "
                f"({s['decode_steps_at_batch']} steps), decode {_fmt(s['decode_tokens_per_s'])}"
                f" tokens/s, steps with prompt tokens {_fmt(s['prompt_steps_tokens_per_s'])}"
                f" tokens/s ({s['prompt_steps']} steps)"
            )
        a, b = (s["decode_step_median_s"] for s in sides.values())
        if a and b:
            lines.append(f"  {summary['without']} / {summary['with']} decode step: {b / a:.3f}x")
        return "\n".join(lines)


def _rate(steps: Sequence[StepRecord]) -> float | None:
    """Tokens (prompt and decode) per second over the steps; None without any."""
    seconds = sum(s.duration_s for s in steps)
    tokens = sum(s.num_prefill_tokens + s.num_decode_tokens for s in steps)
    return tokens / seconds if seconds > 0 else None


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def _switch(holder: object, attribute: str) -> Callable[[bool], None]:
    """Sets holder.attribute to its present value (on) or None (off)."""
    value = getattr(holder, attribute)

    def set_it(on: bool) -> None:
        setattr(holder, attribute, value if on else None)

    return set_it


class Probes:
    """The hooks of one column's timed run, and what they add to its figures after it."""

    def __init__(
        self,
        runtime: Runtime,
        cuda: bool,
        profile: ProfileSpec | None,
        alternate: AlternateSpec | None,
    ) -> None:
        self.profiler = None if profile is None else StepProfiler(profile, cuda)
        self.alternation = None if alternate is None else Alternation(runtime, alternate)
        self.hooks: list[StepHook] = [h for h in (self.profiler, self.alternation) if h is not None]

    def collect(self, run: RunResult) -> str:
        """Adds the figures to run.extra (the JSON's results); returns the text to print."""
        texts = []
        if self.profiler is not None:
            run.extra["profile"] = self.profiler.summary()
            texts.append(self.profiler.report(run.label))
        if self.alternation is not None:
            summary = self.alternation.summary(run.steps)
            run.extra["alternation"] = summary
            texts.append(Alternation.report(run.label, summary))
        return "\n".join(texts)

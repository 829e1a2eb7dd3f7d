"""The GPU check: correctness and speed of cbgen on one CUDA GPU, offline, in at most 6 minutes.

    PYTHONPATH=. python3 -m tools.gpu_check                 (make gpu-check)
    PYTHONPATH=. python3 -m tools.gpu_check --device cpu --quick      toy shapes, Triton
                                                            interpreter: the script's smoke test

It needs only what the GPU machine has: torch, triton, transformers, safetensors, pytest (no
network, no model files, nothing installed). Models are random-weight checkpoints built on the
spot. The sections (tools/gpu_correctness.py, tools/gpu_speed.py) run in order, each within its own time budget (a
section past it is interrupted; one whose turn comes after the total budget is spent is
skipped), each catching its own failure. After every section the results file is rewritten, so
a run cut short still leaves what it measured:

    docs/measurements/gpu_check_<commit>.json
        device, commit, sections: {name: {passed, seconds, figures}},
        vs_transformers_cb, roofline_ratio_8b_b256, targets: {name: {value, target, met}}

Exit status 0 when every section passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOTAL_BUDGET_S = 300.0
"""Five minutes for the sections, of the six a run may take: a minute is left for start-up
(imports, CUDA context), the final write and slack."""


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument(
        "--quick", action="store_true", help="toy shapes and sizes (the CPU smoke test)"
    )
    ap.add_argument(
        "--budget-s", type=float, default=TOTAL_BUDGET_S, help="total seconds for all sections"
    )
    ap.add_argument("--only", nargs="+", metavar="SECTION", help="run these sections only")
    ap.add_argument(
        "--output",
        type=Path,
        help="results file (default docs/measurements/gpu_check_<commit>.json)",
    )
    ap.add_argument("--commit", help="the commit to name the results by, where git is missing")
    ap.add_argument(
        "--plan",
        action="store_true",
        help="print each section's time budget and the Triton variants it compiles; run nothing",
    )
    return ap.parse_args(argv)


def _environment(device: str) -> None:
    """Before torch and triton are imported: the kernels run compiled on a GPU and in the
    Triton interpreter on the CPU; nothing may try the network."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(name, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers 5 may swap in kernels from the hub, which needs the network
    os.environ["USE_HUB_KERNELS"] = "0"


if __name__ == "__main__":
    _environment(_parse_args(sys.argv[1:]).device)

# cbgen_kernels from this checkout, here and in the processes the sections start (the GPU
# machine has no install: only the checkout on PYTHONPATH)
from tools import kernels_importable  # noqa: E402

kernels_importable(children=True)

import torch  # noqa: E402

from tools import gpu_correctness, gpu_plan, gpu_speed  # noqa: E402
from tools.gpu_context import CheckContext  # noqa: E402

# (name, section, share of the total budget in seconds); the shares sum to TOTAL_BUDGET_S
SECTIONS: list[tuple[str, Callable[[CheckContext], bool], float]] = [
    ("kernels", gpu_correctness.kernels, 15),
    ("greedy_fp32", gpu_correctness.greedy_fp32, 55),
    ("bf16_top1", gpu_correctness.bf16_top1, 20),
    ("sampling", gpu_correctness.sampling, 25),
    ("memory", gpu_speed.memory, 20),
    ("graphs", gpu_speed.graphs, 35),
    ("throughput", gpu_speed.throughput, 50),
    ("roofline_8b", gpu_speed.roofline_8b, 20),
    ("kernel_tests", gpu_correctness.kernel_tests, 60),
]
TARGETS = {
    # name: (where the value is, target, met)
    "smollm2_decode_b256_ms": (
        ("throughput", "decode_step_ms_b256_ctx512_graphs"),
        3.0,
        lambda v, t: v <= t,
    ),
    "roofline_ratio_8b_b256": (
        ("roofline_8b", "ratio_llama-8b_b256_ctx512"),
        1.5,
        lambda v, t: v <= t,
    ),
    "vs_transformers_cb": (("throughput", "vs_transformers_cb"), 5.0, lambda v, t: v >= t),
    "bf16_top1_agreement": (("bf16_top1", "agreement"), 0.99, lambda v, t: v >= t),
}


class SectionTimeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the block (SectionTimeout in the main thread) once `seconds` have passed."""

    def expire(signum: int, frame: Any) -> None:
        raise SectionTimeout(f"over its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def commit_name(given: str | None) -> str:
    """--commit, else git's short hash of HEAD, else "unknown"."""
    if given:
        return given
    try:
        res = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else "unknown"


def device_info(device: torch.device) -> dict[str, Any]:
    import transformers
    import triton

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(
            name=p.name,
            memory_gib=round(p.total_memory / (1 << 30), 1),
            sms=p.multi_processor_count,
            capability=f"sm_{p.major}{p.minor}",
        )
    else:
        info.update(name=platform.processor() or platform.machine(), cpus=os.cpu_count())
    return info


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The headline figures and the issue's targets, from the sections' figures."""
    out: dict[str, Any] = {}
    for name, ((section, key), target, met) in TARGETS.items():
        value = results["sections"].get(section, {}).get("figures", {}).get(key)
        judged = value is not None and not results["quick"]  # toy shapes say nothing of the targets
        out[name] = {
            "value": value,
            "target": target,
            "met": bool(met(value, target)) if judged else None,
        }
    greedy = results["sections"].get("greedy_fp32")
    passed = None if greedy is None or results["quick"] else greedy["passed"]
    out["fp32_greedy_token_exact"] = {"value": passed, "target": True, "met": passed}
    results["vs_transformers_cb"] = out["vs_transformers_cb"]["value"]
    results["roofline_ratio_8b_b256"] = out["roofline_ratio_8b_b256"]["value"]
    results["targets"] = out
    return results


def write(path: Path, results: dict[str, Any]) -> None:
    """Atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary(results), indent=2, default=str) + "\n")
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> int:
    if args.plan:
        print(plan_text(args))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here (use --device cpu --quick for the smoke test)",
            file=sys.stderr,
        )
        return 2
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    commit = commit_name(args.commit)
    path = args.output or ROOT / "docs" / "measurements" / f"gpu_check_{commit}.json"
    info = device_info(device)
    results: dict[str, Any] = {
        "device": info["name"],
        "commit": commit,
        "quick": args.quick,
        "env": info,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sections": {},
        "failed": {},
    }
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cbgen-gpu-check-") as folder:
        ctx = CheckContext(device, args.quick, Path(folder), log_prefix=path.with_suffix(""))
        for name, section, deadline in schedule(args):
            now = time.monotonic() - start
            limit = min(deadline, args.budget_s) - now
            record = run_section(ctx, section, limit)
            results["sections"][name] = record
            if not record["passed"]:
                results["failed"][name] = why(record)
            results["seconds"] = round(time.monotonic() - start, 1)
            write(path, results)
            _report(name, record)
    results["finished"] = True
    write(path, results)
    print(f"results: {path}")
    return 0 if all(r["passed"] for r in results["sections"].values()) else 1


def schedule(
    args: argparse.Namespace,
) -> list[tuple[str, Callable[[CheckContext], bool], float]]:
    """(name, section, deadline in seconds from the start) of each section to run: a section
    may run until the sum of its own share and those before it (scaled to --budget-s), so one
    that finishes early passes its time on."""
    chosen = [(n, f, share) for n, f, share in SECTIONS if not args.only or n in args.only]
    scale = args.budget_s / sum(share for _, _, share in chosen)
    out, total = [], 0.0
    for name, section, share in chosen:
        total += share * scale
        out.append((name, section, total))
    return out


def plan_text(args: argparse.Namespace) -> str:
    """--plan: each section with its budget and the Triton variants it is expected to compile
    (kernel and constexpr values), nothing run."""
    lines = [
        f"{len(SECTIONS)} sections, {args.budget_s:.0f} s in all "
        f"(a section may use what those before it left)"
    ]
    before = 0.0
    seen: set[str] = set()
    for name, _, deadline in schedule(args):
        compiles = gpu_plan.expected_compiles(name, args.quick)
        new = [c for c in compiles if c not in seen]
        seen.update(compiles)
        lines.append(
            f"{name:12s} {deadline - before:5.0f} s (until {deadline:3.0f} s)  "
            f"{len(new)} new Triton variants ({len(compiles) - len(new)} compiled before)"
        )
        lines += [f"    {c}" for c in new]
        before = deadline
    return "\n".join(lines)


def why(record: dict[str, Any]) -> str:
    """One line: why a section failed (its error, the budget it ran out of, or the checks
    whose verdict was false)."""
    if "skipped" in record:
        return f"skipped: {record['skipped']}"
    if "error" in record:
        return str(record["error"]).splitlines()[0][:300] if record["error"] else "error"
    false = _false_checks(record["figures"])
    return "checks false: " + (", ".join(false) if false else "(none named)")


def _false_checks(figures: Any, prefix: str = "") -> list[str]:
    out = []
    if isinstance(figures, dict):
        for k, v in figures.items():
            if v is False:
                out.append(prefix + str(k))
            else:
                out += _false_checks(v, f"{prefix}{k}.")
    return out


def run_section(
    ctx: CheckContext, section: Callable[[CheckContext], bool], limit: float
) -> dict[str, Any]:
    """{passed, seconds, figures} and, if it failed by an exception, the error and traceback.
    Whatever happens, the figures measured so far are kept."""
    if limit < 5:
        return {
            "passed": False,
            "skipped": f"{max(limit, 0):.0f} s of the budget left for it",
            "seconds": 0.0,
            "figures": {},
        }
    t0 = time.monotonic()
    ctx.start_section(limit)
    record: dict[str, Any]
    try:
        with _time_limit(limit):
            record = {"passed": bool(section(ctx))}
    except BaseException as e:  # a failing section is a result; the run goes on
        if isinstance(e, KeyboardInterrupt):
            raise
        record = {
            "passed": False,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(limit=-12),
        }
    record["figures"] = ctx.figures
    record["budget_s"] = round(limit, 1)
    try:  # after an illegal memory access even empty_cache raises
        ctx.free()
    except Exception as e:
        record["free_error"] = f"{type(e).__name__}: {e}"
    record["seconds"] = round(time.monotonic() - t0, 1)
    return record


def _report(name: str, record: dict[str, Any]) -> None:
    verdict = "PASS" if record["passed"] else ("SKIPPED" if "skipped" in record else "FAIL")
    detail = _brief(record["figures"]) if record["passed"] else why(record)
    print(f"{name:12s} {verdict:7s} {record['seconds']:6.1f} s  {detail}", flush=True)


def _brief(figures: dict[str, Any]) -> str:
    text = json.dumps(figures, default=str)
    return text if len(text) <= 160 else text[:157] + "..."


def main(argv: list[str] | None = None) -> int:
    return run(_parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())

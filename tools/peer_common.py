"""What every peer worker shares: the workload file, the timed window and the result file.

Imported by workers that run under different interpreters (this repo's .venv and the vLLM
venv), so it needs only the standard library and psutil.

Protocol: a worker is started from the repository root as `python -m tools.WORKER --workload
W.json --model DIR --out R.json [options]`, runs the workload once, and writes one JSON object
to R.json (see `Result`).
A worker that cannot run writes {"ok": false, "error": "..."} and exits 0, so one missing
peer never stops the comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Taken at import, i.e. right after the interpreter started: start-up times count from here.
PROCESS_START = time.perf_counter()


@dataclass(frozen=True)
class WorkItem:
    request_id: str
    prompt_token_ids: list[int]
    output_len: int


def load_workload(path: str | Path) -> list[WorkItem]:
    data = json.loads(Path(path).read_text())
    return [
        WorkItem(str(r["id"]), [int(t) for t in r["prompt_token_ids"]], int(r["output_len"]))
        for r in data["requests"]
    ]


def worker_args(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--workload", required=True, help="workload JSON written by compare_peers")
    p.add_argument(
        "--model",
        required=True,
        help="model folder (safetensors) or, for cbgen, '' for the default GGUF",
    )
    p.add_argument("--out", required=True, help="where to write the result JSON")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--batch-size", type=int, default=32, help="static batch size (transformers generate)"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="float32 or bfloat16 (cbgen, vLLM); vLLM also takes auto, its own default",
    )
    return p


def _busy_cpu_s() -> float:
    """System-wide CPU-seconds spent not idle, over every core."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _tree_cpu_s() -> float:
    """CPU-seconds of this process and all its live descendants (vLLM runs its engine in a child)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class TimedWindow:
    """Wall time of the measured run, and how many cores other processes kept busy meanwhile.

    other_cores = (system busy CPU-s - this process tree's CPU-s) / wall: near 0 on a quiet
    machine; about 1.0 means another process held one of the two cores for the whole run.
    """

    def __enter__(self) -> TimedWindow:
        self.busy0, self.tree0 = _busy_cpu_s(), _tree_cpu_s()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.t1 = time.perf_counter()
        self.elapsed_s = self.t1 - self.t0
        busy = _busy_cpu_s() - self.busy0
        own = _tree_cpu_s() - self.tree0
        self.own_cores = own / max(self.elapsed_s, 1e-9)
        self.other_cores = max(0.0, busy - own) / max(self.elapsed_s, 1e-9)


@dataclass
class Result:
    system: str
    ok: bool = True
    error: str | None = None
    detail: str = ""
    startup_s: float = 0.0
    """Process start to ready to take requests (imports, weights, warm-up)."""
    elapsed_s: float = 0.0
    """All requests submitted at once to the last one finished."""
    first_finished_s: float | None = None
    """Process start to the first finished request."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    """Useful output tokens (the requested exact lengths); padding rows of static batches are not counted."""
    own_cores: float = 0.0
    other_cores: float = 0.0
    peak_rss_gib: float = 0.0
    output_token_ids: list[list[int]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def _vm_hwm_kib(pid: int | str) -> int:
    """Peak resident set (VmHWM) of a live process, in KiB; 0 when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss_gib() -> float:
    """Peak resident memory of this process plus that of each live descendant (vLLM's engine
    core runs in a child), in GiB. Summing per-process peaks can only overstate the true peak."""
    import psutil

    kib = _vm_hwm_kib("self")
    for child in psutil.Process().children(recursive=True):
        kib += _vm_hwm_kib(child.pid)
    return kib / (1 << 20)


def fill_window(result: Result, w: TimedWindow) -> None:
    result.elapsed_s = w.elapsed_s
    result.own_cores = w.own_cores
    result.other_cores = w.other_cores


def check_lengths(result: Result, items: list[WorkItem]) -> None:
    """Every system must produce exactly the requested number of tokens per request."""
    got = [len(t) for t in result.output_token_ids]
    want = [it.output_len for it in items]
    if got != want:
        bad = sum(1 for g, w in zip(got, want, strict=False) if g != w) + abs(len(got) - len(want))
        raise RuntimeError(f"{bad} requests did not produce their exact output length")


def tpot_extra(tpots: list[float | None]) -> dict[str, float]:
    """A sequence's decode speed: the median over requests of the time per output token after
    the first (TPOT; None for a request of one token), and its inverse. Empty without a TPOT."""
    known = [t for t in tpots if t is not None and t > 0]
    if not known:
        return {}
    median = statistics.median(known)
    return {"tpot_median_s": median, "decode_tokens_per_s_per_sequence": 1.0 / median}


def reap_children(grace_s: float = 10.0) -> None:
    """End every process this worker started and that is still alive (vLLM's engine core and
    its workers spin on OpenMP threads if orphaned), politely first."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for c in children:
        with contextlib.suppress(psutil.Error):
            c.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for c in alive:
        with contextlib.suppress(psutil.Error):
            c.kill()


def run_worker(system: str, out: str, body: Callable[[Result], None]) -> None:
    """Run body(result), then write the result (or the error) to `out`."""
    result = Result(system=system)
    try:
        body(result)
        if not result.peak_rss_gib:
            result.peak_rss_gib = peak_rss_gib()
    except Exception as e:  # a failed peer is reported, never fatal
        traceback.print_exc()
        result.ok, result.error = False, f"{type(e).__name__}: {e}"
    Path(out).write_text(json.dumps(asdict(result)))
    reap_children()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: vLLM and transformers threads can hang it

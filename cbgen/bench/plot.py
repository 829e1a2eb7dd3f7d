"""The picture that explains continuous batching at a glance (matplotlib, the bench extra).

left:  slots in use over time, one line per run: continuous batching keeps its slots
       full as requests come and go; a static batch drains (its members finish one by
       one but hold their slots) before the next one starts
right: the distribution of time to first token (empirical CDF), one line per run
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cbgen.bench.runner import RunResult

_IDLE_S = 0.005
"""A gap between steps longer than this is drawn as idle."""


def write_plot(path: str | Path, runs: Sequence[RunResult], title: str = "") -> None:
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("--plot needs matplotlib: pip install 'cbgen[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_slots, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        # A step holds its slots from its start to its end; an idle engine (waiting for
        # arrivals) holds none.
        xs, ys = [0.0], [0]
        prev_end = 0.0
        for s in run.steps:
            begin = s.t_s - s.duration_s
            if begin - prev_end > _IDLE_S:
                xs += [prev_end, begin]
                ys += [0, 0]
            xs += [begin, s.t_s]
            ys += [s.num_running, s.num_running]
            prev_end = s.t_s
        xs.append(prev_end)
        ys.append(0)
        line = ax_slots.plot(xs, ys, lw=0.8, label=f"{run.label} ({run.slots} slots)")[0]
        ax_slots.axhline(run.slots, color=line.get_color(), ls=":", lw=0.8)
        ttft = sorted(r.ttft_s for r in run.requests if r.ttft_s is not None)
        if ttft:
            ax_ttft.step(
                ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=run.label
            )
    ax_slots.set_xlabel("time since start (s)")
    ax_slots.set_ylabel("requests in slots")
    ax_slots.set_title("slots in use")
    ax_slots.legend(loc="upper right", fontsize="small")
    ax_ttft.set_xlabel("time to first token (s)")
    ax_ttft.set_ylabel("share of requests")
    ax_ttft.set_title("TTFT distribution")
    ax_ttft.set_ylim(0, 1.02)
    ax_ttft.legend(loc="lower right", fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

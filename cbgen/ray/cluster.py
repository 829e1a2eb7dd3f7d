"""Which Ray cluster a run uses and how many engines it holds.

    --ray [local]        a cluster started for this run on this machine, stopped at its end
    --ray auto           the cluster this machine belongs to (`ray start`, RAY_ADDRESS, KubeRay)
    --ray HOST:PORT      that cluster's GCS; ray://HOST:10001 through Ray Client

Engines: one per GPU when the engine runs on CUDA (--device cuda, or auto on a cluster with
GPUs), else one per --cpus-per-engine CPUs of each node (by default all the CPUs of the smallest
node: an engine on the CPU is bound by memory bandwidth, so one per node serves best); the
engine's threads are its CPUs. --ray-engines asks for a number instead, which an autoscaling
cluster may grow to meet.
"""

from __future__ import annotations

import logging
import math
import re
import signal
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import psutil

from cbgen.config import EngineConfig

INSTALL_HINT = "pip install 'cbgen[ray]'"
LOCAL = "local"
_ADDRESS = re.compile(r"(ray://)?[^/\s]+:\d+")
"""HOST:PORT of a cluster's GCS, or ray://HOST:PORT through Ray Client."""
_LOCAL_OBJECT_STORE = 128 << 20
"""A local cluster's object store: rows and results are small, and a container's /dev/shm
often is too."""


class RayError(Exception):
    """The run cannot use the cluster (Ray missing, no connection, no room): fatal."""


def import_ray() -> ModuleType:
    """The ray module, or RayError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RayError(f"--ray needs Ray, which is not installed here: {INSTALL_HINT}") from None
    return ray


@dataclass(frozen=True)
class RayOptions:
    """How `cbgen run --ray` uses a cluster (recorded in the summary, not in the resume check:
    where rows are made does not change them)."""

    address: str = LOCAL
    cpus_per_engine: float | None = None
    """CPUs each engine reserves; None: a GPU engine 1, a CPU engine the smallest node's CPUs."""
    engines: int | None = None
    """None: as many as the cluster holds now."""

    @staticmethod
    def is_address(text: str) -> bool:
        """Whether a word after a bare --ray is its ADDRESS (or the run's INPUT, which may be a
        URL such as s3://bucket/rows.jsonl)."""
        return text in (LOCAL, "auto") or bool(_ADDRESS.fullmatch(text))


def connect(address: str) -> None:
    """ray.init for `address`; RayError when there is no cluster to be had."""
    ray = import_ray()
    options: dict[str, Any] = {
        "include_dashboard": False,
        "logging_level": logging.ERROR,  # not its notes on every start
        "log_to_driver": False,  # the engines' own prints would break the live view
    }
    if address == LOCAL:
        cores = len(psutil.Process().cpu_affinity() or [0]) or 1
        options.update(num_cpus=cores, object_store_memory=_LOCAL_OBJECT_STORE)
    # ray.init makes SIGTERM exit the process at once; the run's own handler flushes first
    before = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=address, **options)
    except Exception as e:
        what = "start a local Ray cluster" if address == LOCAL else f"connect to {address}"
        raise RayError(f"--ray: cannot {what}: {_first_line(e)}") from None
    finally:
        signal.signal(signal.SIGTERM, before)


def disconnect() -> None:
    """Leave the cluster (a local one stops)."""
    import ray

    ray.shutdown()


@dataclass(frozen=True)
class Placement:
    """What each engine actor asks the cluster for, and how many there are."""

    engines: int
    num_cpus: float
    num_gpus: float
    config: EngineConfig
    """The engine's config on its actor (device and threads set)."""

    def describe(self) -> str:
        each = (
            "one GPU"
            if self.num_gpus
            else f"{_number(self.num_cpus)} CPU{'s' if self.num_cpus != 1 else ''}"
        )
        return f"{self.engines} engine{'s' if self.engines != 1 else ''} of {each} each"


def place_engines(
    options: RayOptions, config: EngineConfig, nodes: list[dict[str, Any]]
) -> Placement:
    """Engines for `config` on the alive nodes of `ray.nodes()`; RayError when none fits."""
    resources = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    gpus = [int(r.get("GPU", 0)) for r in resources]
    cpus = [float(r.get("CPU", 0)) for r in resources]
    on_gpu = config.device == "cuda" or (config.device == "auto" and any(gpus))
    if config.device == "cuda" and not any(gpus):
        raise RayError("--device cuda: the Ray cluster has no GPU")
    if on_gpu:
        per = options.cpus_per_engine or 1.0
        fit = sum(g for g, c in zip(gpus, cpus, strict=True) if c >= per)
        placed = config
    else:
        per = options.cpus_per_engine or _cpus_each(cpus, options.engines)
        fit = sum(math.floor(c / per) for c in cpus) if per else 0
        threads = config.num_threads or max(1, math.floor(per))
        placed = config.replace(device="cpu", num_threads=threads)
    engines = options.engines or fit
    if engines < 1 or per <= 0:
        shown = ", ".join(
            f"{_number(c)} CPUs" + (f" {g} GPUs" if g else "")
            for c, g in zip(cpus, gpus, strict=True)
        )
        raise RayError(
            f"the Ray cluster has no room for an engine of {_number(per)} CPUs"
            f"{' and one GPU' if on_gpu else ''} (nodes: {shown or 'none'}); lower "
            "--cpus-per-engine, add nodes, or give --ray-engines to wait for an autoscaler"
        )
    return Placement(engines, per, 1.0 if on_gpu else 0.0, placed)


def _cpus_each(cpus: list[float], engines: int | None) -> float:
    """A CPU engine's default share: the smallest node's CPUs, or with a number of engines
    asked for, the cluster's CPUs split between them (one CPU at least, a node at most)."""
    whole = [c for c in cpus if c >= 1]
    if not whole:
        return 1.0 if engines else 0.0  # nothing to split yet: an autoscaler adds nodes
    if engines is None:
        return min(whole)
    return float(min(max(1, math.floor(sum(whole) / engines)), math.floor(max(whole))))


def _number(x: float) -> str:
    return f"{x:g}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]

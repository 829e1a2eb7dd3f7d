"""How --ray reads its ADDRESS and sizes its engines, and what it says without Ray: no cluster
needed (the nodes are ray.nodes()'s records, written out)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.cli import cli_env, tiny, write_jsonl

from cbgen.config import EngineConfig
from cbgen.ray.cluster import INSTALL_HINT, RayError, RayOptions, import_ray, place_engines
from cbgen.run_options import bare_ray_flag


def _nodes(*resources: dict[str, float], dead: int = 0) -> list[dict[str, Any]]:
    alive = [{"Alive": True, "Resources": r} for r in resources]
    return alive + [{"Alive": False, "Resources": {"CPU": 64.0}}] * dead


def test_a_bare_ray_flag_means_a_local_cluster() -> None:
    assert bare_ray_flag(["in.jsonl", "--ray"]) == ["in.jsonl", "--ray", "local"]
    assert bare_ray_flag(["--ray", "in.jsonl"]) == ["--ray", "local", "in.jsonl"]
    assert bare_ray_flag(["in", "--ray", "-q"]) == ["in", "--ray", "local", "-q"]
    for address in ("auto", "local", "10.0.0.1:6379", "ray://head:10001"):
        assert bare_ray_flag(["in", "--ray", address]) == ["in", "--ray", address]
    assert bare_ray_flag(["in", "--ray=auto"]) == ["in", "--ray=auto"]
    for url in ("s3://bucket/in.jsonl", "https://host:8443/in.jsonl"):  # the INPUT
        assert bare_ray_flag(["--ray", url]) == ["--ray", "local", url]


def test_cpu_engines_take_a_node_or_the_cpus_asked_for() -> None:
    cpu = EngineConfig(device="auto")
    one = place_engines(RayOptions(), cpu, _nodes({"CPU": 2.0}, dead=1))
    assert (one.engines, one.num_cpus, one.num_gpus) == (1, 2.0, 0.0)
    assert (one.config.device, one.config.num_threads) == ("cpu", 2)
    assert one.describe() == "1 engine of 2 CPUs each"
    two = place_engines(RayOptions(cpus_per_engine=1), cpu, _nodes({"CPU": 2.0}))
    assert (two.engines, two.config.num_threads) == (2, 1)
    mixed = place_engines(RayOptions(), cpu, _nodes({"CPU": 16.0}, {"CPU": 8.0}))
    assert (mixed.engines, mixed.num_cpus) == (3, 8.0)  # engines of the smallest node's size
    split = place_engines(RayOptions(engines=4), cpu, _nodes({"CPU": 16.0}, {"CPU": 8.0}))
    assert (split.engines, split.num_cpus) == (4, 6.0)
    threads = place_engines(RayOptions(), cpu.replace(num_threads=3), _nodes({"CPU": 8.0}))
    assert threads.config.num_threads == 3  # --num-threads wins
    waiting = place_engines(RayOptions(engines=2), cpu, _nodes())  # an autoscaler adds nodes
    assert (waiting.engines, waiting.num_cpus) == (2, 1.0)


def test_gpu_engines_take_one_gpu_each() -> None:
    nodes = _nodes({"CPU": 8.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 2.0}, {"CPU": 32.0})
    gpu = place_engines(RayOptions(), EngineConfig(), nodes)
    assert (gpu.engines, gpu.num_cpus, gpu.num_gpus) == (6, 1.0, 1.0)
    assert gpu.config == EngineConfig() and gpu.describe() == "6 engines of one GPU each"
    on_cpu = place_engines(RayOptions(), EngineConfig(device="cpu"), nodes)
    assert (on_cpu.engines, on_cpu.num_gpus) == (6, 0.0)  # 8 + 8 + 32 CPUs, 8 each


def test_no_room_for_an_engine_says_why() -> None:
    with pytest.raises(RayError, match="--device cuda: the Ray cluster has no GPU"):
        place_engines(RayOptions(), EngineConfig(device="cuda"), _nodes({"CPU": 8.0}))
    with pytest.raises(RayError, match=r"no room for an engine of 4 CPUs \(nodes: 2 CPUs\)"):
        place_engines(RayOptions(cpus_per_engine=4), EngineConfig(), _nodes({"CPU": 2.0}))


def test_without_ray_the_flag_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, chat_model: Path
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(RayError, match=r"--ray needs Ray, which is not installed here"):
        import_ray()
    rows = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    code = (
        "import sys; sys.modules['ray'] = None; from cbgen.cli import main; "
        f"sys.argv = ['cbgen', *{['run', str(rows), *tiny(chat_model), '--ray']!r}]; main()"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=120
    )
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().endswith(
        f"--ray needs Ray, which is not installed here: {INSTALL_HINT}"
    )
    assert not (tmp_path / "in.out.partial").exists()  # refused before touching the output

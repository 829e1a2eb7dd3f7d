"""What the GPU path needs that a CPU can check: sampled requests on a runner built for another
device, and the GPU check script itself (its CPU mode, tiny shapes, Triton interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from cbgen.config import EngineConfig, SamplingParams
from cbgen.engine.engine import Engine
from cbgen.engine.runner import ModelRunner, NewRequestInfo, _draw_seed
from cbgen.engine.sampler import Sampler, SamplingRow

ROOT = Path(__file__).resolve().parent.parent


def test_a_runner_for_another_device_keeps_generators_where_the_draws_happen() -> None:
    """A runner built for a device other than the CPU ("meta" stands in for CUDA, which this
    machine cannot create) gives each sampled request a host generator: the sampler and the
    bf16 head draw on the host, and a device generator would refuse those draws."""
    engine = Engine(
        EngineConfig(model="tiny-llama", load_format="dummy", device="cpu", kv_cache_memory=1 << 20)
    )
    meta = torch.device("meta")
    runner = ModelRunner(engine.model, engine.backend, 4, 16, 2, 64, meta, torch.float32)
    assert runner.kv_caches[0].device == meta
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4)
    runner.add_request(
        "r", NewRequestInfo(prompt_len=3, params=params, seed=7, stop_ids_for_min_tokens=())
    )
    generator = runner.generators["r"]
    drawn = torch.rand(1, generator=generator, device="cpu")
    assert generator.device == drawn.device
    # the sampler's draw and the bf16 head's seed both take it, and both replay from the seed
    logits = torch.randn(
        2, engine.model_config.vocab_size, generator=torch.Generator().manual_seed(0)
    )
    rows = [SamplingRow(params, [1, 2, 3], 3, generator, ())]
    first = (Sampler()(logits[:1].clone(), rows), _draw_seed(generator))
    generator.manual_seed(7)
    torch.rand(1, generator=generator, device="cpu")
    assert (Sampler()(logits[:1].clone(), rows), _draw_seed(generator)) == first


def test_the_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    """tools/gpu_check.py in its CPU mode (toy shapes, Triton interpreter), as the GPU machine
    runs it: python3 -m with the checkout on PYTHONPATH. Every section passes (memory needs
    CUDA and says so) and the results file holds what the check promises."""
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "tools.gpu_check",
        "--device",
        "cpu",
        "--quick",
        "--output",
        str(out),
        "--commit",
        "test",
    ]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["commit"] == "test" and results["finished"] and results["device"]
    names = [
        "kernels",
        "greedy_fp32",
        "bf16_top1",
        "sampling",
        "memory",
        "throughput",
        "roofline_8b",
    ]
    assert list(results["sections"]) == names
    for name, section in results["sections"].items():
        assert section["passed"] and section["figures"], name
    assert results["sections"]["memory"]["figures"] == {"skipped": "needs CUDA"}
    assert results["sections"]["sampling"]["figures"]["preemptions"] > 0
    assert results["vs_transformers_cb"] > 0
    assert results["roofline_ratio_8b_b256"] is None  # toy shapes: not the 8B figure
    assert all(t["met"] is None for t in results["targets"].values())

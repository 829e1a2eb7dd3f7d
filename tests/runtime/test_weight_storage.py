"""A checkpoint stored in bf16 whose float32 copy would not fit keeps its bf16 weights on the
CPU, each matmul upcasting its weight as it runs: the tokens are those of a float32 model on
the same (upcast) weights. When even bf16 does not fit, the model is refused before loading,
and loading never holds two copies of the weights."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.cli import cli_env
from helpers.cli import run as run_cli
from helpers.models import make_tiny_hf_model
from helpers.reference import hf_greedy

from cbgen.config import EngineConfig
from cbgen.cpu import build
from cbgen.engine import memory
from cbgen.engine.engine import Engine
from cbgen.engine.memory import cpu_model_bytes
from cbgen.llm import LLM
from cbgen.models import base as linear_mod
from cbgen.models.base import TORCH_LINEAR
from cbgen.runtime import cpu as cpu_runtime
from cbgen.runtime.cpu_linear import PackedBf16Linear
from cbgen.sampling_params import SamplingParams
from tools.model_shapes import TINY_CONFIGS

NEW_TOKENS = 24


def save_bf16(fp32_folder: Path, folder: Path) -> Path:
    """The checkpoint as transformers writes it in bf16 (config.json dtype bfloat16)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fp32_folder, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            fp32 = make_tiny_hf_model(kind, tmp_path_factory.mktemp(f"fp32-{kind}"))
            cache[kind] = save_bf16(fp32, tmp_path_factory.mktemp(f"bf16-{kind}"))
        return cache[kind]

    return get


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 19, 37)]


def greedy(engine: Engine, token_ids: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(o.output_token_ids) for o in LLM(engine=engine).generate(token_ids, params)]


def test_upcast_linear_is_the_float32_matmul_on_the_upcast_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks of rows (here 3 rows of 40 floats, so 7 chunks over 20 rows with a short last
    one) give the matmul of the whole upcast weight, with the bias, for any leading shape."""
    monkeypatch.setattr(linear_mod, "UPCAST_CHUNK_BYTES", 3 * 40 * 4)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(20, 40, generator=gen).to(torch.bfloat16)
    bias = torch.randn(20, generator=gen)
    x = torch.randn(2, 5, 40, generator=gen)
    out = TORCH_LINEAR.apply(x, weight, bias)
    assert out.dtype == torch.float32 and out.shape == (2, 5, 20)
    torch.testing.assert_close(out, F.linear(x, weight.float(), bias), rtol=1e-5, atol=1e-5)
    half = weight.to(torch.float16)
    torch.testing.assert_close(
        TORCH_LINEAR.apply(x, half, None),
        F.linear(x, half.float()),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "qwen3_moe"])
def test_bf16_storage_gives_the_float32_tokens_on_the_upcast_weights(
    kind: str, bf16_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama: untied head, GQA; qwen2: QKV bias, tied embedding; gemma2: its own forward
    (scaled embedding, soft-capping); qwen3_moe: stacked experts. Matmuls upcast a few rows at
    a time (several chunks per weight); the reference is transformers in float32 on the bf16
    checkpoint's values."""
    from transformers import AutoModelForCausalLM

    folder = bf16_model_dir(kind)
    monkeypatch.setattr(linear_mod, "UPCAST_CHUNK_BYTES", 5 * 64 * 4)
    engine = Engine(model=str(folder), device="cpu", cpu_weight_dtype="bfloat16")
    model = engine.model
    assert engine.weight_dtype == torch.bfloat16
    for name, p in model.named_parameters():  # matmul weights, experts, embedding, head
        # (a weight packed into bf16 panels is freed: an empty bf16 tensor is left)
        matmul = p.dim() >= 2 or (p.numel() == 0 and p.dtype == torch.bfloat16)
        assert p.dtype == (torch.bfloat16 if matmul else torch.float32), name
    # the weights stay in bf16 (no float32 copies): widened to float32 in the C matmul where
    # the kernels built (the float32 sums on those weights), else torch's upcast
    methods = [model.head_method, *(layer.method for layer in model.linear_layers())]
    if build.load_library() is None:
        assert all(m is TORCH_LINEAR for m in methods)
    else:
        # (a shape small_gemm_bf16 does not take, as a router of a few experts, keeps torch's)
        packed = [m for m in methods if isinstance(m, PackedBf16Linear)]
        assert packed and not any(m.dot for m in packed)
        assert all(m is TORCH_LINEAR for m in methods if not isinstance(m, PackedBf16Linear))
    assert "float32 (weights kept in bfloat16, float32 arithmetic on them)" in engine.describe()

    reference = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    reference.eval()
    token_ids = prompts(TINY_CONFIGS[kind]["vocab_size"])
    expected = [hf_greedy(reference, p, NEW_TOKENS) for p in token_ids]
    assert greedy(engine, token_ids) == expected


def test_auto_keeps_bf16_weights_only_when_float32_would_not_fit(
    bf16_model_dir: Callable[[str], Path],
    tiny_model_dir: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = bf16_model_dir("llama")
    # where the CPU has bf16 dot products auto runs a bf16 checkpoint in bf16 outright
    # (tests/cpu/test_bf16.py); this is the choice of a CPU without them
    monkeypatch.setattr(cpu_runtime, "bf16_native", lambda: False)
    roomy = Engine(model=str(folder), device="cpu")
    assert roomy.weight_dtype == torch.float32  # the float32 copy fits: nothing changes
    mc = roomy.model_config
    bf16_bytes = cpu_model_bytes(mc, torch.bfloat16)
    assert bf16_bytes < 2 * bf16_bytes < cpu_model_bytes(mc, torch.float32)

    monkeypatch.setattr(memory, "available_memory", lambda: 2 * bf16_bytes)
    tight = Engine(model=str(folder), device="cpu")
    assert tight.weight_dtype == torch.bfloat16
    assert tight.model.get_parameter("layers.1.mlp.down_proj.weight").dtype == torch.bfloat16
    assert "weights kept in bfloat16" in tight.describe()
    assert greedy(tight, prompts(256)) == greedy(roomy, prompts(256))

    # asked for float32, or a float32 checkpoint: refused, pointing at what would fit
    refused: list[dict[str, Any]] = [
        {"model": str(folder), "cpu_weight_dtype": "float32"},
        {"model": str(tiny_model_dir("llama"))},
    ]
    for options in refused:
        with pytest.raises(
            ValueError, match=r"MiB of memory in float32 on the CPU .* use --dtype bfloat16"
        ):
            Engine(device="cpu", **options)

    monkeypatch.setattr(memory, "available_memory", lambda: bf16_bytes - 1)
    with pytest.raises(ValueError) as e:
        Engine(model=str(folder), device="cpu")
    fp32_size = cpu_model_bytes(mc, torch.float32) / memory.MiB
    assert str(e.value) == (
        f"model {folder.name} needs about {fp32_size:.1f} MiB of memory on the CPU in float32 "
        f"(weights and their packed copies) and about {bf16_bytes / memory.MiB:.1f} MiB with its "
        f"bfloat16 weights kept as stored, and {(bf16_bytes - 1) / memory.MiB:.1f} MiB is "
        "available: use a smaller model or a machine with more memory"
    )


def test_the_option_is_validated_and_in_the_run_help() -> None:
    with pytest.raises(ValueError, match="cpu_weight_dtype: applies to float32 on the CPU"):
        EngineConfig(dtype="bfloat16", cpu_weight_dtype="bfloat16")
    with pytest.raises(ValueError, match="cpu_weight_dtype: must be one of"):
        EngineConfig(cpu_weight_dtype="int8")  # type: ignore[arg-type]
    out = run_cli(["run", "--help"], timeout=60, env=cli_env(COLUMNS="80"))
    assert out.returncode == 0, out.stderr
    help_text = " ".join(out.stdout.split())
    assert "--cpu-weight-dtype" in help_text
    assert "each matmul upcasting its weight as it runs" in help_text


def test_cgroup_limits_what_is_available(tmp_path: Path) -> None:
    """cgroup v2 (memory.max - memory.current + inactive page cache) at this process's own
    path, v1 at the mount; no limit, no figure."""
    own = tmp_path / "v2" / "job"
    own.mkdir(parents=True)
    (own / "memory.max").write_text("1000000\n")
    (own / "memory.current").write_text("600000\n")
    (own / "memory.stat").write_text("anon 500000\ninactive_file 50000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job\n")
    assert memory.cgroup_available(tmp_path / "v2", proc) == 450000
    (own / "memory.max").write_text("max\n")
    assert memory.cgroup_available(tmp_path / "v2", proc) is None

    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("2000000\n")
    (v1 / "memory.usage_in_bytes").write_text("1500000\n")
    proc.write_text("4:memory:/elsewhere\n")
    assert memory.cgroup_available(tmp_path / "v1", proc) == 500000


# A model of ~29M parameters: 58 MB in bf16, 116 MB in float32.
RSS_CONFIG: dict[str, Any] = dict(
    TINY_CONFIGS["qwen2"],
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=4096,
)

PEAK_RSS_SCRIPT = """
import json, sys, threading, time
import torch
from cbgen.models.loader import load_model, load_model_config
from cbgen.models.source import resolve_model

def anon():  # resident anonymous memory (file pages the loader maps are the page cache)
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")

source = resolve_model(sys.argv[1])
cfg = load_model_config(source)
base = anon()
peak, done = base, False

def sample():
    global peak
    while not done:
        peak = max(peak, anon())
        time.sleep(0.0005)

sampler = threading.Thread(target=sample)
sampler.start()
model = load_model(source, cfg, torch.float32, torch.device("cpu"), 64, weight_dtype=torch.bfloat16)
done = True
sampler.join()
peak = max(peak, anon())
weights = sum(p.numel() * p.element_size() for p in model.parameters())
largest = max(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"grew": peak - base, "weights": weights, "largest": largest}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_loading_holds_one_copy_of_the_weights(tmp_path: Path) -> None:
    """Peak resident memory while loading a bf16 checkpoint with bf16 storage, sampled in a
    fresh process: the weights plus a bounded margin (a tensor in flight, allocator slack),
    well under the second copy a whole state dict, or a float32 model, would add."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_kwargs = dict(RSS_CONFIG)
    cfg = AutoConfig.for_model(cfg_kwargs.pop("model_type"), **cfg_kwargs)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    del model
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    weights, grew = seen["weights"], seen["grew"]
    margin = 2 * seen["largest"] + 16 * memory.MiB
    assert weights > 40 * memory.MiB
    assert weights * 0.9 < grew <= weights + margin, seen

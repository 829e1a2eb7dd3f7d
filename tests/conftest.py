"""Shared fixtures: the real SmolLM2 (loaded once per session) and tiny random-weight models
written by transformers itself, so cbgen and transformers read the very same weights."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# cbgen_kernels lives in kernels/, which the package's install maps; without an install (the
# GPU machine runs this suite from a bare checkout) the folder itself goes on the path
_KERNELS = str(Path(__file__).resolve().parent.parent / "kernels")
if _KERNELS not in sys.path:
    sys.path.append(_KERNELS)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CBGEN_CPU_TUNING", "off")  # the build defaults: no timing decides a path

import torch  # noqa: E402 - after the environment above

torch.set_num_threads(1)  # two xdist workers on two cores
if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on the CPU; it must be chosen before triton loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_kernels_can_run(device: torch.device) -> None:
    """Fail (not skip) a kernel test that would run compiled kernels on the CPU."""
    import cbgen_kernels

    if device.type == "cpu" and not cbgen_kernels.interpreted():
        pytest.fail(
            "cbgen_kernels was imported without TRITON_INTERPRET=1 (triton was imported before "
            "this module set it), so its kernels cannot run on the CPU"
        )


TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # GQA 4:2, untied
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # QKV bias, GQA 4:1, tied
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=256,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
    # Q/K norm, explicit head_dim, GQA 4:2, untied
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=256,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
    # fused qkv_proj and gate_up_proj in the checkpoint, a sliding window in every layer (as
    # Phi-3-mini-4k), GQA 4:2 (Phi-3-medium), untied
    "phi3": dict(
        model_type="phi3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        sliding_window=48,
    ),
    # LongRoPE past 64 positions, the original Phi-3 spelling of it (Phi-3-mini-128k, Phi-3.5)
    "phi3_longrope": dict(
        model_type="phi3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0, 1.05, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5],
            "long_factor": [1.0, 1.5, 3.0, 6.0, 10.0, 16.0, 24.0, 32.0],
        },
    ),
    # RoPE on 12 of each head's 16 dims, with LongRoPE; GQA 6:2, tied (Phi-4-mini)
    "phi4_mini": dict(
        model_type="phi3",
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        partial_rotary_factor=0.75,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.8, 2.4, 3.0],
            "long_factor": [1.0, 2.0, 5.0, 9.0, 17.0, 30.0],
        },
    ),
    # GeGLU, (1 + w) norms, four per layer, embedding scale; soft-capped scores and logits;
    # query_pre_attn_scalar != head_dim; sliding and full layers alternating; untied (a tied
    # head, Gemma's default, picks the last token again and again with these weights)
    "gemma2": dict(
        model_type="gemma2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=8.0,
        sliding_window=8,
    ),
    # Q/K norm; a local RoPE base for sliding layers, linear scaling on full ones; two
    # sliding layers per full one; untied
    "gemma3": dict(
        model_type="gemma3_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=256,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        query_pre_attn_scalar=32,
        rope_theta=1_000_000.0,
        rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        sliding_window_pattern=3,
        sliding_window=12,
    ),
    # 8 experts, top 3, not renormalised; layer 1 dense (mlp_only_layers); Q/K norm, untied
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
    # 4 experts, top 2 renormalised, Llama attention GQA 4:2, untied
    "mixtral": dict(
        model_type="mixtral",
        hidden_size=64,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
}


def make_tiny_hf_model(kind: str, folder: Path, seed: int = 0, **changes: Any) -> Path:
    """Random weights (std 0.5, so logits are far apart and greedy is well defined),
    saved by transformers as config.json + model.safetensors; `changes` override fields of
    TINY_CONFIGS[kind] (the same seed gives the same weights where the shapes stay)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_kwargs = {**TINY_CONFIGS[kind], **changes}
    model_type = cfg_kwargs.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type, **cfg_kwargs, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return save_random(model, folder)


def save_random(model: Any, folder: Path, seed: int | None = None) -> Path:
    """A transformers model's weights drawn anew (norms near 1, std 0.5 for the embedding and
    head, 0.2 elsewhere; from torch's generator as it stands, or seeded with `seed`) and saved
    as config.json + model.safetensors."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.5 if "embed" in name or "lm_head" in name else 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def tiny_engine(folder: Path, **options: Any) -> Any:
    """cbgen's Engine on a tiny checkpoint, as the token-exact tests run it: CPU, float32,
    blocks of 4 tokens, 8 MiB of KV cache, one thread; options override the config."""
    from cbgen.config import EngineConfig
    from cbgen.engine.engine import Engine

    config = EngineConfig(
        model=str(folder),
        device="cpu",
        dtype="float32",
        kv_cache_memory=8 << 20,
        block_size=4,
        num_threads=1,
    )
    return Engine(config.replace(**options))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = make_tiny_hf_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return cache[kind]

    return get


AVX2_FLAGS = ("-mno-avx512f",)


@pytest.fixture(scope="session")
def avx2_build(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The CPU kernels compiled with AVX-512 switched off (what an AVX2-only CPU gets), into a
    fresh folder, once per test session."""
    import platform

    from cbgen.cpu import build as cpu_build

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("-mno-avx512f is an x86 flag")
    build = cpu_build.build_library(tmp_path_factory.mktemp("kernels-avx2"), AVX2_FLAGS)
    assert build.library is not None, build.status()
    cc = cpu_build.find_compiler()
    assert cc is not None
    target = cpu_build.probe_target(cc, (*cpu_build._FLAGS, *AVX2_FLAGS))
    assert "__AVX512F__" not in target.macros and "__AVX2__" in target.macros, build.reason
    return build


@pytest.fixture(params=["native", "avx2"])
def each_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernel test runs against the default build and against the AVX2 one."""
    from cbgen.cpu import build as cpu_build

    if request.param == "avx2":
        lib = request.getfixturevalue("avx2_build").library
        monkeypatch.setattr(cpu_build, "load_library", lambda extra_flags=(): lib)
    return str(request.param)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from cbgen.models.source import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_engine() -> Any:
    """The real model in cbgen, loaded once per test session (float32, CPU)."""
    from cbgen.engine.engine import Engine

    return Engine(
        max_num_seqs=16, kv_cache_memory=256 << 20, device="cpu", dtype="float32", num_threads=1
    )


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path: str) -> Any:
    """The same weights in transformers (GGUF dequantized by transformers itself)."""
    from transformers import AutoModelForCausalLM

    p = Path(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=torch.float32
    )
    model.eval()
    return model

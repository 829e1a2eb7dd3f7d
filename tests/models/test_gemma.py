"""Gemma 2 and Gemma 3 (text): greedy output token-for-token equal to transformers' (eager
attention, float32) on tiny random checkpoints that transformers writes, through the LLM API,
on the torch reference (torch ops and attention) and on the C kernels (CPU ops and attention):
prompts of different lengths in one batch, a second batch that hits the prefix cache, the same
in chunks of a few tokens, and with room for one sequence at a time (preemption). Sequences run
past the sliding window, so the sliding layers see only part of their context. A multimodal
Gemma 3 checkpoint's language model on text. And how config.json's Gemma fields are read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import save_random
from helpers.reference import hf_greedy

from cbgen.config import AttentionBackendName, EngineConfig
from cbgen.cpu.build import native_status
from cbgen.cpu.kernels import fused_ops_available
from cbgen.engine.engine import Engine
from cbgen.llm import LLM
from cbgen.models.config import ModelConfig
from cbgen.models.ops import TORCH_OPS
from cbgen.runtime.cpu_ops import CPU_OPS
from cbgen.sampling_params import SamplingParams
from tools.model_shapes import TINY_CONFIGS

NEW_TOKENS = 24
FIRST = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13],
    [100, 3, 77, 42, 42, 9, 250, 17, 33, 61, 12, 8, 190, 4, 4, 4, 61, 99, 23, 14, 15],
    list(range(30, 67)),
    [200, 201, 202, 13, 17, 19, 23, 29, 31, 37, 41, 43],
]
SECOND = [  # sharing full blocks (of 4) with FIRST, whose KV is cached by then
    [*FIRST[2][:30], 7, 7, 7],
    [*FIRST[1], 1, 2, 3, 4, 5, 6],
    [9, 8, 7, 6, 5, 4, 3],
]


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def case(
    request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]
) -> tuple[Path, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(request.param)
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in FIRST + SECOND]
    assert all(len(set(e)) > NEW_TOKENS // 4 for e in expected)  # not one token over and over
    return folder, expected


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_matches_transformers(
    case: tuple[Path, list[list[int]]], backend: AttentionBackendName
) -> None:
    folder, expected = case
    if backend == "cpu" and not fused_ops_available():
        pytest.skip(native_status())
    config = EngineConfig(
        model=str(folder),
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        kv_cache_memory=4 << 20,
        block_size=4,
        num_threads=1,
    )
    base = Engine(config)
    mc = base.model_config
    windows = [w for w in mc.layer_windows if w is not None]
    assert windows and None in mc.layer_windows  # sliding and full layers
    assert max(len(p) for p in FIRST) + NEW_TOKENS > max(windows)
    longest = max(len(p) for p in FIRST + SECOND) + NEW_TOKENS
    settings: dict[str, dict[str, Any]] = {
        "prefix caching": {},
        "chunks of 5 tokens": {"max_num_batched_tokens": 5},
        # room for the longest sequence and a little: the others are preempted, then recomputed
        "preemption": {
            "kv_cache_memory": base.kv_bytes_per_block * (-(-longest // 4) + 2),
            "enable_prefix_caching": False,
        },
    }
    for name, overrides in settings.items():
        engine = Engine(config.replace(**overrides), share_weights_with=base)
        engine.model.ops = TORCH_OPS if backend == "torch" else CPU_OPS
        llm = LLM(engine=engine)
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        first, second = llm.generate(FIRST, params), llm.generate(SECOND, params)
        got = [o.output_token_ids for o in first + second]
        assert got == expected, f"{mc.extra['hf_model_type']} on {backend}, {name}"
        if name == "preemption":
            assert engine.total_preemptions > 0
        else:
            assert [o.num_cached_tokens > 0 for o in second] == [True, True, False]
        assert engine.kv.num_used_blocks == 0


def test_multimodal_gemma3_runs_its_language_model_on_text(tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration checkpoint (Gemma 3 4B and up): its text_config and
    language-model tensors, the vision tower's skipped; greedy equal to transformers' same
    model on text-only prompts."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {k: v for k, v in TINY_CONFIGS["gemma3"].items() if k != "model_type"}
    vision = dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
    )  # fmt: skip
    top: dict[str, Any] = dict(  # token ids and tying at the top level, as Google's configs
        mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298,
        eos_token_id=[1, 296], tie_word_embeddings=False,
    )  # fmt: skip
    cfg = Gemma3Config(text_config=dict(text, vocab_size=300), vision_config=vision, **top)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    save_random(model, tmp_path)
    hf = Gemma3ForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in FIRST]
    assert all(len(set(e)) > NEW_TOKENS // 4 for e in expected)  # not one token over and over
    engine = Engine(
        model=str(tmp_path), device="cpu", dtype="float32", kv_cache_memory=1 << 20,
        block_size=4, num_threads=1,
    )  # fmt: skip
    mc = engine.model_config
    assert (mc.model_type, mc.eos_token_ids, mc.tie_word_embeddings) == ("gemma3", [1, 296], False)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [o.output_token_ids for o in LLM(engine=engine).generate(FIRST, params)]
    assert got == expected


def test_soft_capped_logits_skip_the_exact_head(tiny_model_dir: Callable[[str], Path]) -> None:
    """The exact head picks tokens from uncapped logits; a soft-capped model never gets one."""
    engine = Engine(
        model=str(tiny_model_dir("gemma2")),
        device="cpu",
        dtype="float32",
        kv_cache_memory=1 << 20,
        num_threads=1,
    )
    assert engine.model_config.final_logit_softcap == 8.0
    assert engine.runtime.exact_head is None and not engine.model.exact_head_allowed


GEMMA2_CONFIG: dict[str, Any] = dict(
    model_type="gemma2", vocab_size=256, hidden_size=64, intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip


def test_gemma2_fields_left_out_take_transformers_defaults() -> None:
    cfg = ModelConfig.from_hf_dict(GEMMA2_CONFIG)
    assert (cfg.model_type, cfg.head_dim, cfg.tie_word_embeddings) == ("gemma2", 256, True)
    assert (cfg.query_pre_attn_scalar, cfg.attn_logit_softcap, cfg.final_logit_softcap) == (
        256,
        50.0,
        30.0,
    )
    assert cfg.layer_windows == (4096, None, 4096, None)
    assert cfg.local_rope_theta is None and not cfg.qk_norm
    off = ModelConfig.from_hf_dict(
        dict(GEMMA2_CONFIG, attn_logit_softcapping=None, final_logit_softcapping=None)
    )
    assert (off.attn_logit_softcap, off.final_logit_softcap) == (None, None)


def test_gemma3_rope_per_layer_type_in_both_config_formats() -> None:
    """transformers 4 writes rope_theta, rope_local_base_freq, rope_scaling and
    sliding_window_pattern; transformers 5 rope_parameters per layer type and layer_types."""
    base = dict(GEMMA2_CONFIG, model_type="gemma3_text", num_hidden_layers=6, sliding_window=64)
    scaling = {"rope_type": "linear", "factor": 8.0}
    v4 = dict(
        base, rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=scaling,
        sliding_window_pattern=3,
    )  # fmt: skip
    v5 = dict(
        base,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {**scaling, "rope_theta": 1e6},
        },
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    )
    for fields in (v4, v5):
        cfg = ModelConfig.from_hf_dict(fields)
        assert (cfg.model_type, cfg.qk_norm) == ("gemma3", True)
        assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4)
        assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 8.0
        assert cfg.layer_windows == (64, 64, None, 64, 64, None)
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (None, None)
    # the default pattern: five sliding layers, then a full one
    assert ModelConfig.from_hf_dict(base).layer_windows == (64,) * 5 + (None,)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(model_type="gemma3"), "'text_config' is missing"),
        (dict(GEMMA2_CONFIG, hidden_activation="gelu"), "'hidden_activation'"),
        (dict(GEMMA2_CONFIG, use_bidirectional_attention=True), "causal models only"),
        (dict(GEMMA2_CONFIG, layer_types=["full_attention"]), "'layer_types'"),
        (dict(GEMMA2_CONFIG, sliding_window=None), "'sliding_window' is null"),
        (dict(GEMMA2_CONFIG, final_logit_softcapping=-1.0), "'final_logit_softcapping'"),
    ],
)
def test_gemma_configs_cbgen_cannot_run_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(fields)

"""Phi-3 and Phi-4 (model_type phi3): fused qkv_proj / gate_up_proj checkpoints, LongRoPE and
partial rotary, token-for-token against transformers on tiny random weights (float32, greedy).

LongRoPE: cbgen takes one set of factors for a whole engine, the long ones when max_model_len is
past original_max_position_embeddings (vLLM's rule). transformers' generate takes the short ones
while a sequence is within that length and recomputes its cache with the long ones on passing
it, so the two agree on sequences that start past it (long engine) and on sequences that stay
within it (an engine whose max_model_len is the original length); both are checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import tiny_engine
from helpers.reference import NEW_TOKENS, hf_greedy, run_cbgen, settings

from cbgen.cpu.kernels import fused_ops_available
from cbgen.engine.engine import Engine
from cbgen.llm import LLM
from cbgen.models.config import ModelConfig
from cbgen.sampling_params import SamplingParams

ORIGINAL = 64
"""original_max_position_embeddings of the tiny LongRoPE models (tests/conftest.py)."""


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


LONG_PROMPTS = prompts([ORIGINAL + 1, 70, 83, 101])
"""All past the original length: transformers' generate runs them on the long factors."""
SHORT_PROMPTS = prompts([9, 21, 12, ORIGINAL - NEW_TOKENS], seed=1)
"""Within the original length, generated tokens included."""


def engine(folder: Path, **options: Any) -> Engine:
    engine: Engine = tiny_engine(folder, **options)
    return engine


def hf_model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# ---- configuration ------------------------------------------------------------------------------


def test_config_reads_what_transformers_reads(tiny_model_dir: Callable[[str], Path]) -> None:
    """rotary_dim, the LongRoPE factors, original length and attention factor as transformers'
    Phi3RotaryEmbedding resolves them, from the config.json transformers wrote."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    for kind, rotary in (("phi3", 16), ("phi3_longrope", 16), ("phi4_mini", 12)):
        folder = tiny_model_dir(kind)
        cfg = ModelConfig.from_json(folder / "config.json")
        assert (cfg.model_type, cfg.rotary_dim) == ("phi3", rotary)
        hf = Phi3RotaryEmbedding(hf_model(folder).config)
        if kind == "phi3":
            assert cfg.rope_scaling is None
            continue
        assert cfg.rope_scaling is not None
        assert cfg.rope_scaling["original_max_position_embeddings"] == ORIGINAL
        assert cfg.rope_scaling["attention_factor"] == hf.attention_scaling
        assert hf.attention_scaling == math.sqrt(1 + math.log(512 / ORIGINAL) / math.log(ORIGINAL))


def test_config_errors_and_spellings() -> None:
    base: dict[str, Any] = dict(
        model_type="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=256, max_position_embeddings=4096,
    )  # fmt: skip
    scaling = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    # "su" is an early name of longrope; original length from the top level, default 4096
    cfg = ModelConfig.from_hf_dict(dict(base, rope_scaling=scaling, max_position_embeddings=8192))
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert cfg.rope_scaling["attention_factor"] == math.sqrt(1 + math.log(2) / math.log(4096))
    given = dict(scaling, attention_factor=1.5, original_max_position_embeddings=9)
    cfg = ModelConfig.from_hf_dict(
        dict(base, rope_scaling=given, original_max_position_embeddings=1024)
    )
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling["attention_factor"] == 1.5
    assert cfg.rope_scaling["original_max_position_embeddings"] == 1024  # the top level wins
    # partial rotary: from the rope dict first, else the top level; only phi3 reads it
    assert ModelConfig.from_hf_dict(dict(base, partial_rotary_factor=0.5)).rotary_dim == 8
    in_rope = dict(base, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.75})
    assert ModelConfig.from_hf_dict(in_rope).rotary_dim == 12
    llama = dict(base, model_type="llama", partial_rotary_factor=0.5)
    assert ModelConfig.from_hf_dict(llama).rotary_dim == 16
    with pytest.raises(ValueError, match=r"'partial_rotary_factor' 0\.2 must turn an even number"):
        ModelConfig.from_hf_dict(dict(base, partial_rotary_factor=0.2))
    # a window in every layer whenever set (transformers' Phi3Model); one as long as the model
    # binds nowhere (Phi-3-mini-128k's 262144)
    assert ModelConfig.from_hf_dict(dict(base, sliding_window=2047)).layer_windows == (2047,) * 2
    assert ModelConfig.from_hf_dict(dict(base, sliding_window=4096)).sliding_window is None
    short = dict(scaling, long_factor=[2.0] * 7)
    with pytest.raises(ValueError, match="'longrope' needs 'long_factor': 8 positive numbers"):
        ModelConfig.from_hf_dict(dict(base, rope_scaling=short))


# ---- RoPE tables ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["phi3_longrope", "phi4_mini"])
def test_longrope_tables_equal_transformers(
    kind: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    """An engine past the original length has transformers' long-factor cos/sin at every
    position (what its forward computes for a sequence longer than the original length); one
    within it, the short-factor ones. Bit for bit, on the first rotary_dim / 2 columns."""
    folder = tiny_model_dir(kind)
    hf = hf_model(folder)
    x = torch.zeros(1, dtype=torch.float32)
    for max_model_len in (512, ORIGINAL):
        tables = engine(folder, max_model_len=max_model_len).model.rope
        positions = torch.arange(max_model_len)[None, :]  # its length picks transformers' set
        cos, sin = hf.model.rotary_emb(x, positions)
        half = tables.cos.shape[1]
        assert 2 * half == cos.shape[-1]  # the rotary dims only (12 of 16 in Phi-4-mini)
        assert torch.equal(tables.cos, cos[0, :, :half])
        assert torch.equal(tables.sin, sin[0, :, :half])


# ---- generation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kind", ["phi3", "phi3_longrope", "phi4_mini"])
def test_greedy_matches_transformers(
    kind: str, backend: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    """Prompts of different lengths in one batch (LongRoPE models: all past the original
    length), under default settings, chunked prefill, preemption and one slot."""
    folder = tiny_model_dir(kind)
    hf = hf_model(folder)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in LONG_PROMPTS]
    base = engine(folder, attention_backend=backend)
    if fused_ops_available():  # the C kernels' ops, and their way out for partial rotary
        assert base.model.ops.name == "cpu"
    for name, overrides in settings([len(p) for p in LONG_PROMPTS], base).items():
        got, preemptions = run_cbgen(base, overrides, LONG_PROMPTS)
        if name == "preempt":
            assert preemptions > 0
        assert got == expected, f"{kind} on {backend} under {name}"


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kind", ["phi3_longrope", "phi4_mini"])
def test_longrope_within_the_original_length_matches_transformers(
    kind: str, backend: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    """max_model_len at the original length: the short factors, as transformers' generate takes
    for sequences that never pass it. With the model's whole length, the same prompts run on the
    long factors and give other tokens: cbgen's rule, not transformers'."""
    folder = tiny_model_dir(kind)
    hf = hf_model(folder)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in SHORT_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for max_model_len in (ORIGINAL, None):
        llm = LLM(engine=engine(folder, attention_backend=backend, max_model_len=max_model_len))
        got = [o.output_token_ids for o in llm.generate(SHORT_PROMPTS, params)]
        assert (got == expected) == (max_model_len == ORIGINAL), max_model_len

"""Models with a sliding window: no attention path of cbgen applies one yet, so the engine keeps
every sequence within the window (where windowed attention is full attention) instead of
computing something else past it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cbgen.config import SamplingParams
from cbgen.engine.engine import Engine
from cbgen.llm import LLM
from cbgen.models.config import ModelConfig

WINDOW = 16


def _tiny_mistral(folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, MistralConfig

    cfg = MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, sliding_window=WINDOW,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "embed" in name or "lm_head" in name else 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def test_where_transformers_applies_a_window() -> None:
    base = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        vocab_size=256, sliding_window=32,
    )  # fmt: skip
    window = {
        t: ModelConfig.from_hf_dict(dict(base, model_type=t, **extra)).sliding_window
        for t, extra in [
            ("mistral", {}),
            ("llama", {}),  # Llama ignores the key
            ("qwen2", {"use_sliding_window": False}),
            ("qwen2", {"use_sliding_window": True, "max_window_layers": 4}),  # no layer left
        ]
    }
    assert window == {"mistral": 32, "llama": None, "qwen2": None}
    qwen = dict(base, model_type="qwen3", use_sliding_window=True, max_window_layers=2)
    assert ModelConfig.from_hf_dict(qwen).sliding_window == 32
    assert ModelConfig.from_hf_dict(dict(qwen, max_window_layers=0)).sliding_window == 32


def test_sequences_stay_within_the_window_and_match_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = _tiny_mistral(tmp_path / "mistral")
    engine = Engine(
        model=str(folder), device="cpu", dtype="float32", kv_cache_memory=8 << 20, num_threads=1
    )
    assert engine.max_model_len == WINDOW
    with pytest.raises(ValueError, match=r"exceeds the model's sliding window \(16 tokens\)"):
        Engine(
            model=str(folder),
            device="cpu",
            dtype="float32",
            max_model_len=64,
            kv_cache_memory=8 << 20,
        )

    prompts = [[5, 9, 33, 7, 100, 4], [200, 3, 3, 17, 250, 11, 8, 90, 61, 12], list(range(30, 53))]
    params = SamplingParams(temperature=0, max_tokens=WINDOW - 10, ignore_eos=True)
    outs = LLM(engine=engine).generate(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    hf.generation_config.eos_token_id = None  # as ignore_eos: go on past EOS, unmasked
    for prompt, out in zip(prompts[:2], outs[:2], strict=True):
        ids = torch.tensor([prompt])
        want = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(out.output_token_ids),
            do_sample=False, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
        assert out.output_token_ids == want
    assert outs[0].finish_reason == "length" and len(outs[0].output_token_ids) == 6
    assert outs[2].finish_reason == "error" and "max_model_len" in (outs[2].error or "")

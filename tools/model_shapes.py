"""Model shapes as transformers' config.json fields: the one registry of the test suite
(tests/helpers) and the GPU check (tools/gpu_fixtures). The GPU machine runs the check from a bare
checkout and tools never import tests/, so the registry lives here and the tests import it.

    TINY_CONFIGS       each family cbgen runs, at toy size, with what sets it apart
    TINY_LLAMA         a two-layer Llama with a 512-token vocabulary, for dummy-weight engines
    TINY_CHAT_LLAMA    the same with SmolLM2's vocabulary, so its tokenizer and chat template apply
    CHECKPOINTS        the GPU check's shapes; QUICK_CHECKPOINTS, the same kinds at toy sizes

hf_model builds transformers' model of a shape; each caller draws the weights its own way.
"""

from __future__ import annotations

from typing import Any


def shape(
    model_type: str,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    **extra: Any,
) -> dict[str, Any]:
    """transformers' config fields of one shape: untied, RoPE base 10^4 unless extra says."""
    return {
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        **extra,
    }


def hf_model(fields: dict[str, Any], seed: int = 0, dtype: Any = None, **config: Any) -> Any:
    """transformers' model of these config fields (model_type among them; config adds more, such
    as token ids), in dtype (None: float32), built after seeding torch's generator with seed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**fields, **config}
    cfg = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32)


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
"""Each family at toy size; the tests write them with random weights (tests/helpers/models)."""

TINY_LLAMA: dict[str, Any] = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    eos_token_id=2,
)
"""A config.json alone (load_format="dummy", prompts as token ids): the benchmarks' engines."""

TINY_CHAT_LLAMA: dict[str, Any] = {
    **TINY_LLAMA,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
}
"""TINY_LLAMA with SmolLM2's vocabulary size and token ids: beside SmolLM2's tokenizer files,
real text and chats tokenize to valid ids (the `cbgen run` tests' model)."""

# The GPU check needs head_dim 64 and 128, GQA, Qwen2's QKV bias and Qwen3's Q/K norm with an
# explicit head_dim; "smollm2-135m" is SmolLM2-135M's own shape, for throughput. The quick set is
# the same kinds at toy sizes (the CPU smoke test).
CHECKPOINTS: dict[str, dict[str, Any]] = {
    "llama-hd64-gqa4": shape("llama", 512, 1376, 4, 8, 2, 8192),
    "llama-hd128-gqa4": shape("llama", 1024, 2816, 4, 8, 2, 8192),
    "qwen2-hd64-gqa6": shape(
        "qwen2", 768, 2048, 4, 12, 2, 8192, tie_word_embeddings=True, rope_theta=1e6
    ),
    "qwen3-hd128-gqa2": shape("qwen3", 512, 1536, 4, 8, 4, 8192, head_dim=128),
    "smollm2-135m": shape(
        "llama", 576, 1536, 30, 9, 3, 49152, rope_theta=1e5, tie_word_embeddings=True
    ),
}
QUICK_CHECKPOINTS: dict[str, dict[str, Any]] = {
    "llama-hd64-gqa2": shape("llama", 128, 256, 2, 2, 1, 512),
    "llama-hd128-gqa2": shape("llama", 256, 256, 2, 2, 1, 512),
    "qwen2-hd64-gqa2": shape("qwen2", 128, 256, 2, 2, 1, 512, tie_word_embeddings=True),
    "qwen3-hd64-gqa2": shape("qwen3", 64, 128, 2, 4, 2, 512, head_dim=64),
    "smollm2-135m": shape("llama", 64, 128, 2, 4, 2, 512, tie_word_embeddings=True),
}

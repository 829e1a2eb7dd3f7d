"""A Hugging Face config.json read into ModelConfig's fields. Each field is checked where it is
read, so an error names it: missing, of the wrong type or out of range. Family quirks live here:
Gemma's defaults and per-layer-type RoPE, the mixture-of-experts fields, rope scaling (linear,
llama3, LongRoPE), partial rotary, and which layers take a sliding window.
"""

from __future__ import annotations

import json
import math
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}

SLIDING, FULL = "sliding_attention", "full_attention"
"""transformers' layer_types entries."""


def model_config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's keyword arguments from a config.json's fields; raises ValueError naming the
    first field that is missing, of the wrong type or out of range."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; cbgen runs "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    kind = SUPPORTED_ARCHITECTURES[model_type]
    if kind in ("gemma2", "gemma3"):
        cfg = _gemma_config(cfg, model_type)
    heads = _int(cfg, "num_attention_heads")
    hidden = _int(cfg, "hidden_size")
    kv_heads = _int(cfg, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(
            f"'num_attention_heads' ({heads}) must be a multiple of 'num_key_value_heads' ({kv_heads})"
        )
    rope_scaling = _dict(cfg, "rope_scaling")
    rope_theta = _number(cfg, "rope_theta", 10000.0)
    params = _dict(cfg, "rope_parameters")  # transformers >= 5 folds both into one dict
    if params is not None:
        rope_theta = _number(params, "rope_theta", rope_theta)
        if params.get("rope_type", "default") != "default":
            rope_scaling = params
    if rope_scaling is not None:
        rope_scaling = _rope_scaling(rope_scaling, cfg)
    return dict(
        model_type=kind,
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size"),
        num_hidden_layers=_int(cfg, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=_int(cfg, "head_dim", hidden // heads),
        rms_norm_eps=_number(cfg, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        partial_rotary_factor=_partial_rotary_factor(cfg),
        max_position_embeddings=_int(cfg, "max_position_embeddings", 4096),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings"),
        attention_bias=kind == "qwen2" or _bool(cfg, "attention_bias"),
        qk_norm=kind in ("qwen3", "qwen3_moe", "gemma3"),
        bos_token_id=_token_id(cfg, "bos_token_id"),
        eos_token_id=_token_ids(cfg, "eos_token_id"),
        sliding_window=_sliding_window(cfg, model_type),
        layer_types=_window_layer_types(cfg, model_type),
        extra={"hf_model_type": model_type},
        **_experts(cfg, model_type),
        **_gemma(cfg, kind),
    )


# ---- config.json fields: each is checked where it is read, so an error names the field ----------


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer; null or absent takes the default (required without one)."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"{key!r} is missing")
        return default
    if type(value) is not int or value < 1:
        raise ValueError(f"{key!r} must be a positive integer, got {_show(value)}")
    return value


def _number(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key)
    if value is None:
        return default
    if type(value) not in (int, float) or not value > 0:
        raise ValueError(f"{key!r} must be a positive number, got {_show(value)}")
    return float(value)


def _bool(cfg: dict[str, Any], key: str) -> bool:
    value = cfg.get(key, False)
    if type(value) is not bool:
        raise ValueError(f"{key!r} must be true or false, got {_show(value)}")
    return value


def _dict(cfg: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = cfg.get(key)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{key!r} must be an object or null, got {_show(value)}")
    return value


def _token_id(cfg: dict[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    if value is not None and (type(value) is not int or value < 0):
        raise ValueError(f"{key!r} must be a token id, got {_show(value)}")
    return value


def _token_ids(cfg: dict[str, Any], key: str) -> int | list[int] | None:
    value = cfg.get(key)
    if isinstance(value, list):
        if not all(type(v) is int and v >= 0 for v in value):
            raise ValueError(f"{key!r} must be a token id or a list of them, got {_show(value)}")
        return value
    return _token_id(cfg, key)


def _experts(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields: Mixtral's every layer is sparse, with experts of
    intermediate_size, always renormalised; Qwen3-MoE's as decoder_sparse_step, mlp_only_layers,
    moe_intermediate_size and norm_topk_prob say. Dense families get none."""
    if model_type not in ("mixtral", "qwen3_moe"):
        return {}
    layers = _int(cfg, "num_hidden_layers")
    key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    experts = _int(cfg, key)
    top_k = _int(cfg, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"'num_experts_per_tok' ({top_k}) is more than {key!r} ({experts})")
    if model_type == "mixtral":
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=_int(cfg, "intermediate_size"),
        )
    step = _int(cfg, "decoder_sparse_step", 1)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(type(n) is int and n >= 0 for n in only):
        raise ValueError(f"'mlp_only_layers' must be a list of layer numbers, got {_show(only)}")
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=_int(cfg, "moe_intermediate_size"),
        norm_topk_prob=_bool(cfg, "norm_topk_prob"),
        dense_layers=tuple(n for n in range(layers) if n in only or (n + 1) % step),
    )


_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        head_dim=256, max_position_embeddings=8192, tie_word_embeddings=True,
        query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=2,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    ),
    "gemma3_text": dict(
        head_dim=256, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
        sliding_window=4096, sliding_window_pattern=6,
    ),
}  # fmt: skip
"""transformers' Gemma2Config / Gemma3TextConfig defaults of the fields a config.json may
leave out (the soft-capping fields are null there to switch capping off)."""


def _gemma_config(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A Gemma config.json in the form the common fields are read in: transformers' defaults for
    the fields it leaves out, and Gemma 3's RoPE per layer type (rope_parameters with
    full_attention and sliding_attention) as the full layers' rope_parameters plus
    rope_local_base_freq. A multimodal Gemma 3 (model_type gemma3) is its text_config, with the
    top level's token ids and tying, which transformers follows: cbgen runs its language model
    on text alone."""
    if model_type == "gemma3":
        text = _dict(cfg, "text_config")
        if text is None:
            raise ValueError(
                "'text_config' is missing (a gemma3 config keeps the text model there)"
            )
        keys = ("bos_token_id", "eos_token_id", "tie_word_embeddings")
        cfg, model_type = {**text, **{k: cfg[k] for k in keys if k in cfg}}, "gemma3_text"
    cfg = {**_GEMMA_DEFAULTS[model_type], **cfg}
    params = _dict(cfg, "rope_parameters")
    if params is not None and {"full_attention", "sliding_attention"} & params.keys():
        local = _dict(params, "sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(
                f"rope_parameters.sliding_attention: rope type {local['rope_type']!r} is not "
                "supported (default is)"
            )
        cfg["rope_parameters"] = _dict(params, "full_attention")
        cfg["rope_local_base_freq"] = local.get("rope_theta", cfg.get("rope_local_base_freq"))
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(
            f"'hidden_activation' {_show(cfg['hidden_activation'])} is not supported "
            "(gelu_pytorch_tanh is)"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("'use_bidirectional_attention': cbgen runs causal models only")
    layers = _int(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None:
        pattern = _int(cfg, "sliding_window_pattern")
        types = [SLIDING if (n + 1) % pattern else FULL for n in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(
            f"'layer_types' must name {SLIDING!r} or {FULL!r} for each of the {layers} layers, "
            f"got {_show(types)}"
        )
    if SLIDING not in types:
        cfg["sliding_window"] = None  # no window anywhere: every layer takes the full RoPE
    elif cfg.get("sliding_window") is None:
        raise ValueError("'sliding_window' is null, but 'layer_types' has sliding_attention layers")
    return {**cfg, "layer_types": types}


def _gemma(cfg: dict[str, Any], kind: str) -> dict[str, Any]:
    """The Gemma fields of ModelConfig, from a config _gemma_config has completed."""
    if kind not in ("gemma2", "gemma3"):
        return {}
    caps = {
        key: None if cfg.get(key) is None else _number(cfg, key, 0.0)
        for key in ("attn_logit_softcapping", "final_logit_softcapping")
    }
    return dict(
        query_pre_attn_scalar=_number(cfg, "query_pre_attn_scalar", 0.0),
        attn_logit_softcap=caps["attn_logit_softcapping"],
        final_logit_softcap=caps["final_logit_softcapping"],
        local_rope_theta=_number(cfg, "rope_local_base_freq", 0.0) if kind == "gemma3" else None,
    )


_ROPE_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": (),  # checked by _longrope
}
"""The rope scaling types cbgen implements (rope_inv_freq) and the numbers each needs."""


def _rope_scaling(scaling: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any] | None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("su", "yarn") and cfg.get("model_type") == "phi3":
        kind = "longrope"  # early Phi-3 configs' names, read so by transformers' Phi3Config
    if kind in (None, "default"):
        return None
    if kind == "longrope":
        return _longrope(scaling, cfg)
    if kind not in _ROPE_FIELDS:
        raise ValueError(
            f"rope scaling {kind!r} is not supported ({', '.join(['default', *_ROPE_FIELDS])} are)"
        )
    for key in _ROPE_FIELDS[kind]:
        if scaling.get(key) is None:
            raise ValueError(f"rope scaling {kind!r} needs {key!r}")
        _number(scaling, key, 0.0)
    return scaling


def _partial_rotary_factor(cfg: dict[str, Any]) -> float:
    """Phi-3's partial_rotary_factor, from its rope dict or else the top level (transformers'
    precedence); 1 for other families, whose transformers models turn whole heads."""
    if cfg.get("model_type") != "phi3":
        return 1.0
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    source = rope if isinstance(rope, dict) and "partial_rotary_factor" in rope else cfg
    factor = _number(source, "partial_rotary_factor", 1.0)
    head_dim = _int(cfg, "head_dim", _int(cfg, "hidden_size") // _int(cfg, "num_attention_heads"))
    rotary = int(head_dim * factor)
    if factor > 1 or rotary < 2 or rotary % 2:
        raise ValueError(
            f"'partial_rotary_factor' {factor} must turn an even number of a head's {head_dim} "
            f"dims, at least 2 and at most all (it turns {rotary})"
        )
    return factor


def _longrope(scaling: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE as transformers resolves it: a divisor per frequency (short_factor, and
    long_factor past original_max_position_embeddings, which Phi-3 takes from the top level,
    default 4096) and one attention_factor on cos and sin, by default sqrt(1 + ln(factor) /
    ln(original)) with factor = max_position_embeddings / original unless given."""
    if cfg.get("model_type") == "phi3":
        original = _int(cfg, "original_max_position_embeddings", 4096)
    else:
        length = _int(cfg, "max_position_embeddings", 4096)
        original = _int(scaling, "original_max_position_embeddings", length)
    head_dim = _int(cfg, "head_dim", _int(cfg, "hidden_size") // _int(cfg, "num_attention_heads"))
    pairs = int(head_dim * _partial_rotary_factor(cfg)) // 2
    lists: dict[str, list[float]] = {}
    for key in ("short_factor", "long_factor"):
        value = scaling.get(key)
        if not (
            isinstance(value, list)
            and len(value) == pairs
            and all(type(v) in (int, float) and v > 0 for v in value)
        ):
            raise ValueError(
                f"rope scaling 'longrope' needs {key!r}: {pairs} positive numbers, got {_show(value)}"
            )
        lists[key] = [float(v) for v in value]
    factor = _number(scaling, "factor", _int(cfg, "max_position_embeddings", 4096) / original)
    default = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return {
        "rope_type": "longrope",
        **lists,
        "original_max_position_embeddings": original,
        "attention_factor": _number(scaling, "attention_factor", default),
    }


def _show(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."


def _sliding_window(cfg: dict[str, Any], model_type: str) -> int | None:
    """The window where transformers applies one: Mistral whenever sliding_window is set;
    Qwen2/Qwen3 only with use_sliding_window, in layers max_window_layers and up; Qwen3-MoE
    with use_sliding_window, in every layer; Mixtral as Mistral; Gemma 2/3 in their
    sliding_attention layers (_gemma_config); Llama never."""
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if model_type == "phi3":  # every layer, as Mistral; one as long as the model binds nowhere
        limit = _int(cfg, "max_position_embeddings", 4096)
        return None if _int(cfg, "sliding_window") >= limit else window
    if model_type == "qwen3_moe" and not cfg.get("use_sliding_window"):
        return None
    if model_type in ("qwen2", "qwen3"):
        layers = _int(cfg, "num_hidden_layers")
        first = cfg.get("max_window_layers", layers)
        if not cfg.get("use_sliding_window") or (type(first) is int and first >= layers):
            return None
    elif model_type not in ("mistral", "mixtral", "qwen3_moe", "gemma2", "gemma3_text", "gemma3"):
        return None
    return _int(cfg, "sliding_window")


_EVERY_LAYER = ("mistral", "mixtral", "qwen3_moe", "phi3")
"""Families whose window, when set, is in every layer (transformers ignores their layer_types)."""


def _window_layer_types(cfg: dict[str, Any], model_type: str) -> tuple[str, ...] | None:
    """Which layers take the window _sliding_window found, as transformers' layer_types: Qwen2/3
    by theirs, else from max_window_layers on; another family by its layer_types (checked: one
    entry per layer); None (every layer) for Mistral, Mixtral and Qwen3-MoE, whose transformers
    models ignore layer_types, and for a family without the list."""
    if model_type in _EVERY_LAYER or _sliding_window(cfg, model_type) is None:
        return None
    layers = _int(cfg, "num_hidden_layers")
    value = cfg.get("layer_types")
    if value is None:
        if model_type not in ("qwen2", "qwen3"):
            return None
        first = cfg.get("max_window_layers", layers)
        return tuple(SLIDING if i >= first else FULL for i in range(layers))
    if not isinstance(value, list) or len(value) != layers or not set(value) <= {SLIDING, FULL}:
        raise ValueError(
            f"'layer_types' must name {SLIDING!r} or {FULL!r} for each of the {layers} layers, "
            f"got {_show(value)}"
        )
    return tuple(value)

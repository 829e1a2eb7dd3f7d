"""A GGUF file as a model: its metadata mapped to a ModelConfig (the config.json fields it
stands for), and its tensors dequantized to float32 under the names of the safetensors
checkpoints (Llama's q/k rows un-interleaved). The file itself is read by cbgen.models.gguf_file.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from cbgen.models.config import ModelConfig
from cbgen.models.errors import one_line
from cbgen.models.gguf_file import GGUFError, GGUFFile
from cbgen.models.hf_config import SUPPORTED_ARCHITECTURES
from cbgen.models.quantized import QuantSegment


@lru_cache(maxsize=2)
def gguf_reader(path: str) -> GGUFFile:
    """The GGUF header and tensor table (the data stays memory-mapped), read once."""
    return GGUFFile(path)


GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
"""What the GGUF path maps (tensor names, rope layout); other families load from safetensors."""


def gguf_config(reader: GGUFFile) -> ModelConfig:
    f = reader.fields
    arch = f.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        other = (
            f" ({arch} runs from its safetensors checkpoint)"
            if arch in SUPPORTED_ARCHITECTURES
            else ""
        )
        raise GGUFError(
            f"model file {reader.path}: GGUF architecture {arch!r} is not supported; cbgen reads "
            f"{', '.join(GGUF_ARCHITECTURES)} from GGUF files{other}"
        )

    def number(key: str, default: float | None = None) -> Any:
        value = f.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"model file {reader.path}: the metadata has no {arch}.{key}")
        if type(value) not in (int, float):
            raise GGUFError(
                f"model file {reader.path}: {arch}.{key} must be a number, got {value!r:.40}"
            )
        return value

    heads = number("attention.head_count")
    hidden = number("embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    vocab = f.get(f"{arch}.vocab_size")
    if vocab is None:
        emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if emb is None or not emb.shape:
            raise GGUFError(
                f"model file {reader.path}: no {arch}.vocab_size and no token_embd.weight tensor"
            )
        vocab = int(emb.shape[-1])
    rope_scaling = None
    scaling_type = f.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": number("rope.scaling.factor")}
    elif scaling_type not in (None, "none"):
        raise GGUFError(f"model file {reader.path}: rope scaling {scaling_type!r} is not supported")
    hf = {
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": number("feed_forward_length"),
        "num_hidden_layers": number("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": number("attention.head_count_kv", heads),
        "head_dim": number("attention.key_length", hidden // heads if heads else 0),
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": number("rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": number("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f.get("tokenizer.ggml.eos_token_id"),
    }
    if arch == "qwen2":
        hf["attention_bias"] = True
    try:
        return ModelConfig.from_hf_dict(hf)
    except ValueError as e:  # named by the config.json field it maps to
        raise GGUFError(f"model file {reader.path}: {e}") from None


_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _gguf_to_hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "embed_tokens.weight"
    if name == "output_norm.weight":
        return "norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_NAMES:
        return f"layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF stores Llama's q/k rows interleaved per rotary pair; undo it."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


_LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
"""The GGUF tensors that are a linear layer's weight (runnable in their blocks)."""


def _is_linear(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "blk" and len(parts) == 4 and parts[2] in _LINEAR and parts[3] == "weight"


_EMBEDDING = ("token_embd.weight", "output.weight")
"""The token embedding and the LM head: kept in their blocks with the linear tensors."""


def kept_quantized(reader: GGUFFile, keep: frozenset[int]) -> list[Any]:
    """The linear tensors, the embedding and the LM head whose types are in keep (ggml type
    ids a runtime runs in their blocks): they load as QuantSegments (quantized_segments), the
    rest dequantized."""
    return [
        t
        for t in reader.tensors
        if (_is_linear(t.name) or t.name in _EMBEDDING) and t.tensor_type in keep
    ]


PACKED_OVERHEAD = 148 / 144
"""The most a kept tensor's packed blocks take over its file bytes (Q4_K: the 6-bit scales
unpacked to bytes; cbgen/cpu/csrc/qgemm.c)."""


def gguf_resident_bytes(path: str, keep: frozenset[int]) -> int:
    """What a GGUF model's weights take on the CPU with the types in keep run in their
    blocks: those tensors' file bytes (packed: at most PACKED_OVERHEAD more), the others
    dequantized to float32, a linear one (or the head) with its two packed copies."""
    reader = gguf_reader(path)
    kept = {t.name for t in kept_quantized(reader, keep)}
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    total = 0.0
    for t in reader.tensors:
        if t.name in kept:
            total += t.data.nbytes * PACKED_OVERHEAD
            continue
        floats = 4 * math.prod(t.shape)
        copies = 3 if _is_linear(t.name) or t.name == "output.weight" else 1
        if t.name == "token_embd.weight" and tied:
            copies = 3  # the head's packed copies beside the embedding
        total += floats * copies
    return int(total)


def quantized_segments(
    reader: GGUFFile, cfg: ModelConfig, keep: frozenset[int]
) -> dict[str, QuantSegment]:
    """The kept tensors' blocks by Hugging Face name: views of the memory-mapped file, or (Llama's
    q/k, whose rows are un-interleaved) copies."""
    arch = cfg.extra.get("hf_model_type", cfg.model_type)
    out: dict[str, QuantSegment] = {}
    for t in kept_quantized(reader, keep):
        name = _gguf_to_hf_name(t.name)
        data = t.data
        if arch in ("llama", "mistral"):
            if name.endswith("q_proj.weight"):
                data = _unpermute_rope(data, cfg.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                data = _unpermute_rope(data, cfg.num_key_value_heads)
        out[name] = QuantSegment(t.tensor_type, torch.from_numpy(np.ascontiguousarray(data)))
    return out


def iter_gguf_weights(
    reader: GGUFFile, cfg: ModelConfig, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized float32 tensors in file order (those named in skip, GGUF names, left out);
    two threads dequantize (NumPy releases the GIL), a few tensors ahead of the consumer."""
    import gguf

    arch = cfg.extra.get("hf_model_type", cfg.model_type)

    def convert(t: Any) -> tuple[str, torch.Tensor]:
        try:
            arr = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type))
        except NotImplementedError as e:  # a type the gguf package cannot dequantize
            raise GGUFError(f"model file {reader.path}: tensor {t.name!r}: {one_line(e)}") from None
        name = _gguf_to_hf_name(t.name)
        if arch in ("llama", "mistral"):
            if name.endswith("q_proj.weight"):
                arr = _unpermute_rope(arr, cfg.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                arr = _unpermute_rope(arr, cfg.num_key_value_heads)
        return name, torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy of the map

    with ThreadPoolExecutor(max_workers=2) as pool:
        pending: deque[Future[tuple[str, torch.Tensor]]] = deque()
        for t in reader.tensors:
            if t.name in skip:
                continue
            pending.append(pool.submit(convert, t))
            if len(pending) > 4:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

"""Build a model and fill its weights: its shape read from the source (config.json, GGUF
metadata or a built-in shape), the model allocated uninitialised on the device, then its
weights copied in from safetensors files or a GGUF file, or drawn at random (dummy).
Where the source is: cbgen.models.source; its tokenizer: cbgen.models.tokenizer.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from cbgen.models.base import CausalLM, store_weights_in
from cbgen.models.config import BUILTIN_SHAPES, ModelConfig
from cbgen.models.errors import ModelFileError, one_line
from cbgen.models.gguf_model import (
    gguf_config,
    gguf_reader,
    iter_gguf_weights,
    kept_quantized,
    quantized_segments,
)
from cbgen.models.hub import shard_files
from cbgen.models.quantized import QuantSegment
from cbgen.models.registry import build_model
from cbgen.models.safetensors_file import check_safetensors
from cbgen.models.source import ModelSource


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "shape":
        return BUILTIN_SHAPES[source.path]
    if source.kind == "hf":
        return ModelConfig.from_json(Path(source.path) / "config.json")
    return gguf_config(gguf_reader(source.path))


def _safetensors_files(folder: str) -> list[Path]:
    """The weight files, each with its header checked: with an index, only the shards it
    names (a folder may hold other copies of the weights)."""
    shards = shard_files(Path(folder))
    if shards is None and (Path(folder) / "model.safetensors.index.json").exists():
        raise ModelFileError(
            f"{Path(folder) / 'model.safetensors.index.json'}: no weight_map of file names"
        )
    files = (
        [Path(folder) / f for f in shards] if shards else sorted(Path(folder).glob("*.safetensors"))
    )
    for file in files:
        check_safetensors(file)
    return files


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def stored_weight_dtype(source: ModelSource, load_format: str = "auto") -> torch.dtype | None:
    """The dtype most of a safetensors checkpoint's weights are stored in, read from the
    headers alone; None for GGUF files (dequantized to float32) and dummy weights."""
    if source.kind != "hf" or load_format == "dummy":
        return None
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for file in _safetensors_files(source.path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                part = f.get_slice(name)
                kind = part.get_dtype()
                counts[kind] = counts.get(kind, 0) + math.prod(part.get_shape())
    most = max(counts, key=counts.__getitem__, default=None)
    return _SAFETENSORS_DTYPES.get(most) if most is not None else None


def iter_safetensors_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every file's header is checked before the first tensor is read, so a broken shard
    fails before any loading."""
    from safetensors import SafetensorError, safe_open

    files = _safetensors_files(folder)
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelFileError(f"model file {file}: {one_line(e)}") from None


def _init_dummy(model: CausalLM, seed: int) -> None:
    """Random weights: N(0, 0.02), norms 1. Drawn on the CPU so a seed gives the same model
    on every device."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.empty(p.shape).normal_(0.0, 0.02, generator=gen))


def _skip(self: nn.Module) -> None:
    pass


@contextmanager
def _uninitialized(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Modules built inside get empty parameters of `dtype` on `device`: their random
    initialisation is skipped, as the weights are loaded over it. (The meta device does the
    same, but its first use imports about a second's worth of torch internals.)"""
    saved = (nn.Linear.reset_parameters, nn.Embedding.reset_parameters, torch.get_default_dtype())
    nn.Linear.reset_parameters = _skip  # type: ignore[method-assign]
    nn.Embedding.reset_parameters = _skip  # type: ignore[method-assign]
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        nn.Linear.reset_parameters = saved[0]  # type: ignore[method-assign]
        nn.Embedding.reset_parameters = saved[1]  # type: ignore[method-assign]
        torch.set_default_dtype(saved[2])


def load_model(
    source: ModelSource,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
    weight_dtype: torch.dtype | None = None,
    keep_quantized: frozenset[int] = frozenset(),
) -> CausalLM:
    """Allocate the model on the device in the engine dtype without initialising it, then
    fill it; RoPE tables stay float32. weight_dtype (CPU): the matmul weights and embedding
    kept in this half dtype instead, upcast as they are used (cbgen.models.base.TorchLinear).
    The model runs the torch reference until cbgen.runtime.bind binds it to its device.
    keep_quantized (a GGUF file): the ggml types whose linear tensors stay in their blocks
    (cbgen.models.quantized; the runtime runs them so), every other tensor dequantized."""
    with _uninitialized(dtype, device):
        model = build_model(cfg, max_positions)
    if weight_dtype is not None and weight_dtype != dtype:
        store_weights_in(model, weight_dtype)
    model.rope.build()
    if load_format == "dummy" or source.kind == "shape":
        _init_dummy(model, seed)
    else:
        segments: dict[str, QuantSegment] = {}
        if source.kind == "gguf":
            reader = gguf_reader(source.path)
            kept = kept_quantized(reader, keep_quantized)
            with warnings.catch_warnings():  # views of the read-only map: never written to
                warnings.simplefilter("ignore", UserWarning)
                segments = quantized_segments(reader, cfg, keep_quantized) if kept else {}
            weights = iter_gguf_weights(reader, cfg, frozenset(t.name for t in kept))
        else:
            weights = iter_safetensors_weights(source.path)
        try:
            loaded = model.load_weights(weights) | model.attach_quantized(segments)
        except ModelFileError:
            raise
        except ValueError as e:  # an unexpected or misshapen tensor: name the file it came from
            raise ModelFileError(f"model {source.path}: {e}") from None
        missing = model.expected_weight_names() - loaded
        if missing:
            raise ModelFileError(f"model {source.path}: missing weights {sorted(missing)[:5]}")
    model.eval()
    model.requires_grad_(False)
    return model

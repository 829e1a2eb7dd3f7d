"""A model's tokenizer (and chat template) through transformers: from the model's folder, or
converted once from a GGUF file's vocabulary and kept in the user's cache. A broken tokenizer
file is named in the error.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

from cbgen.models.errors import ModelFileError, one_line, read_json_object
from cbgen.models.gguf_file import GGUFError
from cbgen.models.source import ModelSource


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

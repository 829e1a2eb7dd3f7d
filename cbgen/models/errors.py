"""ModelFileError, the one error a broken model file raises, and a JSON reader that raises it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ModelFileError(ValueError):
    """A model file (GGUF, safetensors, config.json, tokenizer files) that cannot be read or is
    malformed. The message is one line naming the file and what is wrong; as a ValueError it
    reaches the command line's `error: ...` handlers, never a traceback."""


def one_line(e: BaseException) -> str:
    """An exception's message on one line (third-party messages can span several)."""
    return " ".join(str(e).split()) or type(e).__name__


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object (config.json, tokenizer_config.json, ...)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ModelFileError(f"{path} is not UTF-8 text") from None
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelFileError(
            f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    except RecursionError:
        raise ModelFileError(f"{path} is not valid JSON (nested too deep)") from None
    if not isinstance(value, dict):
        kind = "an array" if isinstance(value, list) else "a single value"
        raise ModelFileError(f"{path} must hold a JSON object, not {kind}")
    return value

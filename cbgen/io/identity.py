"""What a run's outputs depend on, recorded so that a resume cannot mix two settings in one file.

    staging/settings.json           written when a run starts (after the check below)
    final Parquet, schema metadata  key b"cbgen.settings": the same record, kept with the rows

A resume compares this run's record with the one in the staging folder (or, when there is
none, the final file's) and refuses on any difference, naming each option with both values.
Options that change only speed (threads, slots, token budget, block size, policy, device,
attention backend, display, --max-error-rate) are not recorded and may change freely.

Files (the model's and the input) are identified by size and a SHA-256 of their first and
last MiB, not by path: a moved file is the same file, a replaced one is not, and a
multi-gigabyte checkpoint costs two small reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cbgen.config import EngineConfig
from cbgen.io.input_files import edge_digest
from cbgen.io.rows import ChatDefaults, ColumnSpec
from cbgen.sampling_params import SamplingParams

SETTINGS_FILE = "settings.json"
METADATA_KEY = b"cbgen.settings"
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
)


class SettingsMismatchError(Exception):
    """Resuming would mix outputs generated under different settings."""


def file_digest(path: Path) -> str:
    """size:sha256(first MiB + last MiB)."""
    with path.open("rb") as f:

        def read_at(offset: int, length: int) -> bytes:
            f.seek(offset)
            return f.read(length)

        return edge_digest(path.stat().st_size, read_at)


def model_digest(kind: str, path: str) -> str:
    """One digest over the files a model's outputs come from (weights, config, tokenizer)."""
    if kind == "shape":
        return f"shape:{path}"
    p = Path(path)
    files = (
        [p]
        if p.is_file()
        else sorted(
            [p / name for name in _MODEL_FILES if (p / name).is_file()]
            + list(p.glob("*.safetensors"))
        )
    )
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}={file_digest(f)};".encode())
    return h.hexdigest()[:32]


def run_identity(
    input_path: str,
    columns: ColumnSpec,
    config: EngineConfig,
    defaults: SamplingParams,
    model_kind: str,
    model_path: str,
    chat: ChatDefaults | None = None,
    input_fingerprint: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """Every setting that changes what a row's output is, as plain JSON values.
    input_fingerprint: the input's (name, digest) from its source (a URL, a prefix of files);
    None: the local file at input_path."""
    chat = chat or ChatDefaults()
    if input_fingerprint is None:
        input_fingerprint = (
            ("-", "-")
            if input_path == "-"
            else (os.path.basename(input_path), file_digest(Path(input_path)))
        )
    template = chat.template
    return {
        "chat_template": None
        if template is None
        else hashlib.sha256(template.encode()).hexdigest()[:16],
        "chat_template_kwargs": chat.kwargs,
        "model": config.model or model_path,
        "model_files": model_digest(model_kind, model_path),
        "load_format": config.load_format,
        "dtype": config.dtype,
        "dequantize": config.dequantize,
        "seed": config.seed,
        "max_model_len": config.max_model_len,
        "sampling": dataclasses.asdict(defaults),
        "prompt_column": columns.prompt_column,
        "id_column": columns.id_column,
        "keep_columns": list(columns.keep_columns),
        "input": input_fingerprint[0],
        "input_file": input_fingerprint[1],
    }


# How each recorded key is named in a message, and which keys only label another key's value.
_LABELS = {
    "model_files": "model (its files)",
    "input_file": "input file (its contents)",
    "load_format": "--load-format",
    "dtype": "--dtype",
    "dequantize": "--dequantize",
    "seed": "--seed",
    "max_model_len": "--max-model-len",
    "prompt_column": "--prompt-column",
    "id_column": "--id-column",
    "keep_columns": "--keep-columns",
    "chat_template": "--chat-template (its text)",
    "chat_template_kwargs": "--chat-template-kwargs",
}
_SAMPLING_LABELS = {"structured_outputs": "--json-schema / --regex / --choice"}
_SHOWN_WITH = {"model_files": "model", "input_file": "input"}
_NOT_COMPARED = set(_SHOWN_WITH.values())


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'name: before -> now' for every recorded setting this run changes."""
    out: list[str] = []
    for key, now in current.items():
        if key in _NOT_COMPARED or key not in recorded:
            continue
        before = recorded[key]
        if key == "sampling":
            for name, value in now.items():
                if name in before and before[name] != value:
                    flag = _SAMPLING_LABELS.get(name, f"--{name.replace('_', '-')}")
                    out.append(f"{flag}: {before[name]!r} -> {value!r}")
            continue
        if before != now:
            if key in _SHOWN_WITH:
                shown = _SHOWN_WITH[key]
                before, now = recorded.get(shown, before), current.get(shown, now)
                if before == now:
                    before, now = f"{before} (earlier contents)", f"{now} (changed)"
            out.append(f"{_LABELS.get(key, key)}: {before!r} -> {now!r}")
    return out


def check_resume(
    recorded: dict[str, Any] | None, current: dict[str, Any], where: Path | str
) -> None:
    """Raise SettingsMismatchError when `recorded` (from `where`) differs from this run."""
    if recorded is None:
        return
    diffs = differences(recorded, current)
    if diffs:
        raise SettingsMismatchError(
            f"the earlier results in {where} were generated with other settings; resuming would "
            f"mix them in one output. Differences (earlier -> this run): {'; '.join(diffs)}. "
            "Rerun with the earlier settings to resume, pass --overwrite to start over, or "
            "choose another -o"
        )


def read_settings(path: Path) -> dict[str, Any] | None:
    try:
        return parse_settings(path.read_bytes())
    except OSError:
        return None


def parse_settings(data: bytes | None) -> dict[str, Any] | None:
    """A settings record's JSON; None when absent or cut short by a crash (nothing recorded)."""
    if data is None:
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def from_metadata(metadata: dict[bytes, bytes] | None) -> dict[str, Any] | None:
    if not metadata or METADATA_KEY not in metadata:
        return None
    try:
        data = json.loads(metadata[METADATA_KEY])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def write_settings(path: Path, identity: dict[str, Any]) -> None:
    """Write atomically (a crash leaves the old record or the new one, never half)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(identity, indent=1, sort_keys=True))
    os.replace(tmp, path)

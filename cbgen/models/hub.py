"""Models named as on the Hugging Face Hub: `org/name`, or `org/name:file.gguf` for one GGUF
file of a repository, at a revision (branch, tag or commit).

    local cache first (works offline, HF_HUB_OFFLINE=1) ─ else, when online, download only
    what cbgen reads: config, generation config, tokenizer and chat template files, then the
    safetensors weights (the shards model.safetensors.index.json names when there is one, so
    a repository's other copies are never fetched) ─ never *.bin or *.pt pickles

The `cbgen` command sets HF_HUB_OFFLINE=1 where the environment does not set it, so it downloads
only when run with HF_HUB_OFFLINE=0; the Python API follows the environment as it is. A model
missing from the cache while offline is an error that says so.

The snapshot folder's name is the resolved commit; it goes into the engine's description and
the run summary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<file>[^/:]+\.gguf))?$")
METADATA_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
]


class HubError(ValueError):
    """A Hub model that cannot be had: not cached while offline, no such repository or file."""


class NotCached(HubError):
    """No snapshot of the repository at that revision in the cache (a local-only look-up)."""


@dataclass(frozen=True)
class HubModel:
    path: Path
    """The snapshot folder (or the GGUF file in it)."""
    commit: str


def parse_hub_id(model: str) -> tuple[str, str | None] | None:
    """('org/name', 'file.gguf' or None) for a Hub id; None for anything else."""
    m = HUB_ID.match(model)
    return None if m is None else (m.group("repo"), m.group("file"))


def resolve_hub(
    repo: str, filename: str | None, revision: str | None, download_dir: str | None
) -> HubModel:
    """The local snapshot of repo at revision: from the cache, else downloaded when online."""
    from huggingface_hub import constants

    try:
        return _snapshot(repo, filename, revision, download_dir, local_only=True)
    except HubError as cached_error:
        if constants.HF_HUB_OFFLINE:
            # huggingface_hub's own hint (pass local_files_only=False) means nothing to a user
            why = "" if isinstance(cached_error, NotCached) else f" ({cached_error})"
            raise HubError(
                f"model {repo}{'' if revision is None else '@' + revision} is not in the local "
                f"Hugging Face cache{'' if download_dir is None else ' ' + download_dir}{why} and "
                "downloads are off (HF_HUB_OFFLINE=1, which the cbgen command sets unless the "
                "environment sets it): set HF_HUB_OFFLINE=0 to let cbgen download it"
            ) from None
    return _snapshot(repo, filename, revision, download_dir, local_only=False)


def _snapshot(
    repo: str, filename: str | None, revision: str | None, cache: str | None, local_only: bool
) -> HubModel:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    def fetch(patterns: list[str]) -> Path:
        try:
            return Path(
                snapshot_download(
                    repo,
                    revision=revision,
                    cache_dir=cache,
                    allow_patterns=patterns,
                    local_files_only=local_only,
                )
            )
        except LocalEntryNotFoundError as e:
            if local_only:
                raise NotCached(str(e).splitlines()[0]) from None
            raise HubError(str(e).splitlines()[0]) from None
        except (HfHubHTTPError, OSError) as e:
            raise HubError(f"model {repo}: {str(e).splitlines()[0]}") from None

    if filename is not None:
        folder = fetch([filename, *METADATA_PATTERNS])
        path = folder / filename
        if not path.is_file():
            raise HubError(f"model {repo} has no file {filename} at {folder.name}")
        return HubModel(path, folder.name)
    folder = fetch(METADATA_PATTERNS)
    weights = shard_files(folder)
    folder = fetch([*METADATA_PATTERNS, *(weights or ["*.safetensors"])])
    return HubModel(folder, folder.name)


def shard_files(folder: Path) -> list[str] | None:
    """The safetensors files model.safetensors.index.json names, or None without an index."""
    import json

    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # the loader names the broken index when it reads the folder

"""Where a run writes: a local path (writer.OutputLayout) or a bucket (bucket.BucketLayout),
behind one contract that the session and each engine's part follow, so that resume, the lock,
the settings check, the atomic final file and the summary mean the same in both.

    prepare ─ lock().acquire() ─ drop_stale_temps ─ clear (--overwrite) ─ check_compatible
    ─ staged_settings / final_settings (resume check) ─ write_settings
    ─ done_keys ─ staging_writer(schema, tag) (per engine) ─ lock().check() ─ finalize
    ─ final_stats ─ write_summary ─ export_to ─ release
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import pyarrow as pa

from cbgen.io.bucket import BucketLayout
from cbgen.io.shard import Shard
from cbgen.io.storage import Storage, is_url
from cbgen.io.writer import KeySet, OutputLayout


class RunLock(Protocol):
    unsupported: str | None
    """Why the output's store cannot exclude a second run, when it cannot (a warning)."""

    def acquire(self) -> None:
        """Take it, or raise OutputLockedError naming the holder."""

    def check(self) -> None:
        """Raise when it is no longer held (a lease taken over), before the final file."""

    def release(self) -> None: ...


class StagingSink(Protocol):
    """Finished rows of one engine: StagingWriter (a local stream), PartWriter (part objects)."""

    buffer: list[dict[str, Any]]
    rows_written: int

    def add(self, record: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class RunOutput(Protocol):
    """One output of a run. Messages name `final`, `staging` and `summary` (a path or URL)."""

    @property
    def final(self) -> Any: ...

    @property
    def staging(self) -> Any: ...

    @property
    def summary(self) -> Any: ...

    @property
    def export(self) -> Any: ...

    @property
    def shard(self) -> Shard | None: ...

    def prepare(self) -> None: ...

    def lock(self, on_lost: Callable[[str], None] | None = None) -> RunLock: ...

    def drop_stale_temps(self) -> None: ...

    def clear(self) -> None: ...

    def discard_empty_staging(self) -> None: ...

    def has_partial_results(self) -> bool: ...

    def final_exists(self) -> bool: ...

    def check_compatible(self, schema: pa.Schema) -> None: ...

    def staged_settings(self) -> dict[str, Any] | None: ...

    def final_settings(self) -> dict[str, Any] | None: ...

    def write_settings(self, run_id: dict[str, Any]) -> None: ...

    def done_keys(self) -> KeySet: ...

    def staging_writer(self, schema: pa.Schema, tag: str) -> StagingSink: ...

    def finalize(self, schema: pa.Schema) -> int: ...

    def final_stats(self) -> dict[str, Any]: ...

    def write_summary(self, summary: dict[str, Any]) -> None: ...

    def export_to(self, fmt: str, model: str) -> int: ...


def build_output(
    input_path: str,
    output: str | None,
    shard: Shard | None,
    export: bool,
    storage: Storage,
    **bucket_options: Any,
) -> OutputLayout | BucketLayout:
    """A bucket when OUTPUT is an s3:// or gs:// URL (or, without -o, INPUT is one), else a
    local path. bucket_options: flush_rows, flush_interval_s, lease_s."""
    remote = is_url(output) if output is not None else is_url(input_path)
    if remote:
        return BucketLayout.build(input_path, output, shard, export, storage, **bucket_options)
    return OutputLayout.build(input_path, output, shard, export)

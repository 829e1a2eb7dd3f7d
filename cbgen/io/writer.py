"""Where output goes, how finished rows reach disk as the run goes, and how a rerun resumes.

Layout (one output; with --shard I/N, OUTPUT is a folder and the names carry the shard):

    prompts.out.parquet          final file: appears atomically (write .tmp, fsync, rename)
    prompts.out.summary.json     run summary
    prompts.out.partial/         staging while running: one Arrow IPC stream per process and
        run-<time>-<pid>.arrows  run; finished rows are appended as a record batch at most
                                 0.1 s after they finish, so `kill -9` loses only the requests
                                 in flight and the last 0.1 s of finished rows
        .lock                    the running process's lock (cbgen.io.lock)
        settings.json            what the rows depend on (cbgen.io.identity)

    OUTPUT/part-00003-of-00008.parquet, OUTPUT/_part-00003-of-00008.summary.json and
    OUTPUT/_part-00003-of-00008.partial/ under --shard 3/8 ('_' keeps pyarrow's dataset
    discovery away from everything but the parts)

Resume: the (id, sample_index) keys of the final file and of every staging stream (read up to
a truncated tail) are the rows already done. finalize() copies the final file (if any) and
the staging rows not already in it into a new final file, then removes the staging folder.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cbgen.io import identity
from cbgen.io.export import export
from cbgen.io.lock import LOCK_NAME, OutputLock
from cbgen.io.shard import Shard
from cbgen.io.summary import table_stats, write_summary

STAGING_SUFFIX = ".arrows"
ROW_GROUP_ROWS = 16384
_ROW_GROUP_BYTES = 32 << 20
_KEY_DTYPE = "S16"


class OutputError(Exception):
    """The output cannot be written (not writable, disk full, incompatible leftovers): fatal."""


def os_error_message(e: OSError, what: str) -> str:
    if e.errno == errno.ENOSPC:
        return f"no space left on the device while writing {what}"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {what}: {e.strerror or 'permission denied'}"
    return f"cannot write {what}: {e.strerror or e}"


@dataclass(frozen=True)
class OutputLayout:
    final: Path
    summary: Path
    staging: Path
    shard: Shard | None = None
    export: Path | None = None
    """The JSONL file exported from `final` at the end (--output-format jsonl or openai)."""

    @classmethod
    def build(
        cls, input_path: str, output: str | None, shard: Shard | None, export: bool = False
    ) -> OutputLayout:
        """Default OUTPUT: INPUT's stem + .out.parquet beside it (.out.jsonl when exporting; a
        folder of parts under --shard). When exporting, the Parquet file beside the JSONL one
        (same stem) is the run's record: resume keys, settings and the summary's figures."""
        suffix = ".jsonl" if export else ".parquet"
        if output is None:
            if input_path == "-":
                raise OutputError("reading stdin: give the output file with -o")
            p = Path(input_path)
            out = p.with_name(p.stem + ".out" + suffix)
        else:
            out = Path(output).expanduser()
        if shard is None:
            if out.is_dir():
                raise OutputError(
                    f"output {out} is a folder (a folder of parts is written only with --shard)"
                )
            stem = out.name.removesuffix(suffix)
            if export and out.suffix == ".parquet":
                raise OutputError(f"output {out}: a JSONL export needs another name (.jsonl)")
            final = out.with_name(stem + ".parquet")
            return cls(
                final,
                out.with_name(stem + ".summary.json"),
                out.with_name(stem + ".partial"),
                export=out if export else None,
            )
        if out.exists() and not out.is_dir():
            raise OutputError(
                f"with --shard the output {out} is a folder of parts, but it is a file"
            )
        label = shard.label
        return cls(
            out / (f"_{label}.parquet" if export else f"{label}.parquet"),
            out / f"_{label}.summary.json",
            out / f"_{label}.partial",
            shard,
            out / f"{label}.jsonl" if export else None,
        )

    def prepare(self) -> None:
        """Create the folders and prove they are writable."""
        try:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            self.staging.mkdir(exist_ok=True)
            probe = self.staging / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise OutputError(
                f"output folder {self.final.parent}: {os_error_message(e, 'there')} "
                f"({type(e).__name__})"
            ) from None

    def drop_stale_temps(self) -> None:
        """Remove temp files of a finalize that died (only under the lock: a live run's
        finalize writes one too)."""
        for stale in self.final.parent.glob(f".{self.final.name}.tmp-*"):
            stale.unlink(missing_ok=True)

    def discard_empty_staging(self) -> None:
        """Remove the staging folder if no rows were ever written to it (a run that failed at
        start-up leaves no trace; its lock and settings files go with it)."""
        if self.staging.is_dir() and not any(
            p.suffix == STAGING_SUFFIX for p in self.staging.iterdir()
        ):
            shutil.rmtree(self.staging, ignore_errors=True)

    def clear(self) -> None:
        """Forget earlier results (--overwrite); the staging folder and its lock stay."""
        for p in (self.final, self.summary, self.export):
            if p is not None:
                p.unlink(missing_ok=True)
        if self.staging.is_dir():
            for p in self.staging.iterdir():
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.name != LOCK_NAME:
                    p.unlink(missing_ok=True)

    def staging_files(self) -> list[Path]:
        """Oldest first (names start with the run's start time)."""
        return sorted(self.staging.glob(f"*{STAGING_SUFFIX}")) if self.staging.is_dir() else []

    def has_partial_results(self) -> bool:
        return any(p.stat().st_size > 0 for p in self.staging_files())

    # ---- the run's steps (cbgen.io.outputs.RunOutput; BucketLayout has the same) ------------
    def lock(self, on_lost: Callable[[str], None] | None = None) -> OutputLock:
        """The flock is never lost while the process lives: on_lost is not called."""
        return OutputLock(self.staging)

    def final_exists(self) -> bool:
        return self.final.exists()

    def check_compatible(self, schema: pa.Schema) -> None:
        check_compatible(self, schema)

    def staged_settings(self) -> dict[str, Any] | None:
        return identity.read_settings(self.staging / identity.SETTINGS_FILE)

    def final_settings(self) -> dict[str, Any] | None:
        if not self.final.exists():
            return None
        try:
            metadata = pq.read_schema(self.final).metadata
        except (pa.ArrowException, OSError):
            return None  # check_compatible has already refused an unreadable file
        return identity.from_metadata(metadata)

    def write_settings(self, run_id: dict[str, Any]) -> None:
        path = self.staging / identity.SETTINGS_FILE
        try:
            identity.write_settings(path, run_id)
        except OSError as e:
            raise OutputError(os_error_message(e, str(path))) from None

    def done_keys(self) -> KeySet:
        return load_done_keys(self)

    def staging_writer(self, schema: pa.Schema, tag: str) -> StagingWriter:
        return StagingWriter(self.staging, schema, tag)

    def finalize(self, schema: pa.Schema) -> int:
        return finalize(self, schema)

    def final_stats(self) -> dict[str, Any]:
        return table_stats(self.final)

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_summary(self.summary, summary)

    def export_to(self, fmt: str, model: str) -> int:
        assert self.export is not None
        try:
            return export(self.final, self.export, fmt, model)
        except OSError as e:
            raise OutputError(
                os_error_message(e, str(self.export)) + f"; the rows are safe in {self.final}"
            ) from None


def staging_tag(worker: int | None = None) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    return f"run-{stamp}-{time.time_ns() % 10**9:09d}-{os.getpid()}" + (
        "" if worker is None else f"-w{worker}"
    )


# ---- keys --------------------------------------------------------------------------------


def row_key(row_id: str, sample_index: int) -> bytes:
    """128-bit identity of one output row: collisions are out of reach at any input size."""
    return hashlib.blake2b(f"{row_id}\x1f{sample_index}".encode(), digest_size=16).digest()


def batch_keys(batch: pa.RecordBatch | pa.Table) -> np.ndarray:
    ids = batch.column("id").to_pylist()
    samples = batch.column("sample_index").to_pylist()
    return np.array([row_key(i, s) for i, s in zip(ids, samples, strict=True)], dtype=_KEY_DTYPE)


class KeySet:
    """A sorted array of 16-byte keys: 16 bytes a row (10 million rows: 160 MB).

    numpy's S16 drops trailing NUL bytes when it hands out an item, so single lookups compare
    against the key with its trailing NULs stripped; for keys of equal length this is exact."""

    def __init__(self, keys: np.ndarray | None = None) -> None:
        self.keys = (
            np.unique(keys) if keys is not None and len(keys) else np.empty(0, dtype=_KEY_DTYPE)
        )

    @classmethod
    def from_arrays(cls, arrays: Iterable[np.ndarray]) -> KeySet:
        parts = [a for a in arrays if len(a)]
        return cls(np.concatenate(parts) if parts else None)

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: bytes) -> bool:
        if not len(self.keys):
            return False
        i = int(self.keys.searchsorted(key))
        return i < len(self.keys) and self.keys[i] == key.rstrip(b"\0")

    def contains_many(self, keys: np.ndarray) -> np.ndarray:
        if not len(self.keys) or not len(keys):
            return np.zeros(len(keys), dtype=bool)
        idx = np.minimum(self.keys.searchsorted(keys), len(self.keys) - 1)
        return np.asarray(self.keys[idx] == keys)


# ---- staging streams -----------------------------------------------------------------------


def read_stream(path: Path) -> Iterator[pa.RecordBatch]:
    """Every complete record batch of a staging stream; a tail cut short by `kill -9` (or a
    file with not even a schema yet) ends the stream quietly."""
    # Read through a plain file, not a memory map: batches own their memory and are freed
    # after use, so reading a large stream does not grow the resident set.
    if not path.stat().st_size:
        return
    with pa.OSFile(str(path), "rb") as source:
        try:
            reader = pa.ipc.open_stream(source)
        except (pa.ArrowInvalid, OSError):
            return
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except (pa.ArrowInvalid, OSError):
                return  # truncated tail
            yield batch


def stream_schema(path: Path) -> pa.Schema | None:
    if not path.stat().st_size:
        return None
    try:
        with pa.OSFile(str(path), "rb") as source:
            return pa.ipc.open_stream(source).schema
    except (pa.ArrowInvalid, OSError):
        return None


def check_compatible(layout: OutputLayout, schema: pa.Schema) -> None:
    """Earlier results must have this run's columns, or resuming would mix two tables."""
    found: list[tuple[Path, pa.Schema]] = []
    if layout.final.exists():
        try:
            found.append((layout.final, pq.read_schema(layout.final)))
        except (pa.ArrowException, OSError) as e:
            raise OutputError(
                f"existing output {layout.final} is not readable Parquet ({e}); remove it or pass --overwrite"
            ) from None
    for f in layout.staging_files():
        s = stream_schema(f)
        if s is not None:
            found.append((f, s))
    for path, s in found:
        if s.names != schema.names:
            raise OutputError(
                f"earlier results in {path} have columns {s.names}, this run writes {schema.names}: "
                "use the same --keep-columns, another -o, or --overwrite to start again"
            )


def load_done_keys(layout: OutputLayout) -> KeySet:
    """Keys of every row already written, in the final file or in staging streams."""
    arrays: list[np.ndarray] = []
    if layout.final.exists():
        pf = pq.ParquetFile(layout.final)
        for b in pf.iter_batches(batch_size=ROW_GROUP_ROWS, columns=["id", "sample_index"]):
            arrays.append(batch_keys(b))
    for f in layout.staging_files():
        for b in read_stream(f):
            arrays.append(batch_keys(b))
    return KeySet.from_arrays(arrays)


class StagingWriter:
    """Appends finished rows to this process's staging stream: `add` buffers, `flush` writes
    one record batch straight to the OS (no Python-side buffer), so a killed process leaves
    every flushed row readable."""

    def __init__(self, staging: Path, schema: pa.Schema, tag: str, flush_rows: int = 1024) -> None:
        self.schema = schema
        self.path = staging / f"{tag}{STAGING_SUFFIX}"
        self.flush_rows = flush_rows
        self.buffer: list[dict[str, Any]] = []
        self.rows_written = 0
        try:
            self._sink = pa.OSFile(str(self.path), "wb")
            self._writer = pa.ipc.new_stream(self._sink, schema)
        except OSError as e:
            raise OutputError(os_error_message(e, str(self.path))) from None
        self._closed = False

    def add(self, record: dict[str, Any]) -> None:
        self.buffer.append(record)
        if len(self.buffer) >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        batch = pa.RecordBatch.from_pylist(self.buffer, schema=self.schema)
        try:
            self._writer.write_batch(batch)
        except OSError as e:
            raise OutputError(os_error_message(e, str(self.path))) from None
        self.rows_written += len(self.buffer)
        self.buffer.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
            self._writer.close()
            self._sink.close()
        except OSError as e:
            raise OutputError(os_error_message(e, str(self.path))) from None


# ---- finalize ------------------------------------------------------------------------------


def finalize(layout: OutputLayout, schema: pa.Schema) -> int:
    """Fold staging rows into the final file atomically; returns the final file's row count.

    A staging row whose key is already in the old final file is dropped: that happens only
    when a previous finalize died between the rename and removing the staging folder."""
    files = layout.staging_files()
    if layout.final.exists() and not any(f.stat().st_size for f in files):
        shutil.rmtree(layout.staging, ignore_errors=True)
        return pq.ParquetFile(layout.final).metadata.num_rows
    old_keys = KeySet()
    if layout.final.exists():
        pf = pq.ParquetFile(layout.final)
        old_keys = KeySet.from_arrays(
            batch_keys(b)
            for b in pf.iter_batches(batch_size=ROW_GROUP_ROWS, columns=["id", "sample_index"])
        )
    tmp = layout.final.parent / f".{layout.final.name}.tmp-{os.getpid()}"
    rows = 0
    try:
        with pq.ParquetWriter(tmp, schema) as writer:
            if layout.final.exists():
                for b in pq.ParquetFile(layout.final).iter_batches(batch_size=ROW_GROUP_ROWS):
                    rows += _write_group(writer, [b], schema)

            def staged() -> Iterator[pa.RecordBatch]:
                for f in files:
                    for b in read_stream(f):
                        if len(old_keys):
                            b = b.filter(pa.array(~old_keys.contains_many(batch_keys(b))))
                        yield b

            rows += write_row_groups(writer, staged(), schema)
        _fsync(tmp)
        os.replace(tmp, layout.final)
        _fsync(layout.final.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(
            os_error_message(e, str(layout.final))
            + f"; the finished rows are safe in {layout.staging}"
        ) from None
    shutil.rmtree(layout.staging, ignore_errors=True)
    return rows


def write_row_groups(
    writer: pq.ParquetWriter, batches: Iterable[pa.RecordBatch], schema: pa.Schema
) -> int:
    """Write the batches gathered into row groups of up to ROW_GROUP_ROWS rows (or 32 MiB);
    returns the rows written."""
    rows = size = 0
    pending: list[pa.RecordBatch] = []
    for b in batches:
        if not b.num_rows:
            continue
        pending.append(b)
        size += b.nbytes
        if sum(p.num_rows for p in pending) >= ROW_GROUP_ROWS or size >= _ROW_GROUP_BYTES:
            rows += _write_group(writer, pending, schema)
            pending, size = [], 0
    return rows + _write_group(writer, pending, schema)


def _write_group(writer: pq.ParquetWriter, batches: list[pa.RecordBatch], schema: pa.Schema) -> int:
    if not batches:
        return 0
    table = pa.Table.from_batches(batches)
    if not table.schema.equals(schema):
        table = table.cast(schema)
    writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
    return table.num_rows


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""Outputs in object storage (s3://, gs://): a local output's guarantees, with objects.

    s3://b/out.parquet            the final file: one upload that appears whole or not at all
                                  (cbgen.io.uploads), every input row (and sample) once
    s3://b/out.summary.json       the run summary, written after the final file
    s3://b/out.partial/           staging, while runs go on:
        .lease                    one run per output (cbgen.io.lease)
        settings.json             what the rows depend on (cbgen.io.identity)
        run-<time>-<pid>-00000.arrows   part objects: each a whole Arrow IPC stream of the rows
                                  finished in one window, --flush-rows rows or --flush-interval
                                  seconds, whichever comes first

    s3://b/out/ (a prefix) or --shard I/N: a folder of parts, as on a local disk:
        out/part-00003-of-00008.parquet, out/_part-00003-of-00008.summary.json,
        out/_part-00003-of-00008.partial/ (without --shard the part is 0 of 1)

An object store cannot append, so where a local run appends record batches to one stream, a run
here uploads a new part object per window, from a thread (the loop goes on generating; two
windows queued at most hold it back). A part object is one PUT: it exists whole or not at all,
so `kill -9` loses the rows in flight and those of the window not yet uploaded. A rerun reads
the keys of the final file and of every part, and skips those rows.

finalize() reads the keys of the final file (if any) and every part, keeps the first copy of
each key (a row is written twice only if a run that lost its lease went on uploading), writes
the final file from them, and only then removes the parts.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cbgen.io import identity
from cbgen.io.export import write_lines
from cbgen.io.lease import DEFAULT_LEASE_S, LEASE_NAME, Lease, lease_store
from cbgen.io.shard import Shard
from cbgen.io.storage import Location, Storage, StorageError, describe
from cbgen.io.summary import summary_json, table_stats
from cbgen.io.uploads import delete, exists, list_objects, open_upload, read_object, write_object
from cbgen.io.writer import (
    ROW_GROUP_ROWS,
    STAGING_SUFFIX,
    KeySet,
    OutputError,
    batch_keys,
    write_row_groups,
)

DEFAULT_FLUSH_ROWS = 4096
DEFAULT_FLUSH_INTERVAL_S = 15.0
_READERS = 8
"""Objects read at once (listing keys, finalize): the store's latency, not its bandwidth,
bounds reading many small parts."""


@dataclass(frozen=True)
class BucketLayout:
    final: Location
    summary: Location
    staging: Location
    storage: Storage
    shard: Shard | None = None
    export: Location | None = None
    flush_rows: int = DEFAULT_FLUSH_ROWS
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S
    lease_s: float = DEFAULT_LEASE_S

    @classmethod
    def build(
        cls,
        input_path: str,
        output: str | None,
        shard: Shard | None,
        export: bool,
        storage: Storage,
        **options: Any,
    ) -> BucketLayout:
        """As OutputLayout.build: OUTPUT defaults to INPUT's stem + .out.parquet beside it; an
        OUTPUT ending in / is a folder of parts (part 0 of 1 without --shard)."""
        suffix = ".jsonl" if export else ".parquet"
        if output is None:
            if not input_path.lower().startswith(("s3://", "gs://", "gcs://")):
                raise OutputError(f"reading {input_path}: give the output with -o")
            src = Location.parse(input_path)
            stem = src.name.rsplit(".", 1)[0] if "." in src.name else src.name
            out = src.sibling(stem + ".out" + suffix) if src.key else src.child("out" + suffix)
        else:
            try:
                out = Location.parse(output)
            except ValueError as e:
                raise OutputError(str(e)) from None
        if not out.key:
            out = out.child("")
        if shard is None and not out.is_folder:
            stem = out.name.removesuffix(suffix)
            if export and out.name.endswith(".parquet"):
                raise OutputError(f"output {out}: a JSONL export needs another name (.jsonl)")
            return cls(
                out.sibling(stem + ".parquet"),
                out.sibling(stem + ".summary.json"),
                out.sibling(stem + ".partial/"),
                storage,
                export=out if export else None,
                **options,
            )
        folder = out if out.is_folder else Location(out.scheme, out.bucket, out.key + "/")
        label = (shard or Shard(0, 1)).label
        return cls(
            folder.child(f"_{label}.parquet" if export else f"{label}.parquet"),
            folder.child(f"_{label}.summary.json"),
            folder.child(f"_{label}.partial/"),
            storage,
            shard,
            folder.child(f"{label}.jsonl") if export else None,
            **options,
        )

    # ---- the run's steps (RunOutput) ----------------------------------------------------------
    def prepare(self) -> None:
        """The bucket exists and these credentials reach it."""
        try:
            self.storage.check_bucket(self.final)
        except StorageError as e:
            raise OutputError(f"output {e}") from None

    def lock(self, on_lost: Callable[[str], None] | None = None) -> Lease:
        loc = self.staging.child(LEASE_NAME)
        try:
            store = lease_store(self.storage, loc)
        except StorageError as e:
            raise OutputError(str(e)) from None
        return _CheckedLease(store, loc, self.lease_s, on_lost, self)

    def drop_stale_temps(self) -> None:
        """A final upload that died is invisible on S3 (never completed); elsewhere its
        temporary object is removed."""
        for loc, _ in self._objects(self.final.sibling("")):
            if loc.name.startswith(f"_{self.final.name}.tmp-"):
                self._call(delete, loc)

    def clear(self) -> None:
        for loc in (self.final, self.summary, self.export):
            if loc is not None:
                self._call(delete, loc)
        for loc, _ in self._objects(self.staging):
            if loc.name != LEASE_NAME:
                self._call(delete, loc)

    def discard_empty_staging(self) -> None:
        if not self.part_objects():
            self._call(delete, self.staging.child(identity.SETTINGS_FILE))

    def has_partial_results(self) -> bool:
        return bool(self.part_objects())

    def final_exists(self) -> bool:
        return bool(self._call(exists, self.final))

    def check_compatible(self, schema: pa.Schema) -> None:
        found: list[tuple[str, pa.Schema]] = []
        if self.final_exists():
            try:
                found.append((self.final.url, pq.read_schema(self._open(self.final))))
            except (pa.ArrowException, OSError) as e:
                raise OutputError(
                    f"existing output {self.final} is not readable Parquet ({e}); remove it or "
                    "pass --overwrite"
                ) from None
        runs: dict[str, Location] = {}
        for loc, _ in self.part_objects():  # one part of each run tells its columns
            runs.setdefault(loc.name.rsplit("-", 1)[0], loc)
        for loc in runs.values():
            data = self._call(read_object, loc)
            if data:
                found.append((loc.url, pa.ipc.open_stream(pa.py_buffer(data)).schema))
        for where, s in found:
            if s.names != schema.names:
                raise OutputError(
                    f"earlier results in {where} have columns {s.names}, this run writes "
                    f"{schema.names}: use the same --keep-columns, another -o, or --overwrite "
                    "to start again"
                )

    def staged_settings(self) -> dict[str, Any] | None:
        data = self._call(read_object, self.staging.child(identity.SETTINGS_FILE))
        return identity.parse_settings(data)

    def final_settings(self) -> dict[str, Any] | None:
        if not self.final_exists():
            return None
        try:
            metadata = pq.read_schema(self._open(self.final)).metadata
        except (pa.ArrowException, OSError):
            return None  # check_compatible has already refused an unreadable file
        return identity.from_metadata(metadata)

    def write_settings(self, run_id: dict[str, Any]) -> None:
        data = json.dumps(run_id, indent=1, sort_keys=True).encode()
        self._call(write_object, self.staging.child(identity.SETTINGS_FILE), data)

    def done_keys(self) -> KeySet:
        return KeySet.from_arrays(k for keys in self._key_arrays() for k in keys)

    def staging_writer(self, schema: pa.Schema, tag: str) -> PartWriter:
        return PartWriter(self, schema, tag)

    def finalize(self, schema: pa.Schema) -> int:
        """Fold the parts into the final file (each key once); returns its row count."""
        parts = self.part_objects()
        if self.final_exists() and not parts:
            self._drop_parts([])
            return int(pq.ParquetFile(self._open(self.final)).metadata.num_rows)
        arrays = self._key_arrays(parts)
        keys = [np.concatenate(a) if a else np.empty(0, dtype="S16") for a in arrays]
        everything = np.concatenate(keys) if keys else np.empty(0, dtype="S16")
        keep = np.zeros(len(everything), dtype=bool)
        keep[np.unique(everything, return_index=True)[1]] = True
        masks: list[np.ndarray] = []
        start = 0
        for k in keys:
            masks.append(keep[start : start + len(k)])
            start += len(k)
        old = self.final_exists()

        def batches() -> Iterator[pa.RecordBatch]:
            sources: list[Iterator[pa.RecordBatch]] = []
            if old:
                sources.append(
                    pq.ParquetFile(self._open(self.final)).iter_batches(batch_size=ROW_GROUP_ROWS)
                )
            sources += [self._part_batches(loc) for loc, _ in parts]
            for source, mask in zip(sources, masks, strict=True):
                at = 0
                for b in source:
                    part = mask[at : at + b.num_rows]
                    at += b.num_rows
                    yield b if part.all() else b.filter(pa.array(part))

        try:
            with open_upload(self.storage, self.final) as sink:
                writer = pq.ParquetWriter(sink, schema)
                rows = write_row_groups(writer, batches(), schema)
                writer.close()
        except StorageError as e:
            raise OutputError(f"{e}; the finished rows are safe in {self.staging}") from None
        self._drop_parts(parts)
        return rows

    def final_stats(self) -> dict[str, Any]:
        return table_stats(self._open(self.final))

    def write_summary(self, summary: dict[str, Any]) -> None:
        self._call(write_object, self.summary, summary_json(summary).encode())

    def export_to(self, fmt: str, model: str) -> int:
        assert self.export is not None
        try:
            with open_upload(self.storage, self.export) as sink:
                return write_lines(self._open(self.final), sink.write, fmt, model)
        except StorageError as e:
            raise OutputError(f"{e}; the rows are safe in {self.final}") from None

    # ---- objects -------------------------------------------------------------------------------
    def part_objects(self) -> list[tuple[Location, int]]:
        """The staging parts with rows, oldest run first (names start with the run's time)."""
        return [
            (loc, size)
            for loc, size in self._objects(self.staging)
            if loc.name.endswith(STAGING_SUFFIX) and size > 0
        ]

    def _objects(self, prefix: Location) -> list[tuple[Location, int]]:
        return list(self._call(list_objects, prefix))

    def _open(self, loc: Location) -> Any:
        try:
            return self.storage.filesystem(loc).open_input_file(loc.path)
        except (OSError, pa.ArrowException) as e:
            raise OutputError(describe(e, loc.url)) from None

    def _part_batches(self, loc: Location) -> Iterator[pa.RecordBatch]:
        data = self._call(read_object, loc)
        if data:
            yield from pa.ipc.open_stream(pa.py_buffer(data))

    def _key_arrays(
        self, parts: list[tuple[Location, int]] | None = None
    ) -> list[list[np.ndarray]]:
        """Keys of the final file's rows (first, if it exists) and of each part, in order."""
        if parts is None:
            parts = self.part_objects()
        out: list[list[np.ndarray]] = []
        if self.final_exists():
            pf = pq.ParquetFile(self._open(self.final))
            out.append(
                [
                    batch_keys(b)
                    for b in pf.iter_batches(
                        batch_size=ROW_GROUP_ROWS, columns=["id", "sample_index"]
                    )
                ]
            )
        with ThreadPoolExecutor(_READERS) as pool:
            out += pool.map(lambda p: [batch_keys(b) for b in self._part_batches(p[0])], parts)
        return out

    def _drop_parts(self, parts: list[tuple[Location, int]]) -> None:
        """Remove the staging objects but the lease (released last, by its holder)."""
        doomed = [loc for loc, _ in self._objects(self.staging) if loc.name != LEASE_NAME]
        with ThreadPoolExecutor(_READERS) as pool:
            list(pool.map(lambda loc: self._call(delete, loc), doomed))

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(self.storage, *args)
        except StorageError as e:
            raise OutputError(str(e)) from None


class _CheckedLease(Lease):
    """A Lease whose store errors are the run's output errors (exit 1, one line), and whose
    release leaves no empty staging folder behind."""

    def __init__(self, *args: Any) -> None:
        *lease_args, layout = args
        super().__init__(*lease_args)
        self.layout: BucketLayout = layout

    def acquire(self) -> None:
        try:
            super().acquire()
        except StorageError as e:
            raise OutputError(f"output {self.layout.final}: cannot take its lease: {e}") from None

    def release(self) -> None:
        super().release()
        # pyarrow keeps a deleted object's "folder" as an empty marker object (staging/); it
        # goes once the folder holds nothing else (the exact key: never another run's lease)
        if self.layout.staging.scheme == "s3":
            with contextlib.suppress(Exception):
                if not self.layout._objects(self.layout.staging):
                    self.layout.storage.s3_client().delete_object(
                        Bucket=self.layout.staging.bucket, Key=self.layout.staging.key
                    )


class PartWriter:
    """StagingWriter's counterpart in a bucket: `add` buffers, and every flush_rows rows or
    flush_interval_s seconds (checked at `flush`, which the loop calls often) the buffer becomes
    one part object, uploaded by a thread. `close` uploads the rest and waits."""

    def __init__(self, layout: BucketLayout, schema: pa.Schema, tag: str) -> None:
        self.layout = layout
        self.schema = schema
        self.tag = tag
        self.buffer: list[dict[str, Any]] = []
        self.rows_written = 0
        self._sequence = 0
        self._last = time.monotonic()
        self._queue: queue.Queue[tuple[Location, bytes, int] | None] = queue.Queue(maxsize=2)
        self._error: OutputError | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._upload, name="cbgen-upload", daemon=True)
        self._thread.start()

    def add(self, record: dict[str, Any]) -> None:
        self._raise()
        self.buffer.append(record)
        if len(self.buffer) >= self.layout.flush_rows:
            self._ship()

    def flush(self) -> None:
        self._raise()
        if self.buffer and time.monotonic() - self._last >= self.layout.flush_interval_s:
            self._ship()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.buffer and self._error is None:
                self._ship()
        finally:
            self._queue.put(None)
            self._thread.join()
        self._raise()

    def _ship(self) -> None:
        batch = pa.RecordBatch.from_pylist(self.buffer, schema=self.schema)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, self.schema) as w:
            w.write_batch(batch)
        loc = self.layout.staging.child(f"{self.tag}-{self._sequence:05d}{STAGING_SUFFIX}")
        self._sequence += 1
        self._queue.put((loc, sink.getvalue().to_pybytes(), batch.num_rows))
        self.buffer.clear()
        self._last = time.monotonic()

    def _upload(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain: the run is stopping
            loc, data, rows = item
            try:
                write_object(self.layout.storage, loc, data)
            except StorageError as e:
                self._error = OutputError(str(e))
                continue
            except Exception as e:  # anything else: the loop raises it, the thread lives on
                self._error = OutputError(f"{loc.url}: {type(e).__name__}: {e}")
                continue
            self.rows_written += rows

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

"""Streaming readers: JSONL (a file or stdin) and Parquet, yielding `InputRow`s one at a time.

Nothing is read whole: JSONL goes line by line, Parquet record batch by record batch (1024
rows), so memory does not grow with the input. Rows another shard or worker owns are skipped
before they are parsed.

The files may be local, objects in a bucket (s3://, gs://) or an http(s):// URL
(cbgen.io.input_files); a prefix of several files is one input (`FilesSource`): the files in
name order, row numbers continuing from one file to the next, so --shard, data-parallel workers
and resume see one sequence of rows. A remote input is read ahead by a thread (`may_block`), so
the network's waits overlap generation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from cbgen.io.input_files import InputFile, LocalFile, list_inputs
from cbgen.io.parse import SAMPLING_FIELDS, parse_json_line, parse_mapping
from cbgen.io.rows import ColumnSpec, InputRow
from cbgen.io.shard import RowFilter
from cbgen.io.storage import Storage, StorageError, describe, is_url

STDIN = "-"
PARQUET_SUFFIXES = (".parquet", ".pq")
_BATCH_ROWS = 1024
_CHUNK = 1 << 20


class InputError(Exception):
    """The input as a whole cannot be read (missing, unreadable, no prompt column): fatal."""


class InputSource:
    """Where rows come from. `rows` may be called once per process (stdin: once in all)."""

    name: str
    spec: ColumnSpec
    keep_types: dict[str, pa.DataType]
    """Output types of the pass-through columns."""

    row_count: int | None = None
    """The rows of the input, once `rows` has read to its end (blank lines left out)."""

    @property
    def may_block(self) -> bool:
        """Reading the next row may wait on a writer (a pipe) or the network, not just on the
        disk: the loop then reads ahead in a thread."""
        return False

    def rows(self, row_filter: RowFilter, first_row: int = 0) -> Iterator[InputRow]:
        """The rows `row_filter` owns, numbered from `first_row` (the files before this one)."""
        raise NotImplementedError

    def estimate_rows(self) -> tuple[int | None, bool]:
        """(number of rows, exact?); (None, False) when it cannot be known up front."""
        raise NotImplementedError

    def fingerprint(self) -> tuple[str, str]:
        """(name, digest) of the input's contents, as the resume check records them."""
        raise NotImplementedError


class JsonlSource(InputSource):
    def __init__(self, path: str, spec: ColumnSpec, file: InputFile | None = None) -> None:
        self.path = path
        self.name = "stdin" if path == STDIN else path
        self.spec = spec
        self.keep_types = {c: pa.string() for c in spec.keep_columns}
        self.file = file
        if file is not None:
            self.name = file.name
        elif path != STDIN:
            _check_readable(Path(path))
            self.file = LocalFile(Path(path))

    @property
    def may_block(self) -> bool:
        return self.path == STDIN or not isinstance(self.file, LocalFile)

    def rows(self, row_filter: RowFilter, first_row: int = 0) -> Iterator[InputRow]:
        if self.file is None:
            yield from self._parse(fd_lines(sys.stdin.fileno()), row_filter, first_row)
            return
        with self.file.stream() as f:
            yield from self._parse(chunk_lines(f.read), row_filter, first_row)

    def _parse(
        self, lines: Iterable[bytes], row_filter: RowFilter, first_row: int
    ) -> Iterator[InputRow]:
        row = first_row
        for lineno, raw in enumerate(lines, 1):
            if not raw.strip():
                continue  # blank lines are not rows (a trailing newline is common)
            if row_filter(row):
                yield parse_json_line(raw, row, lineno, self.spec)
            row += 1
        self.row_count = row - first_row

    def fingerprint(self) -> tuple[str, str]:
        if self.file is None:
            return "-", "-"
        return self.file.basename, self.file.digest()

    def estimate_rows(self) -> tuple[int | None, bool]:
        """Counts newlines in 1 MiB chunks (fast; blank lines other than doubled newlines are
        counted too, so the figure is an estimate until the reader reaches the end). A remote
        file is not read twice for this: (None, False)."""
        if not isinstance(self.file, LocalFile):
            return None, False
        lines = doubled = 0
        last = b"\n"
        with open(self.file.path, "rb") as f:
            while chunk := f.read(_CHUNK):
                lines += chunk.count(b"\n")
                doubled += chunk.count(b"\n\n") + (last == b"\n" and chunk[:1] == b"\n")
                last = chunk[-1:]
        if last != b"\n":
            lines += 1
        return max(0, lines - doubled), False


class ParquetSource(InputSource):
    def __init__(self, path: str, spec: ColumnSpec, file: InputFile | None = None) -> None:
        self.path = path
        self.name = path if file is None else file.name
        if file is None:
            _check_readable(Path(path))
            file = LocalFile(Path(path))
        self.input = file
        path = self.name
        try:
            self.file = pq.ParquetFile(file.random() if not isinstance(file, LocalFile) else path)
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"cannot read {path} as Parquet: {e}") from None
        schema = self.file.schema_arrow
        names = set(schema.names)
        if spec.prompt_column is not None:
            if spec.prompt_column not in names:
                raise InputError(
                    f"{path} has no column {spec.prompt_column!r} (--prompt-column); columns: {_list(schema.names)}"
                )
            prompt_cols = [spec.prompt_column]
        else:
            prompt_cols = [c for c in ("prompt", "messages") if c in names]
            if not prompt_cols:
                raise InputError(
                    f"{path} has neither a 'prompt' nor a 'messages' column; name the prompt column "
                    f"with --prompt-column (columns: {_list(schema.names)})"
                )
        id_column = spec.id_column
        if id_column is not None and id_column not in names:
            raise InputError(
                f"{path} has no column {id_column!r} (--id-column); columns: {_list(schema.names)}"
            )
        if id_column is None:
            id_column = next((c for c in ("id", "custom_id") if c in names), "id")
        missing = [c for c in spec.keep_columns if c not in names]
        if missing:
            raise InputError(
                f"{path} has no column {_list(missing)} (--keep-columns); columns: {_list(schema.names)}"
            )
        self.spec = ColumnSpec(spec.prompt_column, id_column, spec.keep_columns)
        self.keep_types = {c: schema.field(c).type for c in spec.keep_columns}
        wanted = [*prompt_cols, id_column, *spec.keep_columns, *sorted(SAMPLING_FIELDS & names)]
        self.columns = [c for c in dict.fromkeys(wanted) if c in names]

    @property
    def may_block(self) -> bool:
        return not isinstance(self.input, LocalFile)

    def fingerprint(self) -> tuple[str, str]:
        return self.input.basename, self.input.digest()

    def rows(self, row_filter: RowFilter, first_row: int = 0) -> Iterator[InputRow]:
        base = first_row
        self.row_count = self.file.metadata.num_rows
        for batch in self.file.iter_batches(batch_size=_BATCH_ROWS, columns=self.columns):
            picked = [i for i in range(batch.num_rows) if row_filter(base + i)]
            if picked:
                sub = (
                    batch.take(pa.array(picked, pa.int64()))
                    if len(picked) < batch.num_rows
                    else batch
                )
                cols: dict[str, list[Any]] = {c: sub.column(c).to_pylist() for c in self.columns}
                for k, i in enumerate(picked):
                    rec = {c: v[k] for c, v in cols.items()}
                    keep = {c: rec[c] for c in self.spec.keep_columns}
                    yield parse_mapping(rec, base + i, f"row {base + i}", self.spec, keep)
            base += batch.num_rows

    def estimate_rows(self) -> tuple[int | None, bool]:
        return self.file.metadata.num_rows, True


class FilesSource(InputSource):
    """Several files as one input (a prefix in a bucket): in name order, row numbers going on
    from one file to the next. Every file is of one kind, and Parquet files agree on the
    columns the run keeps."""

    def __init__(self, name: str, sources: list[InputSource]) -> None:
        self.name = name
        self.sources = sources
        first = sources[0]
        self.spec = first.spec
        self.keep_types = first.keep_types
        for other in sources[1:]:
            if type(other) is not type(first):
                raise InputError(
                    f"{name}: mixes Parquet and JSONL files ({first.name}, {other.name}); "
                    "give a prefix of one kind"
                )
            if other.keep_types != first.keep_types:
                raise InputError(
                    f"{name}: {other.name} gives the --keep-columns other types than "
                    f"{first.name} ({other.keep_types} against {first.keep_types})"
                )

    @property
    def may_block(self) -> bool:
        return any(s.may_block for s in self.sources)

    def rows(self, row_filter: RowFilter, first_row: int = 0) -> Iterator[InputRow]:
        base = first_row
        for source in self.sources:
            try:
                for row in source.rows(row_filter, base):
                    yield row if len(self.sources) == 1 else _in_file(row, source.name)
            except (OSError, pa.ArrowException) as e:  # the network, mid-file
                raise InputError(
                    f"input {describe(e, source.name)}; the rows finished so far are kept, rerun "
                    "the same command to resume"
                ) from None
            except StorageError as e:
                raise InputError(f"input {e}") from None
            assert source.row_count is not None
            base += source.row_count
        self.row_count = base - first_row

    def estimate_rows(self) -> tuple[int | None, bool]:
        total, exact = 0, True
        for s in self.sources:
            n, e = s.estimate_rows()
            if n is None:
                return None, False
            total, exact = total + n, exact and e
        return total, exact

    def fingerprint(self) -> tuple[str, str]:
        if len(self.sources) == 1:
            return self.sources[0].fingerprint()
        h = hashlib.sha256()
        for s in self.sources:
            base, digest = s.fingerprint()
            h.update(f"{base}={digest};".encode())
        return self.name.rstrip("/").rsplit("/", 1)[
            -1
        ], f"{len(self.sources)} files:{h.hexdigest()[:32]}"


def _in_file(row: InputRow, file: str) -> InputRow:
    """The row's position names its file ('s3://b/p/2.jsonl line 7') among several."""
    where = f"{file} {row.where}"
    error = None if row.error is None else f"{file} {row.error}"
    return dataclasses.replace(row, where=where, error=error)


def chunk_lines(read: Callable[[int], bytes], chunk: int = 1 << 16) -> Iterator[bytes]:
    """Lines from a stream read `chunk` bytes at a time (a remote object's stream has no
    readline)."""
    parts: list[bytes] = []  # the line being read, in pieces (a long line is not re-copied)
    while data := read(chunk):
        pieces = data.split(b"\n")
        if len(pieces) > 1:
            parts.append(pieces[0])
            yield b"".join(parts)
            yield from pieces[1:-1]
            parts = []
        if pieces[-1]:
            parts.append(pieces[-1])
    if parts:
        yield b"".join(parts)


def fd_lines(fd: int, chunk: int = 1 << 16) -> Iterator[bytes]:
    """Lines from a file descriptor through os.read, without Python's buffered reader: a
    thread blocked here holds no interpreter-level lock that could hang the exit."""
    return chunk_lines(lambda n: os.read(fd, n), chunk)


def open_source(path: str, spec: ColumnSpec, storage: Storage | None = None) -> InputSource:
    """By suffix: .parquet/.pq is Parquet, anything else (and `-`, stdin) JSONL; a file of
    another suffix that starts with Parquet's magic bytes is read as Parquet. A URL (s3://,
    gs://, http(s)://) may name one file or, in a bucket, a prefix of files."""
    if is_url(path):
        try:
            files = list_inputs(path, storage or Storage())
            sources: list[InputSource] = [
                (ParquetSource if f.is_parquet() else JsonlSource)(f.name, spec, f) for f in files
            ]
        except StorageError as e:
            raise InputError(f"input {e}") from None
        return FilesSource(path, sources)
    if path == STDIN:
        return JsonlSource(path, spec)
    p = Path(path)
    _check_readable(p)
    if p.suffix.lower() in PARQUET_SUFFIXES or _has_parquet_magic(p):
        return ParquetSource(path, spec)
    return JsonlSource(path, spec)


def _check_readable(p: Path) -> None:
    if not p.exists():
        raise InputError(f"input file {p} does not exist")
    if p.is_dir():
        raise InputError(f"input {p} is a directory, not a file")
    try:
        with open(p, "rb"):
            pass
    except OSError as e:
        raise InputError(f"cannot open input {p}: {e.strerror or e}") from None


def _has_parquet_magic(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"PAR1"


def _list(names: Any) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:12])
    return shown + (f", ... ({len(names)} in all)" if len(names) > 12 else "")

"""Streaming readers: JSONL (a file or stdin) and Parquet, yielding `InputRow`s one at a time.

Nothing is read whole: JSONL goes line by line, Parquet record batch by record batch (1024
rows), so memory does not grow with the input. Rows another shard or worker owns are skipped
before they are parsed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from cbgen.io.parse import SAMPLING_FIELDS, parse_json_line, parse_mapping
from cbgen.io.rows import ColumnSpec, InputRow
from cbgen.io.shard import RowFilter

STDIN = "-"
PARQUET_SUFFIXES = (".parquet", ".pq")
_BATCH_ROWS = 1024


class InputError(Exception):
    """The input as a whole cannot be read (missing, unreadable, no prompt column): fatal."""


class InputSource:
    """Where rows come from. `rows` may be called once per process (stdin: once in all)."""

    name: str
    spec: ColumnSpec
    keep_types: dict[str, pa.DataType]
    """Output types of the pass-through columns."""

    @property
    def may_block(self) -> bool:
        """Reading the next row may wait on a writer (a pipe), not just on the disk."""
        return False

    def rows(self, row_filter: RowFilter) -> Iterator[InputRow]:
        raise NotImplementedError

    def estimate_rows(self) -> tuple[int | None, bool]:
        """(number of rows, exact?); (None, False) when it cannot be known up front."""
        raise NotImplementedError


class JsonlSource(InputSource):
    def __init__(self, path: str, spec: ColumnSpec) -> None:
        self.path = path
        self.name = "stdin" if path == STDIN else path
        self.spec = spec
        self.keep_types = {c: pa.string() for c in spec.keep_columns}
        if path != STDIN:
            _check_readable(Path(path))

    @property
    def may_block(self) -> bool:
        return self.path == STDIN

    def rows(self, row_filter: RowFilter) -> Iterator[InputRow]:
        if self.path == STDIN:
            yield from self._parse(fd_lines(sys.stdin.fileno()), row_filter)
            return
        with open(self.path, "rb") as f:
            yield from self._parse(f, row_filter)

    def _parse(self, lines: Iterable[bytes], row_filter: RowFilter) -> Iterator[InputRow]:
        row = 0
        for lineno, raw in enumerate(lines, 1):
            if not raw.strip():
                continue  # blank lines are not rows (a trailing newline is common)
            if row_filter(row):
                yield parse_json_line(raw, row, lineno, self.spec)
            row += 1

    def estimate_rows(self) -> tuple[int | None, bool]:
        """Counts newlines in 1 MiB chunks (fast; blank lines other than doubled newlines are
        counted too, so the figure is an estimate until the reader reaches the end)."""
        if self.path == STDIN:
            return None, False
        lines = doubled = 0
        last = b"\n"
        with open(self.path, "rb") as f:
            while chunk := f.read(1 << 20):
                lines += chunk.count(b"\n")
                doubled += chunk.count(b"\n\n") + (last == b"\n" and chunk[:1] == b"\n")
                last = chunk[-1:]
        if last != b"\n":
            lines += 1
        return max(0, lines - doubled), False


class ParquetSource(InputSource):
    def __init__(self, path: str, spec: ColumnSpec) -> None:
        self.path = path
        self.name = path
        _check_readable(Path(path))
        try:
            self.file = pq.ParquetFile(path)
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

    def rows(self, row_filter: RowFilter) -> Iterator[InputRow]:
        base = 0
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


def fd_lines(fd: int, chunk: int = 1 << 16) -> Iterator[bytes]:
    """Lines from a file descriptor through os.read, without Python's buffered reader: a
    thread blocked here holds no interpreter-level lock that could hang the exit."""
    parts: list[bytes] = []  # the line being read, in pieces (a long line is not re-copied)
    while data := os.read(fd, chunk):
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


def open_source(path: str, spec: ColumnSpec) -> InputSource:
    """By suffix: .parquet/.pq is Parquet, anything else (and `-`, stdin) JSONL; a file of
    another suffix that starts with Parquet's magic bytes is read as Parquet."""
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

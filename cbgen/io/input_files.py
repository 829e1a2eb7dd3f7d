"""The input's files, wherever they are: a local file, an object in a bucket (s3://, gs://), or an
http(s):// URL (a presigned URL), each read as a stream (JSONL) or by ranges (Parquet's footer and
column chunks), never whole.

    InputFile          name, size, stream() (sequential reads), random() (seek + read), digest()
      LocalFile        a path on this machine
      StoreFile        one object, through pyarrow.fs (cbgen.io.storage)
      HttpFile         GET with Range headers, through urllib; a presigned URL is signed for GET
                       only, so the size comes from the first range's Content-Range, not a HEAD
    list_inputs(url)   an object, or every Parquet / JSONL object under a prefix in name order
                       (names starting with '_' or '.' are left out, as dataset readers do)

A file's digest is its size and a SHA-256 of its first and last MiB (two range reads), so a
multi-gigabyte object costs a resume check two small requests.
"""

from __future__ import annotations

import hashlib
import io
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.fs as pafs

from cbgen.io.storage import Location, Storage, StorageError, describe, redact

EDGE = 1 << 20
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_HTTP_TIMEOUT_S = 60
_HTTP_BLOCK = 1 << 20


def edge_digest(size: int, read_at: Callable[[int, int], bytes]) -> str:
    """size:sha256(first MiB + last MiB), read_at(offset, length) giving the bytes."""
    h = hashlib.sha256()
    h.update(read_at(0, min(EDGE, size)))
    if size > EDGE:
        start = max(EDGE, size - EDGE)
        h.update(read_at(start, size - start))
    return f"{size}:{h.hexdigest()[:32]}"


class InputFile:
    """One input file. `name` is what messages show (a URL without its query)."""

    name: str
    basename: str

    def size(self) -> int:
        raise NotImplementedError

    def stream(self) -> Any:
        """A binary stream with read(n)."""
        raise NotImplementedError

    def random(self) -> Any:
        """A seekable binary file (for Parquet)."""
        raise NotImplementedError

    def digest(self) -> str:
        with self.random() as f:

            def read_at(offset: int, length: int) -> bytes:
                f.seek(offset)
                return bytes(f.read(length))

            return edge_digest(self.size(), read_at)

    def is_parquet(self) -> bool:
        """By suffix; a file of another suffix that starts with Parquet's magic bytes too."""
        lower = self.basename.lower()
        if lower.endswith(PARQUET_SUFFIXES):
            return True
        if lower.endswith(JSONL_SUFFIXES) or self.size() < 4:
            return False
        with self.random() as f:
            return bytes(f.read(4)) == b"PAR1"


class LocalFile(InputFile):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = str(path)
        self.basename = path.name

    def size(self) -> int:
        return self.path.stat().st_size

    def stream(self) -> BinaryIO:
        return open(self.path, "rb")

    def random(self) -> BinaryIO:
        return open(self.path, "rb")


class StoreFile(InputFile):
    def __init__(self, storage: Storage, loc: Location, size: int | None = None) -> None:
        self.storage = storage
        self.loc = loc
        self.name = loc.url
        self.basename = loc.name
        self._size = size

    def size(self) -> int:
        if self._size is None:
            info = self._call(lambda fs: fs.get_file_info(self.loc.path))
            if info.type != pafs.FileType.File:
                raise StorageError(f"{self.name}: no such object")
            self._size = int(info.size or 0)
        return self._size

    def stream(self) -> Any:
        return self._call(lambda fs: fs.open_input_stream(self.loc.path))

    def random(self) -> Any:
        return self._call(lambda fs: fs.open_input_file(self.loc.path))

    def _call(self, fn: Callable[[pafs.FileSystem], Any]) -> Any:
        try:
            return fn(self.storage.filesystem(self.loc))
        except (OSError, pa.ArrowException) as e:
            raise StorageError(describe(e, self.name)) from None


class HttpFile(InputFile):
    """A URL read by range requests; `stream()` reads it front to back in one GET."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.name = redact(url)
        self.basename = url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
        self._size: int | None = None

    def size(self) -> int:
        if self._size is None:
            with self._get(0, 0) as r:
                total = (r.headers.get("Content-Range") or "").rpartition("/")[2]
                if r.status == 206 and total.isdigit():
                    self._size = int(total)
                elif r.status == 200 and (r.headers.get("Content-Length") or "").isdigit():
                    self._size = int(r.headers["Content-Length"])
                else:
                    raise StorageError(
                        f"{self.name}: the server gives no size (neither Content-Range nor "
                        "Content-Length); download the file and give its path"
                    )
        return self._size

    def read_at(self, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        with self._get(offset, offset + length - 1) as r:
            data: bytes = r.read()
            if r.status == 200:  # the server ignored the range: take our part of the whole
                data = data[offset : offset + length]
            return data

    def stream(self) -> Any:
        return self._open(urllib.request.Request(self.url))

    def random(self) -> Any:
        return io.BufferedReader(_RangeReader(self), buffer_size=_HTTP_BLOCK)

    def _get(self, first: int, last: int) -> Any:
        return self._open(
            urllib.request.Request(self.url, headers={"Range": f"bytes={first}-{last}"})
        )

    def _open(self, request: urllib.request.Request) -> Any:
        try:
            return urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S)
        except urllib.error.HTTPError as e:
            hint = {
                403: "access denied (HTTP 403): a presigned URL may have expired; make a new one",
                404: "not found (HTTP 404): check the URL",
                401: "unauthorized (HTTP 401): the URL needs credentials; use a presigned URL",
            }.get(e.code, f"HTTP {e.code} {e.reason}")
            raise StorageError(f"{self.name}: {hint}") from None
        except (urllib.error.URLError, OSError) as e:
            raise StorageError(f"{self.name}: cannot reach the server ({e})") from None


class _RangeReader(io.RawIOBase):
    """A seekable raw file over HttpFile.read_at (BufferedReader adds the buffering)."""

    def __init__(self, file: HttpFile) -> None:
        self.file = file
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.file.size()}[whence]
        self.pos = base + offset
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), max(0, self.file.size() - self.pos))
        data = self.file.read_at(self.pos, n)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def list_inputs(url: str, storage: Storage) -> list[InputFile]:
    """The file at `url`, or the Parquet / JSONL files under it when it is a prefix (folder),
    in name order. StorageError naming the URL when there is nothing to read."""
    if url.split("://", 1)[0].lower() in ("http", "https"):
        return [HttpFile(url)]
    loc = Location.parse(url)
    storage.check_bucket(loc)
    fs = storage.filesystem(loc)
    try:
        info = fs.get_file_info(loc.path)
        if info.type == pafs.FileType.File and not loc.is_folder:
            return [StoreFile(storage, loc, int(info.size or 0))]
        if info.type == pafs.FileType.NotFound:
            raise StorageError(f"{url}: no such object or prefix")
        found = fs.get_file_info(pafs.FileSelector(loc.path, recursive=True))
    except (OSError, pa.ArrowException) as e:
        raise StorageError(describe(e, url)) from None
    files: list[InputFile] = []
    for f in sorted(found, key=lambda f: f.path):
        rel = f.path[len(loc.path) :].lstrip("/")
        if f.type != pafs.FileType.File or any(p.startswith(("_", ".")) for p in rel.split("/")):
            continue
        if rel.lower().endswith(PARQUET_SUFFIXES + JSONL_SUFFIXES):
            child = Location(loc.scheme, loc.bucket, f.path.split("/", 1)[1])
            files.append(StoreFile(storage, child, int(f.size or 0)))
    if not files:
        raise StorageError(
            f"{url}: the prefix holds no Parquet or JSONL files (.parquet, .pq, .jsonl, .json, "
            ".ndjson; names starting with _ or . are left out)"
        )
    return files

"""Objects that appear whole or not at all, and small objects read and written in one request.

A streamed upload through pyarrow's output streams cannot be abandoned: their destructors
complete the upload, and a Parquet writer's destructor writes a footer, so an error halfway
through a final file would leave a short file that reads as valid. `open_upload` avoids that:

    S3    a multipart upload through boto3, parts of 16 MiB; completed by commit(), aborted by
          abort() (or never completed at all when the process dies): no object appears
    GCS   the bytes go to a temporary object beside the target ('_'-prefixed, which dataset
          readers skip), copied server-side onto the target by commit() and then deleted
"""

from __future__ import annotations

import contextlib
import io
import os
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from cbgen.io.storage import Location, Storage, StorageError, describe

_PART_BYTES = 16 << 20


class Upload(io.RawIOBase):
    """A write-only binary file: `commit()` makes the object appear, `abort()` drops it. As a
    context manager it commits when the block ends normally and aborts on an exception."""

    def __init__(self, storage: Storage, loc: Location) -> None:
        self.storage = storage
        self.loc = loc
        self.position = 0
        self.done = False

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def close(self) -> None:
        # pyarrow closes the sink it was given; the object appears only through commit()
        pass

    def commit(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Upload:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()


class _S3Upload(Upload):
    def __init__(self, storage: Storage, loc: Location) -> None:
        super().__init__(storage, loc)
        self.client = storage.s3_client()
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []

    def write(self, data: Any) -> int:
        if self.done:
            raise ValueError(f"{self.loc.url}: the upload is closed")
        view = memoryview(data).cast("B")
        self.buffer += view
        self.position += len(view)
        if len(self.buffer) >= _PART_BYTES:
            self._send_part()
        return len(view)

    def _send_part(self) -> None:
        try:
            if self.upload_id is None:
                r = self.client.create_multipart_upload(Bucket=self.loc.bucket, Key=self.loc.key)
                self.upload_id = r["UploadId"]
            number = len(self.parts) + 1
            r = self.client.upload_part(
                Bucket=self.loc.bucket,
                Key=self.loc.key,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=bytes(self.buffer),
            )
        except Exception as e:
            raise StorageError(describe(e, self.loc.url)) from None
        self.parts.append({"PartNumber": number, "ETag": r["ETag"]})
        self.buffer.clear()

    def commit(self) -> None:
        if self.done:
            return
        try:
            if self.upload_id is None:  # small: one request
                self.client.put_object(
                    Bucket=self.loc.bucket, Key=self.loc.key, Body=bytes(self.buffer)
                )
            else:
                if self.buffer:
                    self._send_part()
                self.client.complete_multipart_upload(
                    Bucket=self.loc.bucket,
                    Key=self.loc.key,
                    UploadId=self.upload_id,
                    MultipartUpload={"Parts": self.parts},
                )
        except StorageError:
            self.abort()
            raise
        except Exception as e:
            self.abort()
            raise StorageError(describe(e, self.loc.url)) from None
        self.done = True

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        self.buffer = bytearray()
        if self.upload_id is not None:
            # an upload never completed is invisible (lifecycle rules reap it): best effort
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(
                    Bucket=self.loc.bucket, Key=self.loc.key, UploadId=self.upload_id
                )


class _CopyUpload(Upload):
    """Any store pyarrow writes: a temporary object, copied onto the target on commit."""

    def __init__(self, storage: Storage, loc: Location) -> None:
        super().__init__(storage, loc)
        self.fs = storage.filesystem(loc)
        self.tmp = loc.sibling(f"_{loc.name}.tmp-{os.getpid()}")
        try:
            self.stream = self.fs.open_output_stream(self.tmp.path)
        except (OSError, pa.ArrowException) as e:
            raise StorageError(describe(e, loc.url)) from None

    def write(self, data: Any) -> int:
        n = len(memoryview(data).cast("B"))
        try:
            self.stream.write(data)
        except (OSError, pa.ArrowException) as e:
            raise StorageError(describe(e, self.loc.url)) from None
        self.position += n
        return n

    def commit(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            self.stream.close()
            self.fs.copy_file(self.tmp.path, self.loc.path)
        except (OSError, pa.ArrowException) as e:
            self._drop_tmp()
            raise StorageError(describe(e, self.loc.url)) from None
        self._drop_tmp()

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        with contextlib.suppress(OSError, pa.ArrowException):
            self.stream.close()  # completes the temporary object, which goes next
        self._drop_tmp()

    def _drop_tmp(self) -> None:
        with contextlib.suppress(OSError, pa.ArrowException):
            self.fs.delete_file(self.tmp.path)


def open_upload(storage: Storage, loc: Location) -> Upload:
    return _S3Upload(storage, loc) if loc.scheme == "s3" else _CopyUpload(storage, loc)


def write_object(storage: Storage, loc: Location, data: bytes) -> None:
    """One small object in one request: it appears whole or not at all."""
    try:
        with storage.filesystem(loc).open_output_stream(loc.path) as out:
            out.write(data)
    except (OSError, pa.ArrowException) as e:
        raise StorageError(describe(e, loc.url)) from None


def read_object(storage: Storage, loc: Location) -> bytes | None:
    """A small object's bytes; None when there is no such object."""
    try:
        with storage.filesystem(loc).open_input_stream(loc.path) as f:
            return bytes(f.read())
    except FileNotFoundError:
        return None
    except (OSError, pa.ArrowException) as e:
        raise StorageError(describe(e, loc.url)) from None


def list_objects(storage: Storage, prefix: Location) -> list[tuple[Location, int]]:
    """(object, size) under a prefix, in name order; [] when there is none."""
    fs = storage.filesystem(prefix)
    try:
        found = fs.get_file_info(
            pafs.FileSelector(prefix.path, recursive=False, allow_not_found=True)
        )
    except (OSError, pa.ArrowException) as e:
        raise StorageError(describe(e, prefix.url)) from None
    out = [
        (Location(prefix.scheme, prefix.bucket, f.path.split("/", 1)[1]), int(f.size or 0))
        for f in found
        if f.type == pafs.FileType.File
    ]
    return sorted(out, key=lambda item: item[0].key)


def exists(storage: Storage, loc: Location) -> bool:
    try:
        return storage.filesystem(loc).get_file_info(loc.path).type == pafs.FileType.File
    except (OSError, pa.ArrowException) as e:
        raise StorageError(describe(e, loc.url)) from None


def delete(storage: Storage, loc: Location) -> None:
    try:
        storage.filesystem(loc).delete_file(loc.path)
    except FileNotFoundError:
        pass
    except (OSError, pa.ArrowException) as e:
        raise StorageError(describe(e, loc.url)) from None

"""One run per output in object storage: a lease object, where a local output has flock.

    s3://b/out.partial/.lease    {pid, host, started, duration_s, token} of the run holding it

    acquire   create it only if absent (S3: PUT with If-None-Match: *; GCS: ifGenerationMatch=0).
              Present: its age (the store's clock: the response's Date minus its Last-Modified)
              under the holder's duration means a live holder -> OutputLockedError naming it
              (exit 4); older, the holder is gone: take it over by replacing exactly the version
              read (If-Match: ETag / ifGenerationMatch), so of two runs taking over one wins.
    renew     a thread rewrites it every duration / 4, again only over our own version. A
              replace refused means another run has taken it (we were stalled past expiry):
              the run is told (on_lost) and stops, uploading nothing more.
    release   delete it, if it is still ours.

No object store offers flock's "the kernel drops it when the holder dies", so a run killed with
kill -9 holds its output until its lease expires (--lease-duration, 60 s by default); a rerun
before then is refused with the time left.

Why boto3 for S3: pyarrow's S3FileSystem, which carries the data, writes objects
unconditionally (its output streams take no If-None-Match or If-Match), so a conditional create
cannot be made through it. boto3 (botocore) can, and it is also what resolves the endpoint and
region from the standard configuration for both clients (cbgen.io.storage); it carries only
these few small requests. GCS: the google-cloud-storage client, for the same reason, imported
only for gs:// outputs (`pip install google-cloud-storage`). A store that ignores the
conditions (an old S3-compatible server) is detected by a second conditional create that
succeeds: the run goes on with a warning, as on a filesystem without locks.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cbgen.io.lock import OutputLockedError
from cbgen.io.storage import Location, Storage, StorageError, describe

LEASE_NAME = ".lease"
DEFAULT_LEASE_S = 60.0


class LeaseLostError(Exception):
    """Another run has taken this output's lease (this one stalled past its expiry)."""


@dataclass(frozen=True)
class Version:
    """A lease object as read: its body, its version (ETag, generation), its age in seconds by
    the store's clock."""

    body: bytes
    tag: str
    age_s: float


class LeaseStore:
    """Conditional operations on one small object."""

    def create(self, body: bytes) -> str | None:
        """Write only if absent; the new version, or None when it exists."""
        raise NotImplementedError

    def read(self) -> Version | None:
        raise NotImplementedError

    def replace(self, body: bytes, tag: str) -> str | None:
        """Write only over version `tag`; the new version, or None when it is not current."""
        raise NotImplementedError

    def delete(self) -> None:
        raise NotImplementedError


class S3LeaseStore(LeaseStore):
    def __init__(self, storage: Storage, loc: Location) -> None:
        self.client = storage.s3_client()
        self.loc = loc

    def create(self, body: bytes) -> str | None:
        return self._put(body, IfNoneMatch="*")

    def replace(self, body: bytes, tag: str) -> str | None:
        return self._put(body, IfMatch=tag)

    def _put(self, body: bytes, **condition: str) -> str | None:
        from botocore.exceptions import ClientError

        try:
            r = self.client.put_object(
                Bucket=self.loc.bucket, Key=self.loc.key, Body=body, **condition
            )
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            # 412: the condition failed; 409: a concurrent conditional write won; 404: the
            # object we meant to replace was deleted
            if status in (409, 412, 404) or code in ("PreconditionFailed", "NoSuchKey"):
                return None
            raise
        return str(r["ETag"])

    def read(self) -> Version | None:
        from botocore.exceptions import ClientError

        try:
            r = self.client.get_object(Bucket=self.loc.bucket, Key=self.loc.key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        body = r["Body"].read()
        now = _http_date(r.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date"))
        age = (now or time.time()) - r["LastModified"].timestamp()
        return Version(body, str(r["ETag"]), max(0.0, age))

    def delete(self) -> None:
        self.client.delete_object(Bucket=self.loc.bucket, Key=self.loc.key)


class GcsLeaseStore(LeaseStore):
    """Generation preconditions through google-cloud-storage (not tested here: no GCS server
    runs in the test suite). The age uses this machine's clock against the object's update
    time, so the nodes' clocks should agree to well under the lease's duration."""

    def __init__(self, storage: Storage, loc: Location) -> None:
        try:
            from google.cloud import storage as gcs  # type: ignore[attr-defined]
        except ImportError:
            raise StorageError(
                f"{loc.url}: a gs:// output takes its lease through the google-cloud-storage "
                "package: pip install google-cloud-storage"
            ) from None
        endpoint = storage.get("endpoint_url")
        options = {"api_endpoint": endpoint} if endpoint else None
        client = (
            gcs.Client.create_anonymous_client()
            if storage.flag("anonymous")
            else gcs.Client(project=storage.get("project_id"), client_options=options)
        )
        self.bucket = client.bucket(loc.bucket)
        self.key = loc.key

    def create(self, body: bytes) -> str | None:
        return self._upload(body, 0)

    def replace(self, body: bytes, tag: str) -> str | None:
        return self._upload(body, int(tag))

    def _upload(self, body: bytes, generation: int) -> str | None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        blob = self.bucket.blob(self.key)
        try:
            blob.upload_from_string(body, if_generation_match=generation)
        except (PreconditionFailed, NotFound):
            return None
        return str(blob.generation)

    def read(self) -> Version | None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        blob = self.bucket.get_blob(self.key)  # its generation and update time
        if blob is None:
            return None
        try:
            body = blob.download_as_bytes(if_generation_match=blob.generation)
        except (NotFound, PreconditionFailed):
            return None  # replaced or gone meanwhile: the caller reads again or creates
        age = time.time() - blob.updated.timestamp()
        return Version(body, str(blob.generation), max(0.0, age))

    def delete(self) -> None:
        self.bucket.blob(self.key).delete()


def lease_store(storage: Storage, loc: Location) -> LeaseStore:
    return S3LeaseStore(storage, loc) if loc.scheme == "s3" else GcsLeaseStore(storage, loc)


class Lease:
    """The lease on one output: `acquire()` or OutputLockedError naming the holder; renewed by
    a thread until `release()`; `check()` before the final object is written."""

    def __init__(
        self,
        store: LeaseStore,
        loc: Location,
        duration_s: float = DEFAULT_LEASE_S,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.loc = loc
        self.duration_s = duration_s
        self.on_lost = on_lost
        self.token = uuid.uuid4().hex
        self.holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime()),
            "duration_s": duration_s,
            "token": self.token,
        }
        self.tag: str | None = None
        self.unsupported: str | None = None
        """Why the store could not exclude a second run, when it could not."""
        self.took_over: dict[str, Any] | None = None
        """The expired holder this run replaced, if any (for a message)."""
        self.lost: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewed = time.monotonic()

    def acquire(self) -> None:
        body = json.dumps(self.holder).encode()
        try:
            tag = self.store.create(body)
            if tag is None:
                tag = self._take_over(body)
            elif self.store.create(body) is not None:  # the store ignored If-None-Match
                self.unsupported = "it ignores conditional writes (If-None-Match)"
                current = self.store.read()
                tag = current.tag if current is not None else tag
        except (StorageError, OutputLockedError):
            raise
        except Exception as e:
            raise StorageError(describe(e, self.loc.url)) from None
        self.tag = tag
        self._renewed = time.monotonic()
        self._thread = threading.Thread(target=self._renew_loop, name="cbgen-lease", daemon=True)
        self._thread.start()

    def _take_over(self, body: bytes) -> str:
        for _ in range(3):  # the object may vanish between our create and our read
            current = self.store.read()
            if current is None:
                tag = self.store.create(body)
                if tag is not None:
                    return tag
                continue
            holder = _parse(current.body)
            duration = float(holder.get("duration_s", DEFAULT_LEASE_S))
            if current.age_s < duration:
                raise OutputLockedError(self._held_message(holder, current.age_s, duration))
            tag = self.store.replace(body, current.tag)
            if tag is not None:
                self.took_over = dict(holder, expired_s=round(current.age_s - duration, 1))
                return tag
        current = self.store.read()
        holder = _parse(current.body) if current else {}
        raise OutputLockedError(self._held_message(holder, 0.0, self.duration_s))

    def _held_message(self, holder: dict[str, Any], age: float, duration: float) -> str:
        who = (
            f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started "
            f"{holder.get('started', '?')}"
            if holder
            else "a run whose lease could not be read"
        )
        left = max(0.0, duration - age)
        return (
            f"another run is writing this output ({who}; lease {self.loc.url}, renewed "
            f"{age:.0f} s ago, expires in {left:.0f} s unless renewed): wait for it to finish "
            "or stop it, then rerun to resume (a run that died leaves the output free once its "
            "lease expires)"
        )

    def _renew_loop(self) -> None:
        interval = self.duration_s / 4
        while not self._stop.wait(interval):
            try:
                self.renew()
            except LeaseLostError:
                return
            except Exception:  # the network: try again next time, until the lease runs out
                if time.monotonic() - self._renewed > self.duration_s:
                    self._lose(
                        f"the lease {self.loc.url} could not be renewed for {self.duration_s:.0f} s"
                    )
                    return

    def renew(self) -> None:
        """Rewrite the lease over our own version; LeaseLostError when it is no longer ours."""
        with self._lock:
            if self.lost is not None:
                raise LeaseLostError(self.lost)
            assert self.tag is not None
            body = json.dumps(dict(self.holder, renewed=time.time())).encode()
            tag = self.store.replace(body, self.tag)
            if tag is None:
                current = self.store.read()
                holder = _parse(current.body) if current else {}
                self._lose(
                    f"another run (pid {holder.get('pid', '?')} on {holder.get('host', '?')}) "
                    f"has taken over the lease {self.loc.url}: this run stalled past its expiry"
                )
                raise LeaseLostError(self.lost)
            self.tag = tag
            self._renewed = time.monotonic()

    def check(self) -> None:
        """LeaseLostError unless the lease is still ours (renewed now, so that the final object
        is written by its holder)."""
        if self.unsupported is None:
            self.renew()

    def _lose(self, message: str) -> None:
        self.lost = message
        if self.on_lost is not None:
            self.on_lost(message)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        with self._lock:
            if self.tag is None or self.lost is not None:
                return
            try:
                current = self.store.read()
                if current is not None and _parse(current.body).get("token") == self.token:
                    self.store.delete()
            except Exception:
                pass  # it expires by itself
            self.tag = None


def _parse(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _http_date(value: str | None) -> float | None:
    if not value:
        return None
    from email.utils import parsedate_to_datetime

    try:
        return parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None

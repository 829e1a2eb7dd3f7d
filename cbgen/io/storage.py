"""Where a run's data lives when it is not a local path: object storage (s3://, gs://) and
http(s):// URLs (a presigned URL of one object), and how to reach it.

    s3://bucket/key        pyarrow.fs.S3FileSystem; credentials from the standard chain (the
                           AWS_* variables, AWS_PROFILE and ~/.aws files, instance roles); the
                           endpoint and region as botocore resolves them (AWS_ENDPOINT_URL[_S3],
                           the profile's endpoint_url and region), which pyarrow does not read
    gs://bucket/key        pyarrow.fs.GcsFileSystem; Application Default Credentials
    https://host/path?sig  read only, by HTTP range requests (urllib); the query is never shown

--storage-option KEY=VALUE sets what the environment does not (an S3-compatible endpoint, a
region, keys, anonymous access); the keys are pyarrow's, listed in STORAGE_OPTIONS, and the same
values reach boto3 for the S3 lease (cbgen.io.lease), so both clients see one configuration.

Errors of the store (a missing bucket, access denied, expired or missing credentials, an
unreachable endpoint) become StorageError: one line naming the URL and what to fix.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pyarrow.fs as pafs

OBJECT_SCHEMES = ("s3", "gs")
HTTP_SCHEMES = ("http", "https")
_ALIASES = {"gcs": "gs", "s3a": "s3"}

STORAGE_OPTIONS: dict[str, dict[str, str]] = {
    "s3": {
        "endpoint_url": "an S3-compatible endpoint, e.g. http://minio.local:9000 (MinIO, Ceph)",
        "region": "the bucket's region",
        "access_key": "access key id (else the standard credential chain)",
        "secret_key": "secret access key",
        "session_token": "session token of temporary credentials",
        "anonymous": "true: unsigned requests (public buckets)",
        "force_virtual_addressing": "true: bucket.host addressing on a custom endpoint",
        "connect_timeout": "seconds",
        "request_timeout": "seconds",
    },
    "gs": {
        "endpoint_url": "a GCS-compatible endpoint (an emulator)",
        "anonymous": "true: unauthenticated requests (public buckets)",
        "project_id": "the project new buckets would belong to",
    },
}
_BOOLS = {"anonymous", "force_virtual_addressing"}
_FLOATS = {"connect_timeout", "request_timeout"}


class StorageError(Exception):
    """A store cannot be used as asked (bucket, permissions, credentials, endpoint): fatal."""


def is_url(path: str) -> bool:
    """s3://, gs:// (gcs://) or http(s)://; anything else is a local path."""
    scheme = path.split("://", 1)[0].lower() if "://" in path else ""
    return _ALIASES.get(scheme, scheme) in (*OBJECT_SCHEMES, *HTTP_SCHEMES)


def redact(url: str) -> str:
    """The URL without its query: a presigned URL's query is a credential."""
    parts = urlsplit(url)
    return parts._replace(query="").geturl() + ("?..." if parts.query else "")


@dataclass(frozen=True)
class Location:
    """One object or prefix in a bucket: s3://bucket/key (key '' is the bucket's root)."""

    scheme: str
    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str) -> Location:
        """ValueError naming the URL when it is not s3:// or gs:// with a bucket."""
        parts = urlsplit(url)
        scheme = _ALIASES.get(parts.scheme.lower(), parts.scheme.lower())
        if scheme not in OBJECT_SCHEMES:
            raise ValueError(f"{url}: not an object-store URL (s3://bucket/key or gs://bucket/key)")
        if not parts.netloc or parts.query or parts.fragment:
            raise ValueError(
                f"{url}: expected {scheme}://BUCKET/KEY (a bucket name, then the object's key)"
            )
        return cls(scheme, parts.netloc, parts.path.lstrip("/"))

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    @property
    def path(self) -> str:
        """pyarrow.fs's path: bucket/key."""
        return f"{self.bucket}/{self.key}".rstrip("/")

    @property
    def name(self) -> str:
        return self.key.rstrip("/").rsplit("/", 1)[-1]

    @property
    def is_folder(self) -> bool:
        return self.key == "" or self.key.endswith("/")

    def child(self, name: str) -> Location:
        base = self.key if self.is_folder else self.key + "/"
        return Location(self.scheme, self.bucket, base + name)

    def sibling(self, name: str) -> Location:
        parent = self.key.rstrip("/").rpartition("/")[0]
        return Location(self.scheme, self.bucket, f"{parent}/{name}" if parent else name)

    def __str__(self) -> str:
        return self.url


@dataclass(frozen=True)
class Storage:
    """--storage-option KEY=VALUE pairs, and the clients they configure (cached per process;
    picklable, so data-parallel workers rebuild their own)."""

    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, items: Iterable[str]) -> Storage:
        """ValueError naming the option when an item is not KEY=VALUE of a known key."""
        known = {k for keys in STORAGE_OPTIONS.values() for k in keys}
        pairs: dict[str, str] = {}
        for item in items:
            key, sep, value = item.partition("=")
            key = key.strip().lower().replace("-", "_")
            if not sep or not key:
                raise ValueError(f"--storage-option: expected KEY=VALUE, got {item!r}")
            if key not in known:
                raise ValueError(
                    f"--storage-option {key}: unknown; s3:// takes {', '.join(STORAGE_OPTIONS['s3'])}; "
                    f"gs:// takes {', '.join(STORAGE_OPTIONS['gs'])}"
                )
            pairs[key] = value.strip()
        return cls(tuple(sorted(pairs.items())))

    def check(self, urls: Iterable[str]) -> None:
        """ValueError when an option does not apply to the stores these URLs use."""
        schemes = {
            _ALIASES.get(u.split("://", 1)[0].lower(), u.split("://", 1)[0].lower())
            for u in urls
            if is_url(u)
        } & set(OBJECT_SCHEMES)
        for key, _ in self.options:
            if not any(key in STORAGE_OPTIONS[s] for s in schemes):
                where = " or ".join(f"{s}://" for s in sorted(schemes)) or "local paths"
                raise ValueError(f"--storage-option {key}: does not apply to {where}")

    def get(self, key: str) -> str | None:
        return dict(self.options).get(key)

    def filesystem(self, loc: Location) -> pafs.FileSystem:
        key = (loc.scheme, loc.bucket, self.options)
        with _CACHE_LOCK:
            fs = _FILESYSTEMS.get(key)
            if fs is None:
                fs = _s3_filesystem(self, loc.bucket) if loc.scheme == "s3" else _gcs(self)
                _FILESYSTEMS[key] = fs
        return fs

    def s3_client(self) -> Any:
        """A boto3 S3 client configured as the filesystem is (endpoint, region, keys)."""
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config

        endpoint, region = _s3_endpoint_and_region(self)
        config: dict[str, Any] = {"retries": {"max_attempts": 3, "mode": "standard"}}
        if self.flag("anonymous"):
            config["signature_version"] = UNSIGNED
        if self.flag("force_virtual_addressing"):
            config["s3"] = {"addressing_style": "virtual"}
        for ours, theirs in (
            ("connect_timeout", "connect_timeout"),
            ("request_timeout", "read_timeout"),
        ):
            if self.get(ours) is not None:
                config[theirs] = float(self.get(ours) or 0)
        return boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            region_name=region,
            aws_access_key_id=self.get("access_key"),
            aws_secret_access_key=self.get("secret_key"),
            aws_session_token=self.get("session_token"),
            config=Config(**config),
        )

    def flag(self, key: str) -> bool:
        value = self.get(key)
        if value is None:
            return False
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--storage-option {key}: expected true or false, got {value!r}")

    def check_bucket(self, loc: Location) -> None:
        """StorageError naming the URL when the bucket cannot be reached as these options
        stand (it does not exist, access is denied, the credentials are missing or expired)."""
        if loc.scheme == "s3":
            client = self.s3_client()
            try:
                client.head_bucket(Bucket=loc.bucket)
            except Exception as e:
                status = (
                    getattr(e, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
                )
                if status != 403:
                    raise StorageError(describe(e, loc.url, bucket=True)) from None
                # HEAD answers 403 without a body: a listing says whether the keys were refused
                # or only this action (reading and writing objects may still be allowed)
                try:
                    client.list_objects_v2(Bucket=loc.bucket, MaxKeys=1)
                except Exception as listing:
                    code = getattr(listing, "response", {}).get("Error", {}).get("Code", "")
                    if code not in ("AccessDenied", "403"):
                        raise StorageError(describe(listing, loc.url, bucket=True)) from None
            return
        try:
            info = self.filesystem(loc).get_file_info(loc.bucket)
        except Exception as e:
            raise StorageError(describe(e, loc.url, bucket=True)) from None
        if info.type == pafs.FileType.NotFound:
            raise StorageError(
                f"{loc.url}: the bucket {loc.bucket!r} does not exist (check the bucket's name)"
            )


_FILESYSTEMS: dict[Any, pafs.FileSystem] = {}
_CACHE_LOCK = threading.Lock()


def _s3_endpoint_and_region(storage: Storage) -> tuple[str | None, str | None]:
    """The endpoint and region given as options, else as botocore resolves them from the
    environment and config files (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, AWS_PROFILE's
    endpoint_url, AWS_REGION / AWS_DEFAULT_REGION, the profile's region)."""
    endpoint, region = storage.get("endpoint_url"), storage.get("region")
    if endpoint is None or region is None:
        import botocore.session
        from botocore.configprovider import ConfiguredEndpointProvider

        session = botocore.session.get_session()
        if endpoint is None:
            try:
                endpoint = ConfiguredEndpointProvider(
                    full_config=session.full_config,
                    scoped_config=session.get_scoped_config(),
                    client_name="s3",
                ).provide()
            except Exception:  # a profile that does not exist is reported by the first request
                endpoint = None
        if region is None:
            try:
                region = session.get_config_variable("region")
            except Exception:
                region = None
    return endpoint, region


def _s3_filesystem(storage: Storage, bucket: str) -> pafs.FileSystem:
    endpoint, region = _s3_endpoint_and_region(storage)
    kwargs: dict[str, Any] = {
        "access_key": storage.get("access_key"),
        "secret_key": storage.get("secret_key"),
        "session_token": storage.get("session_token"),
        "anonymous": storage.flag("anonymous"),
        "force_virtual_addressing": storage.flag("force_virtual_addressing"),
    }
    for key in _FLOATS:
        if storage.get(key) is not None:
            kwargs[key] = float(storage.get(key) or 0)
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else "https://" + endpoint)
        kwargs["endpoint_override"] = parts.netloc + parts.path.rstrip("/")
        kwargs["scheme"] = parts.scheme
    elif region is None:
        try:  # AWS itself: ask where the bucket is (what pyarrow's from_uri does)
            region = pafs.resolve_s3_region(bucket)
        except (OSError, ValueError):
            region = None  # reported by the first real request
    kwargs["region"] = region
    return pafs.S3FileSystem(**{k: v for k, v in kwargs.items() if v is not None})


def _gcs(storage: Storage) -> pafs.FileSystem:
    kwargs: dict[str, Any] = {"anonymous": storage.flag("anonymous")}
    endpoint = storage.get("endpoint_url")
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else "https://" + endpoint)
        kwargs["endpoint_override"] = parts.netloc
        kwargs["scheme"] = parts.scheme
    if storage.get("project_id"):
        kwargs["project_id"] = storage.get("project_id")
    return pafs.GcsFileSystem(**kwargs)


# What an error of the store means and what to do about it, by the codes the clients put in
# their messages (botocore's error codes, the AWS SDK's enum names in pyarrow's, HTTP statuses).
_HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("NoSuchBucket", "NO_SUCH_BUCKET", "bucket does not exist"),
        "the bucket does not exist: check the bucket's name in the URL, and the endpoint",
    ),
    (
        ("ExpiredToken", "EXPIRED_TOKEN", "TokenRefreshRequired", "token has expired", "expired"),
        "the credentials have expired: refresh them (a new session token, `aws sso login`) and "
        "rerun the same command to resume",
    ),
    (
        (
            "NoCredentials",
            "Unable to locate credentials",
            "No credentials",
            "Could not load credentials",
        ),
        "no credentials were found: set AWS_PROFILE or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
        "(GOOGLE_APPLICATION_CREDENTIALS for gs://), or --storage-option anonymous=true for a "
        "public bucket",
    ),
    (
        (
            "InvalidAccessKeyId",
            "INVALID_ACCESS_KEY_ID",
            "SignatureDoesNotMatch",
            "SIGNATURE_DOES_NOT_MATCH",
            "InvalidToken",
            "INVALID_CLIENT_TOKEN_ID",
        ),
        "the credentials were refused: check AWS_PROFILE or AWS_ACCESS_KEY_ID / "
        "AWS_SECRET_ACCESS_KEY (or --storage-option access_key=... secret_key=...)",
    ),
    (
        (
            "AccessDenied",
            "ACCESS_DENIED",
            "Forbidden",
            "(403)",
            "403 ",
            "HTTP 403",
            "PERMISSION_DENIED",
        ),
        "access denied: the credentials in use may not do this there; check the bucket's policy "
        "and the profile (AWS_PROFILE); a presigned URL may have expired",
    ),
    (
        (
            "NETWORK_CONNECTION",
            "Could not connect",
            "EndpointConnectionError",
            "Connection refused",
            "resolve host",
            "Name or service not known",
            "timed out",
        ),
        "cannot reach the storage endpoint: check AWS_ENDPOINT_URL or --storage-option "
        "endpoint_url, and the network",
    ),
    (
        ("NoSuchKey", "NOT_FOUND", "404", "does not exist", "No such file"),
        "no such object: check the URL",
    ),
)


def describe(error: BaseException, url: str, bucket: bool = False) -> str:
    """One line: the URL, what went wrong, what to do."""
    text = f"{type(error).__name__}: {error}"
    shown = redact(url)
    if bucket and any(code in text for code in ("404", "Not Found", "NoSuchBucket")):
        return f"{shown}: the bucket does not exist: check the bucket's name in the URL, and the endpoint"
    for codes, hint in _HINTS:
        if any(code in text for code in codes):
            return f"{shown}: {hint} ({_short(error)})"
    return f"{shown}: {_short(error)}"


def _short(error: BaseException) -> str:
    """The error's first line, without the request ids that make it long."""
    line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return line.split(" (Request ID")[0][:300]

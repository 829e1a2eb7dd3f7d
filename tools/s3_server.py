"""A real S3 API on 127.0.0.1, for the object-storage tests (tests/io/test_object_store.py) and
their benchmark (tools.object_store_bench): moto's server (the dev extra's moto[server]) in a
subprocess, which cbgen reaches through its own clients (pyarrow's S3FileSystem, boto3) exactly
as it would reach AWS, MinIO or Ceph: only the endpoint differs (AWS_ENDPOINT_URL)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

KEY_ID = "testing-key"
SECRET = "testing-secret"
REGION = "us-east-1"


class S3Server:
    """moto_server on a free port; stop() ends it. extra_env: e.g. INITIAL_NO_AUTH_ACTION_COUNT
    (moto checks IAM permissions after that many unauthenticated requests)."""

    def __init__(self, extra_env: dict[str, str] | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, **(extra_env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.05)

    def env(self, home: Path, **keys: str) -> dict[str, str]:
        """The variables a cbgen run needs to reach this server (and nothing of the machine's own
        AWS configuration)."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": keys.get("key_id", KEY_ID),
            "AWS_SECRET_ACCESS_KEY": keys.get("secret", SECRET),
            "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": str(home / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(home / "aws-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, service: str = "s3", **keys: str) -> Any:
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=keys.get("key_id", KEY_ID),
            aws_secret_access_key=keys.get("secret", SECRET),
        )

    def filesystem(self) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(
            endpoint_override=f"127.0.0.1:{self.port}",
            scheme="http",
            access_key=KEY_ID,
            secret_key=SECRET,
            region=REGION,
        )

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def put(self, bucket: str, key: str, data: bytes) -> str:
        self.client().put_object(Bucket=bucket, Key=key, Body=data)
        return f"s3://{bucket}/{key}"

    def keys(self, bucket: str, prefix: str = "", **keys: str) -> list[str]:
        client = self.client(**keys)
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

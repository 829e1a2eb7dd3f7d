"""`cbgen run` with its input and output in object storage, against a real S3 API server on
127.0.0.1 (moto's, started here: tools.s3_server): cbgen's own clients do every request, as they would
to AWS, MinIO or Ceph. A round trip; a prefix of several files under --shard; a resume after
kill -9 that loses and duplicates nothing; one run per output through a lease object (a second
run refused, a dead run's lease taken over once it expires); the settings check; denied access,
a missing bucket and refused credentials as one error line; a presigned http(s) URL as input."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import REPO
from helpers.cli import Running, check_latencies, cli_env, run, tiny

from cbgen.io.bucket import BucketLayout
from cbgen.io.lease import Lease, LeaseLostError, S3LeaseStore
from cbgen.io.lock import OutputLockedError
from cbgen.io.shard import Shard
from cbgen.io.storage import Location, Storage, describe
from tools.s3_server import S3Server

pytestmark = pytest.mark.xdist_group("s3")


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.stop()


def jsonl(n: int, start: int = 0, max_tokens: int = 4) -> bytes:
    return "".join(
        json.dumps(
            {"id": f"r{i}", "prompt": f"Row {i} asks for a story.", "max_tokens": max_tokens}
        )
        + "\n"
        for i in range(start, start + n)
    ).encode()


def read_final(s3: S3Server, url: str) -> list[dict[str, object]]:
    table = pq.read_table(Location.parse(url).path, filesystem=s3.filesystem())
    return table.sort_by([("row", "ascending"), ("sample_index", "ascending")]).to_pylist()


def env_for(s3: S3Server, tmp_path: Path, **keys: str) -> dict[str, str]:
    return cli_env(**s3.env(tmp_path, **keys))


def test_round_trip_through_a_bucket(s3: S3Server, tmp_path: Path, chat_model: Path) -> None:
    bucket = s3.bucket("round-trip")
    src = s3.put(bucket, "in/prompts.jsonl", jsonl(12))
    out = f"s3://{bucket}/results/prompts.parquet"
    r = run(["run", src, "-o", out, *tiny(chat_model)], env=env_for(s3, tmp_path))
    assert r.returncode == 0, r.stderr + r.stdout
    rows = read_final(s3, out)
    assert [x["id"] for x in rows] == [f"r{i}" for i in range(12)]
    assert [x["row"] for x in rows] == list(range(12))
    assert all(x["finish_reason"] == "length" for x in rows)
    check_latencies(rows)
    # the summary lands beside the final file; staging and the lease are gone
    assert s3.keys(bucket, "results/") == [
        "results/prompts.parquet",
        "results/prompts.summary.json",
    ]
    summary = json.loads(
        s3.client().get_object(Bucket=bucket, Key="results/prompts.summary.json")["Body"].read()
    )
    assert summary["rows"]["output"] == 12 and summary["output"] == out
    # the same command again: everything is done already
    again = run(["run", src, "-o", out, *tiny(chat_model)], env=env_for(s3, tmp_path))
    assert again.returncode == 0 and "resumed 12" in again.stdout, again.stderr


def test_a_prefix_of_files_is_one_input_under_shards(
    s3: S3Server, tmp_path: Path, chat_model: Path
) -> None:
    bucket = s3.bucket("prefix")
    s3.put(bucket, "in/a.jsonl", jsonl(5))
    s3.put(bucket, "in/b.jsonl", jsonl(1, start=5).replace(b'"id": "r5", ', b""))  # no id
    s3.put(bucket, "in/c.jsonl", jsonl(6, start=6))
    s3.put(bucket, "in/_ignored.jsonl", jsonl(3, start=100))
    out = f"s3://{bucket}/out/"
    args = ["run", f"s3://{bucket}/in/", "-o", out, *tiny(chat_model)]
    for shard in ("0/2", "1/2"):
        r = run([*args, "--shard", shard], env=env_for(s3, tmp_path))
        assert r.returncode == 0, r.stderr + r.stdout
    assert [k for k in s3.keys(bucket, "out/") if not k.rsplit("/", 1)[1].startswith("_")] == [
        "out/part-00000-of-00002.parquet",
        "out/part-00001-of-00002.parquet",
    ]
    table = pq.read_table(f"{bucket}/out", filesystem=s3.filesystem())
    rows = table.sort_by("row").to_pylist()
    # row numbers go on from one file to the next: the row without an id is row 5, its id "5"
    assert [x["row"] for x in rows] == list(range(12))
    assert [x["id"] for x in rows] == [f"r{i}" for i in range(5)] + ["5"] + [
        f"r{i}" for i in range(6, 12)
    ]
    part0 = pq.read_table(f"{bucket}/out/part-00000-of-00002.parquet", filesystem=s3.filesystem())
    assert sorted(part0.column("row").to_pylist()) == [0, 2, 4, 6, 8, 10]


def test_parquet_objects_and_a_presigned_url(
    s3: S3Server, tmp_path: Path, chat_model: Path
) -> None:
    bucket = s3.bucket("parquet-in")
    for name, first in (("p1.parquet", 0), ("p2.parquet", 3)):
        sink = pa.BufferOutputStream()
        rows = [
            {"id": f"r{i}", "prompt": f"Row {i}.", "max_tokens": 3} for i in range(first, first + 3)
        ]
        pq.write_table(pa.Table.from_pylist(rows), sink)
        s3.put(bucket, f"in/{name}", sink.getvalue().to_pybytes())
    out = f"s3://{bucket}/out.parquet"
    r = run(["run", f"s3://{bucket}/in", "-o", out, *tiny(chat_model)], env=env_for(s3, tmp_path))
    assert r.returncode == 0, r.stderr + r.stdout
    assert [x["id"] for x in read_final(s3, out)] == [f"r{i}" for i in range(6)]

    # a presigned URL (signed for GET only) is read by ranges, into a local file
    url = s3.client().generate_presigned_url(
        "get_object", Params={"Bucket": bucket, "Key": "in/p2.parquet"}, ExpiresIn=600
    )
    local = tmp_path / "from-url.parquet"
    r = run(["run", url, "-o", str(local), *tiny(chat_model)], env=env_for(s3, tmp_path))
    assert r.returncode == 0, r.stderr + r.stdout
    assert sorted(pq.read_table(local).column("id").to_pylist()) == ["r3", "r4", "r5"]
    gone = s3.client().generate_presigned_url(
        "get_object", Params={"Bucket": bucket, "Key": "in/gone.parquet"}, ExpiresIn=600
    )
    bad = run(["run", gone, "-o", str(tmp_path / "x.parquet")])
    assert bad.returncode == 1
    assert bad.stderr.startswith("error: input http://127.0.0.1:") and "(HTTP 404)" in bad.stderr
    assert "Signature" not in bad.stderr and "?..." in bad.stderr  # the signature is not shown
    assert not (tmp_path / "x.parquet").exists()


def test_kill_9_then_rerun_loses_and_duplicates_nothing(
    s3: S3Server, tmp_path: Path, chat_model: Path
) -> None:
    """kill -9 mid-run: the rerun is refused while the dead run's lease lasts, refused with other
    settings (exit 5), then resumes from the part objects; each row exactly once."""
    bucket = s3.bucket("resume")
    n = 400  # enough that a fast machine is still generating when the first part is up
    src = s3.put(bucket, "prompts.jsonl", jsonl(n, max_tokens=8))
    out = f"s3://{bucket}/out.parquet"
    args = [
        "run",
        src,
        "-o",
        out,
        *tiny(chat_model, "--max-num-seqs", "2", "--log-interval", "0.05"),
        "--flush-rows",
        "3",
        "--flush-interval",
        "0.2",
        "--lease-duration",
        "10",
    ]
    env = env_for(s3, tmp_path)
    first = Running(args, env=env)

    def part_uploaded() -> bool:
        return first.rows_done() >= 10 and any(
            k.endswith(".arrows") for k in s3.keys(bucket, "out.partial/")
        )

    first.wait_for(part_uploaded)
    first.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    first.finish()
    parts = [k for k in s3.keys(bucket, "out.partial/") if k.endswith(".arrows")]
    assert parts, s3.keys(bucket)
    saved = sum(
        pa.ipc.open_stream(s3.client().get_object(Bucket=bucket, Key=k)["Body"].read())
        .read_all()
        .num_rows
        for k in parts
    )
    assert 0 < saved < n

    refused = run(args, env=env)  # the dead run's lease has not expired yet
    assert refused.returncode == 4, refused.stderr + refused.stdout
    assert f"pid {first.proc.pid} on {socket.gethostname()}" in refused.stderr
    assert "expires in" in refused.stderr
    time.sleep(max(0.0, killed + 10.5 - time.monotonic()))  # the lease has expired
    changed = run([*args, "--top-p", "0.5"], env=env)
    assert changed.returncode == 5 and "--top-p: 1.0 -> 0.5" in changed.stderr, changed.stderr
    ok = run(args, env=env)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    assert f"resumed {saved}" in ok.stdout
    rows = read_final(s3, out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == n and sorted(ids) == sorted(f"r{i}" for i in range(n))
    assert all(r["finish_reason"] == "length" for r in rows)
    assert not [k for k in s3.keys(bucket) if k.startswith("out.partial")]


def test_a_second_run_on_the_same_output_is_refused(
    s3: S3Server, tmp_path: Path, chat_model: Path
) -> None:
    bucket = s3.bucket("two-runs")
    src = s3.put(bucket, "p.jsonl", jsonl(30))
    args = [
        "run",
        src,
        "-o",
        f"s3://{bucket}/o.parquet",
        *tiny(chat_model, "--max-num-seqs", "2", "--log-interval", "0.05"),
    ]
    env = env_for(s3, tmp_path)
    first = Running(args, env=env)
    first.wait_for(lambda: first.rows_done() >= 2)
    first.proc.send_signal(signal.SIGSTOP)  # holds its lease (60 s) however fast the machine is
    try:
        second = run(args, env=env)
    finally:
        first.proc.send_signal(signal.SIGCONT)
    assert second.returncode == 4, second.stderr + second.stdout
    message = second.stderr.strip()
    assert message.startswith("error: another run is writing this output (pid ")
    assert f"pid {first.proc.pid} on {socket.gethostname()}" in message
    assert f"lease s3://{bucket}/o.partial/.lease" in message
    assert first.finish() == 0, first.output()
    assert sorted(r["id"] for r in read_final(s3, f"s3://{bucket}/o.parquet")) == sorted(
        f"r{i}" for i in range(30)
    )


def test_a_dead_runs_lease_is_taken_over_after_it_expires(s3: S3Server) -> None:
    """Through boto3 against the server: the holder is named while the lease lasts; once it has
    expired another run takes it over, and the old holder can no longer renew it."""
    bucket = s3.bucket("lease")
    loc = Location.parse(f"s3://{bucket}/out.partial/.lease")
    storage = Storage.parse([f"endpoint_url={s3.url}", "access_key=testing-key", "secret_key=x"])
    code = (
        "import sys; from cbgen.io.lease import Lease, S3LeaseStore; "
        "from cbgen.io.storage import Location, Storage; "
        "s = Storage.parse(sys.argv[1:4]); loc = Location.parse(sys.argv[4]); "
        "Lease(S3LeaseStore(s, loc), loc, 1.5).acquire(); print('held', flush=True); "
        "import time; time.sleep(60)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, *(f"{k}={v}" for k, v in storage.options), loc.url],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        time.sleep(2)  # renewed meanwhile (every 1.5 / 4 s): still held
        with pytest.raises(OutputLockedError) as e:
            Lease(S3LeaseStore(storage, loc), loc, 1.5).acquire()
        assert f"pid {holder.pid} on {socket.gethostname()}" in str(e.value)
        stale = json.loads(s3.client().get_object(Bucket=bucket, Key=loc.key)["Body"].read())
    finally:
        holder.kill()  # kill -9: nothing renews the lease now
        holder.wait()
    time.sleep(2.5)
    lost: list[str] = []
    taker = Lease(S3LeaseStore(storage, loc), loc, 30)
    taker.acquire()
    assert taker.took_over is not None and taker.took_over["pid"] == holder.pid
    # the dead run's last version no longer renews (as a run stalled past expiry would find)
    ghost = Lease(S3LeaseStore(storage, loc), loc, 1.5, on_lost=lost.append)
    ghost.token, ghost.holder, ghost.tag = stale["token"], stale, '"not-the-current-etag"'
    with pytest.raises(LeaseLostError):
        ghost.renew()
    assert lost and f"pid {taker.holder['pid']}" in lost[0]
    taker.release()
    assert s3.keys(bucket, "out.partial/") == []


def test_denied_access_missing_bucket_and_bad_keys_are_one_error_line(
    s3: S3Server, tmp_path: Path, chat_model: Path
) -> None:
    """moto checks IAM from its 6th request on: a user who may read but not write the bucket;
    keys it does not know; a bucket that does not exist."""
    server = S3Server({"INITIAL_NO_AUTH_ACTION_COUNT": "5"})
    try:
        iam = server.client("iam")
        iam.create_user(UserName="reader")
        # read actions by prefix: moto 5.2.6 checks HeadObject and ListObjectsV2 under their own
        # names where AWS (and older moto) check s3:GetObject and s3:ListBucket
        read = ["s3:Get*", "s3:List*", "s3:Head*"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": read, "Resource": "*"}],
        }
        iam.put_user_policy(UserName="reader", PolicyName="ro", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        server.bucket("locked")
        src = server.put("locked", "in.jsonl", jsonl(3))
        reader = cli_env(
            **server.env(tmp_path, key_id=key["AccessKeyId"], secret=key["SecretAccessKey"])
        )
        out = "s3://locked/out.parquet"

        denied = run(["run", src, "-o", out, *tiny(chat_model)], env=reader)
        assert denied.returncode == 1, denied.stderr + denied.stdout
        lines = denied.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: output {out}"), denied.stderr
        assert "access denied" in lines[0]

        wrong = cli_env(**server.env(tmp_path, key_id="AKIAWRONG", secret="nope"))
        refused = run(["run", src, "-o", out, *tiny(chat_model)], env=wrong)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert "credentials were refused" in refused.stderr
        # nothing was written that could pass for a result
        who = {"key_id": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
        assert server.keys("locked", **who) == ["in.jsonl"]
    finally:
        server.stop()
    src = s3.put(s3.bucket("has-input"), "in.jsonl", jsonl(3))
    missing = run(
        ["run", src, "-o", "s3://no-such-bucket/o.parquet", *tiny(chat_model)],
        env=env_for(s3, tmp_path),
    )
    assert missing.returncode == 1, missing.stderr
    assert missing.stderr.startswith("error: output s3://no-such-bucket/o.parquet")
    assert "the bucket does not exist" in missing.stderr


def test_errors_say_what_to_fix() -> None:
    from botocore.exceptions import ClientError, NoCredentialsError

    expired = ClientError(
        {"Error": {"Code": "ExpiredToken", "Message": "The provided token has expired."}},
        "PutObject",
    )
    assert "credentials have expired" in describe(expired, "s3://b/o.parquet")
    assert "no credentials were found" in describe(NoCredentialsError(), "s3://b/k")
    assert describe(OSError("boom"), "https://h/x?X-Amz-Signature=abc") == "https://h/x?...: boom"
    with pytest.raises(ValueError, match="--storage-option regoin: unknown"):
        Storage.parse(["regoin=eu-west-1"])
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        Storage.parse(["endpoint_url"])
    with pytest.raises(ValueError, match="does not apply to s3://"):
        Storage.parse(["project_id=p"]).check(["s3://b/in.jsonl"])


def test_output_names_in_a_bucket() -> None:
    storage = Storage()
    one = BucketLayout.build("s3://b/data/in.jsonl", None, None, False, storage)
    assert (one.final.url, one.summary.url, one.staging.url) == (
        "s3://b/data/in.out.parquet",
        "s3://b/data/in.out.summary.json",
        "s3://b/data/in.out.partial/",
    )
    folder = BucketLayout.build("x.jsonl", "s3://b/out/", None, False, storage)
    assert folder.final.url == "s3://b/out/part-00000-of-00001.parquet"
    assert folder.staging.url == "s3://b/out/_part-00000-of-00001.partial/"
    shard = BucketLayout.build("x.jsonl", "gs://b/out", Shard(3, 8), True, storage)
    assert shard.final.url == "gs://b/out/_part-00003-of-00008.parquet"
    assert shard.export is not None and shard.export.url == "gs://b/out/part-00003-of-00008.jsonl"


def test_the_benchmark_times_local_and_bucket_runs_in_pairs(
    tmp_path: Path, chat_model: Path
) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(jsonl(6))
    out = tmp_path / "figures.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.object_store_bench",
            "--rows",
            str(rows),
            "--pairs",
            "1",
            "--out",
            str(out),
            "--",
            *tiny(chat_model),
        ],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=300,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    figures = json.loads(out.read_text())
    (pair,) = figures["pairs"]
    assert pair["local"]["wall_s"] > 0 and pair["bucket"]["wall_s"] > 0
    assert figures["median_wall_ratio"] == pair["wall_ratio"] > 0
    assert "bucket / local throughput, median of 1 pairs" in r.stdout

"""Rows in, rows out: what `cbgen run` is made of.

rows.py      InputRow: one prompt, its id and per-row sampling fields, errors included
parse.py     a JSON object (plain, chat, OpenAI batch) or Parquet record into an InputRow
shard.py     shards (--shard I/N, Slurm arrays) and the row filters of shards and workers
readers.py   streaming JSONL (file or stdin) and Parquet readers
schema.py    the output table's columns and how a finished or failed row fills them
writer.py    output layout, staging streams (crash-safe), resume keys, atomic finalize
storage.py   URLs (s3://, gs://, http(s)://), --storage-option, a store's errors as one line
input_files.py  the input's files wherever they are (local, a bucket, a URL), read without
             holding them whole
outputs.py   the contract a run's output keeps, on a disk (writer) or in a bucket (bucket)
bucket.py    outputs in object storage: part objects, the final upload, resume from the bucket
lease.py     one run per output in a bucket: a lease object created conditionally
uploads.py   objects that appear whole or not at all; small objects in one request
pipeline.py  the loop feeding one engine as slots free up
progress.py  what the loop did: the display's snapshots, the summary's figures, the row count
stop.py      SIGTERM/Ctrl-C: stop feeding, flush, exit resumable
parallel.py  --data-parallel-size: worker processes, failures reported
session.py   one run from checks to exit code
summary.py   the JSON run summary and the final lines printed
"""

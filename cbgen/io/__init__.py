"""Rows in, rows out: what `cbgen run` is made of.

rows.py      InputRow: one prompt, its id and per-row sampling fields, errors included
parse.py     a JSON object (plain, chat, OpenAI batch) or Parquet record into an InputRow
shard.py     shards (--shard I/N, Slurm arrays) and the row filters of shards and workers
readers.py   streaming JSONL (file or stdin) and Parquet readers
schema.py    the output table's columns and how a finished or failed row fills them
writer.py    output layout, staging streams (crash-safe), resume keys, atomic finalize
pipeline.py  the loop feeding one engine as slots free up
progress.py  what the loop did: the display's snapshots, the summary's figures, the row count
stop.py      SIGTERM/Ctrl-C: stop feeding, flush, exit resumable
parallel.py  --data-parallel-size: worker processes, failures reported
session.py   one run from checks to exit code
summary.py   the JSON run summary and the final lines printed
"""

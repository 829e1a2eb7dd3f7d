"""Rows in, rows out: what `cbgen run` is made of.

rows.py      InputRow: one prompt, its id and per-row sampling fields (JSONL, OpenAI batch,
             Parquet records), errors included; shards and row filters
readers.py   streaming JSONL (file or stdin) and Parquet readers
schema.py    the output table's columns and how a finished or failed row fills them
writer.py    output layout, staging streams (crash-safe), resume keys, atomic finalize
pipeline.py  the loop feeding one engine as slots free up; progress; SIGTERM/Ctrl-C
parallel.py  --data-parallel-size: worker processes, failures reported
session.py   one run from checks to exit code
summary.py   the JSON run summary and the final lines printed
"""

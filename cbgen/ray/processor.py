"""cbgen as a Ray Data processor, for pipelines of one's own:

    import ray
    from cbgen import EngineConfig, SamplingParams
    from cbgen.ray import build_processor

    processor = build_processor(
        EngineConfig(model="HuggingFaceTB/SmolLM2-135M-Instruct"),
        SamplingParams(max_tokens=64, temperature=0),
        preprocess=lambda r: {"id": r["qid"], "messages": [{"role": "user", "content": r["q"]}]},
        postprocess=lambda r: {"qid": r["id"], "answer": r["completion"], "error": r["error"]},
    )
    processor(ray.data.read_parquet("s3://bucket/questions/")).write_parquet("s3://bucket/answers/")

    Dataset ─ preprocess(row) ─▶ map_batches(_EngineUDF: an engine per actor, batches of rows
    in, output rows out) ─▶ postprocess(row) ─▶ Dataset

Rows are read as `cbgen run` reads them: `prompt` (text or token ids) or `messages`, `id`,
per-row sampling fields, chat options, OpenAI batch rows; a row that cannot run is an output
row with finish_reason "error", never an exception. The output has cbgen's columns
(cbgen.io.schema) and the input's other columns, less those of the same names.

The UDF is async: an actor takes several blocks and several batches of each at once (Ray
Data's async map), and every row joins the one engine as a slot frees, so the engine stays full
across batch and block boundaries. Ray Data retries the blocks of a lost actor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from cbgen.config import EngineConfig
from cbgen.io.parse import make_params, parse_mapping
from cbgen.io.rows import ChatDefaults, ColumnSpec, InputRow, RowError
from cbgen.io.schema import BASE_NAMES, output_schema
from cbgen.ray.cluster import RayOptions, import_ray, place_engines
from cbgen.ray.worker import EngineWorker, Outcome
from cbgen.sampling_params import SamplingParams

Row = dict[str, Any]
BATCHES_PER_ACTOR = 4
"""Blocks (tasks) an actor works on at once, each up to Ray Data's 4 batches in flight."""


@dataclass(frozen=True)
class Processor:
    """`processor(dataset)` -> a dataset of output rows (lazy, as Ray Data is)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """The defaults a row's own sampling fields override."""
    concurrency: int | None = None
    """Engines (actors); None: as many as the cluster holds (cbgen.ray.cluster)."""
    cpus_per_engine: float | None = None
    batch_size: int = 16
    preprocess: Callable[[Row], Row] | None = None
    postprocess: Callable[[Row], Row] | None = None
    chat: ChatDefaults = field(default_factory=ChatDefaults)
    columns: ColumnSpec = field(default_factory=ColumnSpec)
    """Which columns hold the prompt and the id (keep_columns is not used: every other
    column is kept)."""

    def __call__(self, dataset: Any) -> Any:
        ray = import_ray()
        if not ray.is_initialized():
            ray.init()
        options = RayOptions(cpus_per_engine=self.cpus_per_engine, engines=self.concurrency)
        placement = place_engines(options, self.engine, ray.nodes())
        if self.preprocess is not None:
            dataset = dataset.map(self.preprocess)
        dataset = dataset.map_batches(
            _EngineUDF,
            fn_constructor_args=(placement.config, self.sampling, self.chat, self.columns),
            batch_format="pyarrow",
            batch_size=self.batch_size,
            concurrency=placement.engines,
            num_cpus=placement.num_cpus,
            num_gpus=placement.num_gpus,
            max_concurrency=BATCHES_PER_ACTOR,
        )
        if self.postprocess is not None:
            dataset = dataset.map(self.postprocess)
        return dataset


def build_processor(
    engine: EngineConfig | Mapping[str, Any] | None = None,
    sampling: SamplingParams | Mapping[str, Any] | None = None,
    **options: Any,
) -> Processor:
    """A Processor from engine options (an EngineConfig or its fields), sampling defaults (a
    SamplingParams or its fields) and Processor's own options; ValueError naming a bad one."""
    if not isinstance(engine, EngineConfig):
        engine = EngineConfig(**dict(engine or {}))
    if not isinstance(sampling, SamplingParams):
        sampling = SamplingParams(**dict(sampling or {}))
    return Processor(engine, sampling, **options)


@dataclass
class _Batch:
    future: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop
    remaining: int
    records: list[tuple[int, Row]] = field(default_factory=list)


class _EngineUDF:
    """One engine per actor; each call hands a batch's rows to it and awaits their rows."""

    def __init__(
        self,
        config: EngineConfig,
        defaults: SamplingParams,
        chat: ChatDefaults,
        columns: ColumnSpec,
    ) -> None:
        self.defaults = defaults
        self.seed = config.seed
        self.columns = ColumnSpec(columns.prompt_column, columns.id_column)
        self._owner: dict[int, tuple[_Batch, int]] = {}
        """id(InputRow) -> its batch and position in it, while it is in the engine."""
        self.worker = EngineWorker(config, defaults, self._on_record, self._on_row_done, chat)

    async def __call__(self, batch: pa.Table) -> pa.Table:
        keep = [n for n in batch.schema.names if n not in BASE_NAMES]
        schema = output_schema({n: batch.schema.field(n).type for n in keep})
        rows = [self._parse(rec, keep) for rec in batch.to_pylist()]
        if not rows:
            return schema.empty_table()
        if self.worker.error is not None:
            raise RuntimeError(f"the engine failed: {self.worker.error!r}")
        loop = asyncio.get_running_loop()
        mine = _Batch(loop.create_future(), loop, len(rows))
        for pos, row in enumerate(rows):
            self._owner[id(row)] = (mine, pos)
        self.worker.submit((row, ()) for row in rows)
        await mine.future
        mine.records.sort(key=lambda pr: (pr[0], pr[1]["sample_index"]))
        return pa.Table.from_pylist([r for _, r in mine.records], schema=schema)

    def _parse(self, rec: Row, keep: list[str]) -> InputRow:
        row = rec.get("row")
        index = row if isinstance(row, int) and not isinstance(row, bool) else -1
        given = rec.get(self.columns.id_column or "id", rec.get("custom_id"))
        where = f"row {index}" if index >= 0 else f"id {given}" if given is not None else "row"
        parsed = parse_mapping(rec, index, where, self.columns, {n: rec[n] for n in keep})
        if index < 0 and parsed.error is None and "seed" not in parsed.overrides:
            parsed = self._seeded(parsed, given)
        return parsed

    def _seeded(self, row: InputRow, given: Any) -> InputRow:
        """Without a row index, a sampled row's seed comes from its id (else its prompt), so
        the same row gives the same completion in any run (with one, cbgen run's rule)."""
        try:
            if make_params(self.defaults, row.overrides).greedy:
                return row
        except RowError:
            return row  # the loop makes it an error row
        basis = given if given is not None else (row.prompt, row.messages)
        text = f"{self.seed}:{json.dumps(basis, sort_keys=True, default=str)}"
        seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        return dataclasses.replace(row, overrides=dict(row.overrides, seed=seed >> 2))

    # ---- the engine's thread -------------------------------------------------------------
    def _on_record(self, row: InputRow, record: Row) -> None:
        batch, pos = self._owner[id(row)]
        batch.records.append((pos, record))

    def _on_row_done(self, row: InputRow, outcome: Outcome) -> None:
        batch, _ = self._owner.pop(id(row))
        batch.remaining -= 1
        if batch.remaining == 0:
            batch.loop.call_soon_threadsafe(batch.future.set_result, None)

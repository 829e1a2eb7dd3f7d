"""`cbgen bench --structured`: some or all requests under a JSON schema, to measure what
structured outputs cost on a workload.

A constrained request samples under the schema's token mask (cbgen/engine/structured.py) and
does not ignore EOS: it stops when its JSON is complete, or at its output length, so it makes
at most the tokens the workload asks for. The other requests run as always (exactly their
output length). Which requests: request i is constrained when floor((i + 1) share) >
floor(i share), so share 1 takes all, 0.5 every other one (i = 1, 3, 5, ...), and any share
spreads its requests evenly over the workload.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbgen.bench.runner import bench_params
from cbgen.bench.workloads import BenchRequest
from cbgen.sampling_params import SamplingParams, StructuredOutputs

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "topic": {"type": "string"},
        "summary": {"type": "string"},
        "keywords": {"type": "array", "items": {"type": "string"}},
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
    },
    "required": ["topic", "summary", "keywords", "sentiment"],
}
"""--structured json: a summary of the prompt, as a batch job might ask of each row."""


@dataclass(frozen=True)
class Structured:
    source: str
    """'json' (SCHEMA) or the schema file's path, as given."""
    spec: StructuredOutputs
    share: float

    def constrained(self, index: int) -> bool:
        return math.floor((index + 1) * self.share) > math.floor(index * self.share)

    def params(self, request: BenchRequest, index: int, seed: int) -> SamplingParams:
        """The bench's sampling (runner.bench_params), under the schema if index is one of
        the constrained requests."""
        params = bench_params(request, index, seed)
        if not self.constrained(index):
            return params
        return params.replace(ignore_eos=False, structured_outputs=self.spec)

    def describe(self, num_requests: int) -> dict[str, Any]:
        """For the JSON's workload section."""
        return {
            "schema": self.source,
            "share": self.share,
            "constrained_requests": sum(self.constrained(i) for i in range(num_requests)),
        }


def parse_structured(source: str, share: float) -> Structured:
    """--structured and --structured-share; ValueError naming what is wrong. Whether the
    schema compiles is the engine's check (Engine.grammars.compile), before the first run."""
    if not 0 < share <= 1:
        raise ValueError(f"structured_share: must be in (0, 1], got {share}")
    if source == "json":
        return Structured(source, StructuredOutputs(json=SCHEMA), share)
    path = Path(source)
    if not path.is_file():
        raise ValueError(
            f"structured: expected json (the bench's schema) or a JSON schema file; "
            f"{source!r} is neither"
        )
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"structured: {source} is not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured: {source}: a JSON schema is an object")
    return Structured(source, StructuredOutputs(json=schema), share)

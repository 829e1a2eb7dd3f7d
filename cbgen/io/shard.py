"""Which rows a process owns: a shard of a run (--shard I/N, or a Slurm job array's task) and
the round-robin row filters that shards and data-parallel workers take.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RowFilter:
    """Rows this process owns: row % modulus == remainder (shards, data-parallel workers)."""

    modulus: int = 1
    remainder: int = 0

    def __post_init__(self) -> None:
        if self.modulus < 1 or not 0 <= self.remainder < self.modulus:
            raise ValueError(f"row filter: need 0 <= {self.remainder} < {self.modulus}")

    def __call__(self, row: int) -> bool:
        return row % self.modulus == self.remainder

    def split(self, parts: int, index: int) -> RowFilter:
        """The index-th of `parts` round-robin sub-filters: among the rows this filter owns,
        take every parts-th one. rows r = rem + mod*j go to sub-filter j % parts."""
        return RowFilter(self.modulus * parts, self.remainder + self.modulus * index)

    def count(self, total: int) -> int:
        """How many of rows 0..total-1 this filter owns."""
        return max(0, (total - self.remainder + self.modulus - 1) // self.modulus)


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard: need 0 <= I < N in I/N, got {self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """'3/8' -> Shard(3, 8); ValueError naming the problem otherwise."""
        parts = text.strip().split("/")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"shard: expected I/N such as 0/4, got {text!r}")
        return cls(int(parts[0]), int(parts[1]))

    @classmethod
    def from_slurm(cls, env: Mapping[str, str]) -> Shard | None:
        """The shard of a Slurm job-array task, or None outside an array. Arrays that start at
        1 or step (`--array=1-8`, `--array=0-14:2`) map onto 0..N-1 through MIN and STEP."""
        task, count = env.get("SLURM_ARRAY_TASK_ID"), env.get("SLURM_ARRAY_TASK_COUNT")
        if task is None or count is None:
            return None
        try:
            tid, n = int(task), int(count)
            lo = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
            step = int(env.get("SLURM_ARRAY_TASK_STEP", "1") or 1)
        except ValueError as e:
            raise ValueError(f"shard: unreadable Slurm array variables: {e}") from None
        if (tid - lo) % step:
            raise ValueError(f"shard: SLURM_ARRAY_TASK_ID={tid} is not on the array's step {step}")
        index = (tid - lo) // step
        if not 0 <= index < n:
            raise ValueError(
                f"shard: SLURM_ARRAY_TASK_ID={tid} gives shard {index}, outside 0..{n - 1}; "
                "use a contiguous array such as --array=0-N or pass --shard I/N"
            )
        return cls(index, n)

    @property
    def filter(self) -> RowFilter:
        return RowFilter(self.count, self.index)

    @property
    def label(self) -> str:
        return f"part-{self.index:05d}-of-{self.count:05d}"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

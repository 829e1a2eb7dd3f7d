"""`cbgen run` (placeholder until the command lands)."""

from __future__ import annotations

import typer


def run(input: str = typer.Argument(..., help="Prompts: .jsonl (or - for stdin) or .parquet")) -> None:
    """Generate completions for every row of INPUT into a Parquet file."""
    raise typer.Exit(2)

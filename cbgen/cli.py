"""The cbgen command line: `cbgen run` (files in, Parquet out), `cbgen bench`, `cbgen info`."""

from __future__ import annotations

import os
import shutil
import sys

import typer

app = typer.Typer(
    name="cbgen",
    help="Offline batch generation: continuous batching over a paged KV cache, from a shell.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    from cbgen.bench.command import bench
    from cbgen.run_command import run

    app.command(name="run")(run)
    app.command(name="bench")(bench)


@app.command()
def info() -> None:
    """Show the version, torch build, devices and the default model's location."""
    import torch

    from cbgen import __version__
    from cbgen.models.source import ModelNotFoundError, default_model_path

    typer.echo(f"cbgen {__version__}, torch {torch.__version__}")
    typer.echo(f"cuda: {torch.cuda.is_available()}, cpu threads: {torch.get_num_threads()}")
    try:
        typer.echo(f"default model: {default_model_path()}")
    except ModelNotFoundError as e:
        typer.echo(f"default model: {e}")


RICH_HELP_MIN_COLUMNS = 120
"""Rich's option panels need about this width: narrower (and in a pipe, which Rich takes as 80
columns) they cut long option names short ("--max-num-batche…"), so --help is plain text there."""


def _choose_help_style() -> None:
    if shutil.get_terminal_size().columns < RICH_HELP_MIN_COLUMNS:
        app.rich_markup_mode = None


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if sys.argv[1:2] == ["run"]:
        from cbgen.run_options import bare_ray_flag

        sys.argv[2:] = bare_ray_flag(sys.argv[2:])  # `--ray` alone: a local cluster
    _register()
    _choose_help_style()
    app()

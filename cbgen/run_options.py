"""The values of `cbgen run`'s options that need more than a type: files and JSON read (chat
template, its kwargs, a JSON schema), the shard (--shard or Slurm's array variables), the Ray
options; each error a ValueError naming its option."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cbgen.io.rows import ChatDefaults
    from cbgen.io.shard import Shard
    from cbgen.ray.cluster import RayOptions


def chat_defaults(template_file: str | None, kwargs_json: str | None) -> ChatDefaults:
    """ValueError naming the option when the file cannot be read or the JSON is no object."""
    from cbgen.io.rows import ChatDefaults

    template = None
    if template_file is not None:
        try:
            template = Path(template_file).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {template_file}: {e}") from None
    kwargs: Any = {}
    if kwargs_json is not None:
        try:
            kwargs = json.loads(kwargs_json)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"--chat-template-kwargs: not valid JSON ({e.msg}, column {e.colno})"
            ) from None
        if not isinstance(kwargs, dict):
            raise ValueError(f"--chat-template-kwargs: must be a JSON object, got {kwargs_json!r}")
    return ChatDefaults(template, kwargs)


def structured_defaults(
    schema_file: str | None, regex: str | None, choices: list[str] | None
) -> dict[str, Any] | None:
    """structured_outputs from --json-schema / --regex / --choice (at most one of them);
    ValueError naming the option when the file cannot be read or is no JSON object."""
    given = [
        flag
        for flag, value in (
            ("--json-schema", schema_file),
            ("--regex", regex),
            ("--choice", choices),
        )
        if value
    ]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)}: give one constraint, not several")
    if regex:
        return {"regex": regex}
    if choices:
        return {"choice": list(choices)}
    if not schema_file:
        return None
    try:
        schema = json.loads(Path(schema_file).expanduser().read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--json-schema: cannot read {schema_file}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--json-schema: {schema_file} is not valid JSON ({e.msg}, line {e.lineno})"
        ) from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema: {schema_file} must hold a JSON object (a schema)")
    return {"json": schema}


def resolve_shard(text: str | None, display: Any) -> Shard | None:
    from cbgen.io.shard import Shard

    shard: Shard | None
    if text is not None:
        shard = Shard.parse(text)
    else:
        shard = Shard.from_slurm(os.environ)
        if shard is not None:
            display.message(
                f"shard {shard} from SLURM_ARRAY_TASK_ID={os.environ['SLURM_ARRAY_TASK_ID']}, "
                f"SLURM_ARRAY_TASK_COUNT={os.environ['SLURM_ARRAY_TASK_COUNT']} "
                "(pass --shard 0/1 to process every row)"
            )
    return None if shard is None or shard.count == 1 else shard


def bare_ray_flag(args: list[str]) -> list[str]:
    """`cbgen run` arguments with `local` after a bare --ray (the last word, or followed by an
    option or the INPUT rather than an ADDRESS): Typer's options always take a value."""
    from cbgen.ray.cluster import LOCAL, RayOptions

    out = list(args)
    for i, word in enumerate(args):
        if word == "--ray" and (i + 1 == len(args) or not RayOptions.is_address(args[i + 1])):
            out.insert(i + 1 + (len(out) - len(args)), LOCAL)
    return out


def parse_ray_options(
    address: str | None, cpus: float | None, engines: int | None, data_parallel_size: int
) -> RayOptions | None:
    """ValueError naming the option when --ray's options are given without it or clash."""
    from cbgen.ray.cluster import RayOptions

    if address is None:
        given = [f for f, v in (("--cpus-per-engine", cpus), ("--ray-engines", engines)) if v]
        if given:
            raise ValueError(f"{' and '.join(given)}: only with --ray")
        return None
    if data_parallel_size > 1:
        raise ValueError(
            "--data-parallel-size: not with --ray, which starts an engine per GPU or per "
            "--cpus-per-engine CPUs (--ray-engines sets how many)"
        )
    return RayOptions(address, cpus, engines)

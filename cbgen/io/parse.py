"""A row parsed from a JSON object or a Parquet record into an InputRow (cbgen.io.rows), errors
included, and its overrides checked into SamplingParams (make_params).

Three JSON shapes are understood:

    {"id": 7, "prompt": "text", "max_tokens": 32}                       raw prompt
    {"id": "a", "messages": [{"role": "user", "content": "hi"}]}        chat (template applied)
    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 32}}      OpenAI Batch API
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from cbgen.io.rows import ColumnSpec, InputRow, Messages, Prompt, RowError
from cbgen.sampling_params import SamplingParams

CHAT_ROLES = ("system", "user", "assistant", "tool")
OPENAI_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
# OpenAI body fields with another name here.
OPENAI_ALIASES = {"max_completion_tokens": "max_tokens"}
SAMPLING_FIELDS = frozenset(SamplingParams.field_names())
# Chat options a row may give (vLLM's names), for its messages.
CHAT_FIELDS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")
# OpenAI's `logprobs: true` + `top_logprobs: k`; vLLM's `logprobs: k` is a sampling field.
LOGPROB_FIELDS = frozenset({"top_logprobs"})
# OpenAI's response_format ({"type": "json_object"} or {"type": "json_schema", "json_schema":
# {"schema": ...}}): SamplingParams.structured_outputs by another name.
STRUCTURED_FIELDS = frozenset({"response_format"})
# vLLM's older per-request names for the same: each one kind of structured_outputs.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# OpenAI body fields that change nothing in an offline batch: accepted and ignored.
OPENAI_NO_EFFECT = frozenset(
    {
        "model",
        "user",
        "metadata",
        "store",
        "service_tier",
        "stream",
        "stream_options",
        "safety_identifier",
        "prompt_cache_key",
        "parallel_tool_calls",
    }
)
# Request features cbgen does not implement. A row that asks for one is an error row, in
# plain rows too (where other extra fields are metadata): silently ignoring it would give an
# answer the user did not ask for. A field set to null or to its no-op value is not asking.
UNSUPPORTED_FEATURES = frozenset(
    {
        "guided_decoding",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "chat_template",
        "echo",
        "suffix",
        "best_of",
        "use_beam_search",
        "reasoning_effort",
        "modalities",
        "audio",
        "prediction",
        "web_search_options",
        "include_stop_str_in_output",
        "truncate_prompt_tokens",
    }
)
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "echo": (False,),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "functions": ([],),
    "best_of": (1,),
    "use_beam_search": (False,),
    "include_stop_str_in_output": (False,),
}


def parse_json_line(raw: bytes, row: int, lineno: int, spec: ColumnSpec) -> InputRow:
    """One JSONL line (already known not to be blank) -> InputRow, errors included."""
    where = f"line {lineno}"
    try:
        obj = json.loads(
            raw.decode("utf-8").removeprefix("\ufeff")
        )  # a UTF-8 BOM may open the file
    except UnicodeDecodeError as e:
        return error_row(row, where, f"is not valid UTF-8 (byte {e.start + 1})")
    except json.JSONDecodeError as e:
        return error_row(row, where, f"invalid JSON: {e.msg} (column {e.colno})")
    if not isinstance(obj, dict):
        return error_row(row, where, f"expected a JSON object, got {type(obj).__name__}")
    keep = {name: _json_text(obj.get(name)) for name in spec.keep_columns}
    return parse_mapping(obj, row, where, spec, keep)


def parse_mapping(
    obj: Mapping[str, Any], row: int, where: str, spec: ColumnSpec, keep: dict[str, Any]
) -> InputRow:
    """A row as a mapping of field -> value (a JSON object or a Parquet record)."""
    source: Mapping[str, Any] = obj
    openai = is_openai_batch_row(obj)
    id_field = spec.id_column or ("custom_id" if openai else "id")
    row_id = str(row)
    try:
        row_id = _row_id(obj.get(id_field), id_field, row)
        if openai:
            source = _openai_body(obj)
        prompt, messages = _prompt_of(source, spec.prompt_column)
        _check_fields(source, openai, spec)
        overrides = _overrides(source, openai)
        chat = _chat_options(source, messages is not None)
    except RowError as e:
        return InputRow(row, where, row_id, keep=keep, error=f"{where}: {e}")
    return InputRow(row, where, row_id, prompt, messages, overrides, keep, chat)


def error_row(row: int, where: str, problem: str) -> InputRow:
    return InputRow(row, where, str(row), error=f"{where}: {problem}")


def is_openai_batch_row(obj: Mapping[str, Any]) -> bool:
    return isinstance(obj.get("body"), dict) and any(
        k in obj for k in ("custom_id", "url", "method")
    )


def _openai_body(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    method = obj.get("method", "POST")
    if method != "POST":
        raise RowError(f"method: only POST is supported, got {method!r}")
    body: Mapping[str, Any] = obj["body"]
    url = obj.get("url")
    if url is not None:
        if url not in OPENAI_URLS:
            raise RowError(f"url: {url!r} is not supported (use {' or '.join(OPENAI_URLS)})")
        want = OPENAI_URLS[url]
        if want not in body:
            raise RowError(f"body: {url} needs a {want!r} field")
    return body


def _row_id(value: Any, name: str, row: int) -> str:
    if value is None:
        return str(row)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RowError(f"{name}: must be a string or a number, got {_describe(value)}")
    return value if isinstance(value, str) else json.dumps(value)


def _prompt_of(
    source: Mapping[str, Any], column: str | None
) -> tuple[Prompt | None, Messages | None]:
    if column is not None:
        if source.get(column) is None:
            raise RowError(f"no prompt: the {column!r} field is missing or null")
        value = source[column]
        if isinstance(value, list) and value and all(isinstance(m, Mapping) for m in value):
            return None, _messages(value, column)
        return _prompt(value, column), None
    has_prompt = source.get("prompt") is not None
    has_messages = source.get("messages") is not None
    if has_prompt and has_messages:
        raise RowError("give either 'prompt' or 'messages', not both")
    if has_prompt:
        return _prompt(source["prompt"], "prompt"), None
    if has_messages:
        return None, _messages(source["messages"], "messages")
    raise RowError("no prompt: give a 'prompt' (text or token ids) or 'messages' (chat) field")


def _prompt(value: Any, name: str) -> Prompt:
    if isinstance(value, str):
        if not value:
            raise RowError(f"{name}: is empty")
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(t, str) for t in value):
        raise RowError(f"{name}: a list of {len(value)} prompts; give one prompt per row")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return _prompt(value[0], name)
    raise RowError(f"{name}: must be a string or a list of token ids, got {_describe(value)}")


def _messages(value: Any, name: str) -> Messages:
    if not isinstance(value, list) or not value:
        raise RowError(
            f"{name}: must be a non-empty list of {{role, content}} objects, got {_describe(value)}"
        )
    out: Messages = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise RowError(
                f"{name}[{i}]: must be an object with role and content, got {_describe(m)}"
            )
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise RowError(
                f"{name}[{i}].role: unknown role {role!r} (expected {', '.join(CHAT_ROLES)})"
            )
        out.append({"role": role, "content": _content(m.get("content"), f"{name}[{i}].content")})
    return out


def _content(value: Any, name: str) -> str:
    """A string, or OpenAI's list of parts [{"type": "text", "text": ...}] (text parts only)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, Mapping) for p in value):
        texts = []
        for j, part in enumerate(value):
            if part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
                raise RowError(f"{name}[{j}]: only text parts are supported, got {_describe(part)}")
            texts.append(part["text"])
        return "".join(texts)
    raise RowError(f"{name}: must be a string, got {_describe(value)}")


def _chat_options(source: Mapping[str, Any], is_chat: bool) -> dict[str, Any]:
    out = {k: source[k] for k in CHAT_FIELDS if source.get(k) is not None}
    if not out:
        return out
    if not is_chat:
        raise RowError(f"{next(iter(out))}: applies to chat rows (messages) only")
    kwargs = out.get("chat_template_kwargs", {})
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise RowError(f"chat_template_kwargs: must be an object, got {_describe(kwargs)}")
    for name in ("add_generation_prompt", "continue_final_message"):
        if not isinstance(out.get(name, False), bool):
            raise RowError(f"{name}: must be true or false, got {_describe(out[name])}")
    if out.get("continue_final_message") and out.get("add_generation_prompt", False):
        raise RowError("continue_final_message: cannot be combined with add_generation_prompt")
    return out


def _check_fields(source: Mapping[str, Any], openai: bool, spec: ColumnSpec) -> None:
    """An OpenAI body may hold only what cbgen implements or what has no effect; any row may
    not ask for a feature cbgen does not implement."""
    own = {spec.prompt_column, spec.id_column, *spec.keep_columns}
    for name, value in source.items():
        if value is None or name in own or value in _NO_OP_VALUES.get(name, ()):
            continue
        where = f"body.{name}" if openai else name
        if name in UNSUPPORTED_FEATURES:
            raise RowError(f"{where}: cbgen does not implement this request field yet")
        if openai and not (
            name in SAMPLING_FIELDS
            or name in LOGPROB_FIELDS
            or name in STRUCTURED_FIELDS
            or name in GUIDED_FIELDS
            or name in OPENAI_ALIASES
            or name in CHAT_FIELDS
            or name in OPENAI_NO_EFFECT
            or name in OPENAI_URLS.values()
        ):
            raise RowError(
                f"{where}: unknown field (cbgen takes {', '.join(sorted(SAMPLING_FIELDS | LOGPROB_FIELDS | OPENAI_ALIASES.keys()))}; "
                f"ignores {', '.join(sorted(OPENAI_NO_EFFECT))})"
            )


def _overrides(source: Mapping[str, Any], openai: bool) -> dict[str, Any]:
    out = {k: v for k, v in source.items() if k in SAMPLING_FIELDS and v is not None}
    if openai:
        for alias, name in OPENAI_ALIASES.items():
            if source.get(alias) is not None:
                out[name] = source[alias]
    out.pop("logprobs", None)
    out.update(_logprobs(source.get("logprobs"), source.get("top_logprobs")))
    given = {name: kind for name, kind in GUIDED_FIELDS.items() if source.get(name) is not None}
    wanted = _response_format(source.get("response_format"))
    if wanted is not None:
        given["response_format"] = "response_format"
    if "structured_outputs" in out:
        given = {"structured_outputs": "", **given}
    if len(given) > 1:
        raise RowError(
            f"{' and '.join(given)}: give one way to constrain the output, not {len(given)}"
        )
    if wanted is not None:
        out["structured_outputs"] = wanted
    for name, kind in GUIDED_FIELDS.items():
        if name in given:
            out["structured_outputs"] = {kind: source[name]}
    return out


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's response_format as structured_outputs; None for text (or no field)."""
    if value is None or value == {"type": "text"}:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise RowError(
                f"response_format.json_schema.schema: must be a JSON schema object, got {_describe(schema)}"
            )
        return {"json": dict(schema)}
    raise RowError(
        f"response_format: expected type text, json_object or json_schema, got {_describe(value)}"
    )


def _logprobs(want: Any, top: Any) -> dict[str, Any]:
    """SamplingParams.logprobs from OpenAI's `logprobs: true` (+ `top_logprobs: k`, default 0)
    or vLLM's `logprobs: k`; `false` asks for none. Nothing when neither field is given."""
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise RowError(f"top_logprobs: must be an integer, got {_describe(top)}")
    if want is None or want is False:
        if top:
            raise RowError("top_logprobs: needs logprobs: true")
        return {} if want is None else {"logprobs": None}
    if want is True:
        return {"logprobs": top or 0}
    if not isinstance(want, int):
        raise RowError(f"logprobs: must be true, false or an integer, got {_describe(want)}")
    if top is not None:
        raise RowError(
            "top_logprobs: goes with logprobs: true; with an integer logprobs give one or the other"
        )
    return {"logprobs": want}


def make_params(defaults: SamplingParams, overrides: Mapping[str, Any]) -> SamplingParams:
    """The row's params: defaults with its overrides; RowError naming the field when invalid."""
    if not overrides:
        return defaults
    try:
        return defaults.replace(**overrides)
    except (ValueError, TypeError) as e:
        raise RowError(str(e)) from None


def _json_text(value: Any) -> str | None:
    """A pass-through JSONL value as text: strings as they are, anything else as JSON."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _describe(value: Any) -> str:
    text = (
        json.dumps(value, ensure_ascii=False, default=repr)
        if not isinstance(value, str)
        else repr(value)
    )
    return text if len(text) <= 60 else text[:57] + "..."

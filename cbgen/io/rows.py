"""Input rows: one prompt (raw text, token ids or chat messages), its id and its per-row
sampling overrides, as the readers hand them on (parsed by cbgen.io.parse).

A row that cannot be used is still an `InputRow`, with `error` naming the problem and where
it is (`line 7: ...` for JSONL, `row 6: ...` for Parquet), so that it becomes an output row
with finish_reason="error" and the run goes on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Prompt = str | list[int]
Messages = list[dict[str, str]]


@dataclass(frozen=True)
class ColumnSpec:
    """Which fields of a row hold what. None picks the default names."""

    prompt_column: str | None = None
    """None: `prompt` (text or token ids) or `messages` (chat), whichever the row has."""
    id_column: str | None = None
    """None: `id`, or `custom_id` for OpenAI batch rows; a row without one gets its index."""
    keep_columns: tuple[str, ...] = ()
    """Fields copied through to the output unchanged."""


@dataclass(frozen=True)
class ChatDefaults:
    """Run-wide chat options (--chat-template, --chat-template-kwargs); a row's own win."""

    template: str | None = None
    """A Jinja chat template used instead of the model's own."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables for the template (for example {"enable_thinking": false})."""

    def render_options(self, row_chat: Mapping[str, Any]) -> dict[str, Any]:
        """Keyword arguments of Engine.apply_chat_template for a row with these chat options."""
        cont = bool(row_chat.get("continue_final_message", False))
        return {
            "chat_template": self.template,
            "add_generation_prompt": bool(row_chat.get("add_generation_prompt", not cont)),
            "continue_final_message": cont,
            "template_kwargs": {**self.kwargs, **row_chat.get("chat_template_kwargs", {})},
        }


@dataclass(frozen=True)
class InputRow:
    row: int
    """0-based index among the input's data rows (blank JSONL lines are not rows)."""
    where: str
    """Human position for messages: 'line 7' (JSONL, 1-based) or 'row 6' (Parquet)."""
    id: str
    prompt: Prompt | None = None
    messages: Messages | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    """SamplingParams fields given by the row; validated when the params are built."""
    keep: dict[str, Any] = field(default_factory=dict)
    chat: dict[str, Any] = field(default_factory=dict)
    """The row's own chat options (CHAT_FIELDS): template kwargs, add_generation_prompt,
    continue_final_message; they apply to `messages` only."""
    error: str | None = None
    """Set when the row is unusable: the message already starts with `where`."""


class RowError(ValueError):
    """A problem with one row; the message does not include the row's position."""

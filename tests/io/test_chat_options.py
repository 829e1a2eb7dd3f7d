"""Chat options: a run-wide template file and template variables, and per-row
chat_template_kwargs / add_generation_prompt / continue_final_message (vLLM's names)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from helpers.cli import read_rows, run, tiny, write_jsonl

from cbgen.io.parse import parse_mapping
from cbgen.io.rows import ChatDefaults, ColumnSpec

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}{% if shout %} LOUDLY{% endif %}"
)
CHAT = [{"role": "user", "content": "hi there"}]


def _row(**fields: Any) -> Any:
    return parse_mapping(dict(fields), 0, "line 1", ColumnSpec(), {})


def test_row_chat_options_are_parsed_and_checked() -> None:
    row = _row(messages=CHAT, chat_template_kwargs={"enable_thinking": False})
    assert row.error is None and row.chat == {"chat_template_kwargs": {"enable_thinking": False}}
    batch = {
        "custom_id": "a",
        "url": "/v1/chat/completions",
        "body": {"messages": CHAT, "add_generation_prompt": False},
    }
    assert parse_mapping(batch, 0, "line 1", ColumnSpec(), {}).chat == {
        "add_generation_prompt": False
    }
    assert _row(prompt="x", chat_template_kwargs={"a": 1}).error == (
        "line 1: chat_template_kwargs: applies to chat rows (messages) only"
    )
    assert _row(messages=CHAT, chat_template_kwargs=[1]).error == (
        "line 1: chat_template_kwargs: must be an object, got [1]"
    )
    assert _row(messages=CHAT, continue_final_message="yes").error == (
        "line 1: continue_final_message: must be true or false, got 'yes'"
    )
    both = _row(messages=CHAT, continue_final_message=True, add_generation_prompt=True)
    assert both.error == (
        "line 1: continue_final_message: cannot be combined with add_generation_prompt"
    )


def test_defaults_and_row_options_combine() -> None:
    chat = ChatDefaults("T", {"shout": True, "x": 1})
    assert chat.render_options({}) == {
        "chat_template": "T",
        "add_generation_prompt": True,
        "continue_final_message": False,
        "template_kwargs": {"shout": True, "x": 1},
    }
    got = chat.render_options({"continue_final_message": True, "chat_template_kwargs": {"x": 2}})
    assert got["add_generation_prompt"] is False and got["continue_final_message"] is True
    assert got["template_kwargs"] == {"shout": True, "x": 2}


def test_cbgen_run_renders_with_the_template_file_and_variables(
    tmp_path: Path, chat_model: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    src = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"id": "plain", "messages": CHAT},
            {"id": "quiet", "messages": CHAT, "chat_template_kwargs": {"shout": False}},
            {
                "id": "cont",
                "messages": [*CHAT, {"role": "assistant", "content": "Well"}],
                "continue_final_message": True,
            },
        ],
    )
    args = ["run", str(src), *tiny(chat_model), "--chat-template", str(template)]
    out = run([*args, "--chat-template-kwargs", '{"shout": true}'])
    assert out.returncode == 0, out.stderr + out.stdout
    rows = {r["id"]: r for r in read_rows(tmp_path / "c.out.parquet")}

    def tokens(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    assert rows["plain"]["prompt_tokens"] == tokens("<user>hi there<assistant> LOUDLY")
    assert rows["quiet"]["prompt_tokens"] == tokens("<user>hi there<assistant>")
    assert rows["cont"]["prompt_tokens"] == tokens("<user>hi there<assistant>Well")
    assert all(r["error"] is None for r in rows.values())

    again = run([*args, "--chat-template-kwargs", '{"shout": false}'])
    assert again.returncode == 5 and "--chat-template-kwargs" in again.stderr
    bad = run([*args, "--chat-template-kwargs", "[1]", "-o", str(tmp_path / "x.parquet")])
    assert bad.returncode == 2
    assert "--chat-template-kwargs: must be a JSON object" in bad.stderr
    summary = json.loads((tmp_path / "c.out.summary.json").read_text())
    assert summary["chat_template_kwargs"] == {"shout": True}


def test_a_thinking_models_reasoning_goes_to_its_own_column() -> None:
    from cbgen.io.schema import split_reasoning

    tags = ("<think>", "</think>")
    assert split_reasoning("<think>\nadd 2 and 2\n</think>\n\nIt is 4.", tags) == (
        "add 2 and 2",
        "It is 4.",
    )
    # the template opened the block in the prompt: only the end tag was generated
    assert split_reasoning("count the legs</think>Four.", tags) == ("count the legs", "Four.")
    # cut off while thinking, or a model without tags: all answer, as generated
    assert split_reasoning("<think>still going", tags) == (None, "<think>still going")
    assert split_reasoning("a </think> b", None) == (None, "a </think> b")


def test_thinking_models_are_recognised_by_their_tokens(tmp_path: Path, chat_model: Path) -> None:
    import shutil

    from transformers import AutoTokenizer

    from cbgen.engine.engine import Engine

    def engine(folder: Path) -> Engine:
        return Engine(
            model=str(folder),
            load_format="dummy",
            device="cpu",
            kv_cache_memory=4 << 20,
            num_threads=1,
        )

    assert engine(chat_model).reasoning_tags() is None
    thinking = tmp_path / "thinking"
    shutil.copytree(chat_model, thinking)
    tok = AutoTokenizer.from_pretrained(chat_model)
    tok.add_tokens(["<think>", "</think>"], special_tokens=False)
    tok.save_pretrained(thinking)
    config = json.loads((thinking / "config.json").read_text())
    (thinking / "config.json").write_text(json.dumps(dict(config, vocab_size=len(tok))))
    assert engine(thinking).reasoning_tags() == ("<think>", "</think>")

"""Structured outputs: a JSON schema, a regex, a choice or a grammar constrains a row's completion.
Checked on the real SmolLM2 (greedy and sampled), through rows and `cbgen run` on a tiny model
with SmolLM2's tokenizer, and on a thinking tokenizer (the constraint starts after </think>)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers.cli import read_rows, run, tiny, write_jsonl

from cbgen.engine.engine import Engine
from cbgen.engine.structured import Grammars, choice_regex, reasoning_open
from cbgen.io.parse import parse_mapping
from cbgen.io.rows import ColumnSpec
from cbgen.llm import LLM
from cbgen.sampling_params import SamplingParams, StructuredOutputs

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "likes_tea": {"type": "boolean"},
    },
    "required": ["name", "age", "likes_tea"],
    "additionalProperties": False,
}
REGEX = r"\d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]


def chat(engine: Engine, text: str) -> list[int]:
    return engine.apply_chat_template([{"role": "user", "content": text}])


def check_person(text: str) -> None:
    """The completion is JSON of SCHEMA: exactly its keys, each of its type."""
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"name", "age", "likes_tea"}, text
    assert isinstance(value["name"], str) and len(value["name"]) <= 24
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert isinstance(value["likes_tea"], bool)


def generate(engine: Engine, prompts: list[Any], params: list[SamplingParams]) -> list[Any]:
    outs = LLM(engine=engine).generate(prompts, params)
    assert all(o.finish_reason in ("stop", "length") for o in outs), [o.error for o in outs]
    return outs


# ---- on the real model ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_completions_parse_and_match(
    smollm2_engine: Engine, temperature: float
) -> None:
    e = smollm2_engine
    base = SamplingParams(temperature=temperature, seed=7, max_tokens=48)
    prompts = [
        chat(e, "Describe a person as JSON with name, age and whether they like tea."),
        chat(e, "Write a phone number."),
        chat(e, "Is 'I loved this film' positive or negative?"),
        chat(e, "Say yes or no."),
    ]
    params = [
        base.replace(structured_outputs=StructuredOutputs(json=SCHEMA)),
        base.replace(structured_outputs=StructuredOutputs(regex=REGEX)),
        base.replace(structured_outputs=StructuredOutputs(choice=CHOICES)),
        base.replace(structured_outputs=StructuredOutputs(grammar='root ::= "yes" | "no"')),
    ]
    person, phone, label, answer = generate(e, prompts, params)
    check_person(person.text)
    assert re.fullmatch(REGEX, phone.text), phone.text
    assert label.text in CHOICES
    assert answer.text in ("yes", "no")
    # a finished grammar ends the sequence: on EOS, the only token it then allows
    for out in (person, phone, label, answer):
        assert out.finish_reason == "stop" and out.output_token_ids[-1] == e.eos_token_id


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_unconstrained_rows_give_the_same_tokens_beside_constrained_ones(
    smollm2_engine: Engine,
) -> None:
    e = smollm2_engine
    free = [e.tokenize("The capital of France is"), chat(e, "Name a colour.")]
    free_params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
    ]
    alone = [o.output_token_ids for o in generate(e, free, free_params)]
    constrained = [chat(e, "Write a phone number."), chat(e, "Describe a person as JSON.")]
    c_params = [
        SamplingParams(
            temperature=1.0,
            seed=5,
            max_tokens=12,
            structured_outputs=StructuredOutputs(regex=REGEX),
        ),
        SamplingParams(
            temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputs(json=SCHEMA)
        ),
    ]
    mixed = generate(e, [constrained[0], free[0], constrained[1], free[1]], [
        c_params[0], free_params[0], c_params[1], free_params[1]
    ])  # fmt: skip
    assert [mixed[1].output_token_ids, mixed[3].output_token_ids] == alone
    assert re.fullmatch(REGEX, mixed[0].text) and json.loads(mixed[2].text)


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_a_grammar_compiles_once_for_every_row_that_has_it(smollm2_engine: Engine) -> None:
    e = smollm2_engine
    spec = StructuredOutputs(regex=r"(cat|dog|cow) [0-9]")  # seen by no other test
    before = e.grammars.num_compiled
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=8, structured_outputs=spec)
    outs = generate(e, [chat(e, "An animal and a digit?")] * 2, [params, params.replace(seed=2)])
    assert e.grammars.num_compiled == before + 1
    assert all(re.fullmatch(r"(cat|dog|cow) [0-9]", o.text) for o in outs)
    # a schema as text or as the object of that text is one grammar
    text = json.dumps({**SCHEMA, "title": "cache"})
    for spec in (text, text, json.loads(text)):
        e.validate_request([1, 2], SamplingParams(structured_outputs=StructuredOutputs(json=spec)))
    assert e.grammars.num_compiled == before + 2


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_preempted_requests_resume_their_grammar_where_it_was(smollm2_engine: Engine) -> None:
    base = smollm2_engine
    prompts = [chat(base, f"Describe person number {i} as JSON.") for i in range(4)]
    params = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputs(json=SCHEMA)
    )
    expected = [o.output_token_ids for o in generate(base, prompts, [params] * 4)]
    longest = max(len(p) for p in prompts) + 40
    bs = base.config.block_size
    tight = Engine(
        base.config.replace(
            kv_cache_memory=base.kv_bytes_per_block * (-(-longest // bs) + 2),
            enable_prefix_caching=False,
        ),
        share_weights_with=base,
    )
    outs = generate(tight, prompts, [params] * 4)
    assert tight.total_preemptions > 0
    assert [o.output_token_ids for o in outs] == expected
    for o in outs:
        check_person(o.text)


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_a_spec_the_engine_cannot_compile_is_refused_naming_it(smollm2_engine: Engine) -> None:
    e = smollm2_engine
    bad = SamplingParams(structured_outputs=StructuredOutputs(regex="(unclosed"))
    with pytest.raises(ValueError, match=r"^structured_outputs: the regex does not compile"):
        e.validate_request([1, 2, 3], bad)
    outs = LLM(engine=e).generate(["a", "b"], [bad, SamplingParams(max_tokens=2)])
    assert outs[0].finish_reason == "error" and "does not compile" in (outs[0].error or "")
    assert outs[1].finish_reason == "length"


# ---- specs and rows -----------------------------------------------------------------------


def test_a_spec_gives_exactly_one_kind() -> None:
    assert StructuredOutputs.coerce({"choice": ("a", "b")}).choice == ["a", "b"]
    for bad, why in [
        ({"json": SCHEMA, "regex": "a"}, "got json and regex"),
        ({}, "got none"),
        ({"choice": ["a", ""]}, "choice: must be"),
        ({"json": "[1, 2]"}, "json: the schema must be a JSON object"),
        ({"regex": 3}, "regex: must be a non-empty string"),
        ({"jsonschema": {}}, "unknown field 'jsonschema'"),
    ]:
        with pytest.raises(ValueError, match=f"^structured_outputs: .*{re.escape(why)}"):
            StructuredOutputs.coerce(bad)
    # choices are literal text, not patterns
    literal = ["a.b", "c|d", "(x)", "e\\f", "g/h"]
    assert all(re.fullmatch(choice_regex(literal), c) for c in literal)
    assert not re.fullmatch(choice_regex(["a.b"]), "axb")


def _row(obj: dict[str, Any]) -> Any:
    return parse_mapping(obj, 0, "line 1", ColumnSpec(), {})


def test_rows_give_structured_outputs_or_openai_response_format() -> None:
    plain = _row({"prompt": "x", "structured_outputs": {"regex": "a+"}})
    assert plain.error is None and plain.overrides["structured_outputs"] == {"regex": "a+"}
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    batch = _row(
        {
            "custom_id": "r1",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "response_format": schema},
        }
    )
    assert batch.error is None and batch.overrides["structured_outputs"] == {"json": SCHEMA}
    assert _row({"prompt": "x", "response_format": {"type": "json_object"}}).overrides == {
        "structured_outputs": {"json_object": True}
    }
    assert _row({"prompt": "x", "response_format": {"type": "text"}}).overrides == {}
    assert _row({"prompt": "x", "response_format": {"type": "yaml"}}).error == (
        'line 1: response_format: expected type text, json_object or json_schema, got {"type": "yaml"}'
    )
    both = _row({"prompt": "x", "response_format": schema, "structured_outputs": {"regex": "a"}})
    assert both.error == (
        "line 1: structured_outputs and response_format: give one way to constrain the output, not 2"
    )
    # vLLM's older names, each one kind
    for field, kind, value in (
        ("guided_json", "json", SCHEMA),
        ("guided_regex", "regex", "a+"),
        ("guided_choice", "choice", ["yes", "no"]),
        ("guided_grammar", "grammar", 'root ::= "a"'),
    ):
        row = _row({"prompt": "x", field: value})
        assert row.error is None and row.overrides == {"structured_outputs": {kind: value}}
    guided_too = _row({"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]})
    assert guided_too.error == (
        "line 1: guided_regex and guided_choice: give one way to constrain the output, not 2"
    )
    assert _row({"prompt": "x", "guided_regex": None}).overrides == {}
    no_schema = _row({"prompt": "x", "response_format": {"type": "json_schema"}})
    assert no_schema.error is not None and "response_format.json_schema.schema" in no_schema.error


# ---- a thinking model ---------------------------------------------------------------------


def test_reasoning_is_open_unless_the_prompt_closed_it() -> None:
    start, end = 7, 8
    assert reasoning_open([1, 2, 3], start, end)  # the model opens it itself
    assert reasoning_open([1, start, 2], start, end)
    assert not reasoning_open([1, start, 2, end, 3], start, end)  # enable_thinking: false


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory, chat_model: Path) -> Path:
    """The tiny chat model with <think> and </think> tokens (a thinking model's tokenizer)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("thinking")
    shutil.copytree(chat_model, folder, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["<think>", "</think>"], special_tokens=False)
    tok.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, vocab_size=len(tok))))
    return folder


def test_on_a_thinking_model_the_constraint_starts_after_the_reasoning(
    thinking_model: Path,
) -> None:
    e = Engine(
        model=str(thinking_model),
        load_format="dummy",
        device="cpu",
        dtype="float32",
        num_threads=1,
        kv_cache_memory=8 << 20,
    )
    start, end = e.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    prompt = e.tokenize("Think, then answer.")
    # rows without a constraint never build the grammar machinery
    LLM(engine=e).generate([prompt], SamplingParams(max_tokens=3))
    assert e._grammars is None
    some = e.tokenize(" hmm")[0]
    # reasoning runs free (here: four forced tokens, then </think>), the answer is a choice
    forced = SamplingParams(
        temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputs(choice=["yes", "no"])
    )
    outs = LLM(engine=e).generate(
        [prompt, [*prompt, start, some, end]],
        [forced.replace(logit_bias={end: 100.0}), forced.replace(logit_bias={some: 100.0})],
    )
    open_block, closed_block = outs
    # the open block: </think> first (the bias wins while nothing is constrained), then a choice
    assert open_block.output_token_ids[0] == end
    assert e.tokenizer.decode(open_block.output_token_ids[1:-1]) in ("yes", "no")
    # the prompt closed the block: constrained from the first token (the bias cannot win)
    assert some not in closed_block.output_token_ids
    assert closed_block.text in ("yes", "no")


def test_a_waiting_state_masks_nothing_until_the_end_tag(chat_model: Path) -> None:
    from cbgen.models.source import resolve_model
    from cbgen.models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(str(chat_model), "dummy"))
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])
    end = tok.convert_tokens_to_ids("<|im_start|>")  # stands in for </think>
    state = grammars.state(StructuredOutputs(choice=["yes", "no"]), waiting_for=end)
    assert not state.active
    state.accept(tok.encode("maybe", add_special_tokens=False)[0])  # not fed to the matcher
    assert not state.active and not state.finished
    state.accept(end)
    assert state.active
    for t in tok.encode("yes", add_special_tokens=False):
        state.accept(t)
    state.accept(tok.eos_token_id)
    assert state.finished and not state.failed


# ---- through cbgen run ----------------------------------------------------------------------


def test_cbgen_run_applies_run_wide_and_row_constraints_and_resume_checks_them(
    tmp_path: Path, chat_model: Path
) -> None:
    flag = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    src = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"id": "plain", "prompt": "Good or bad?"},
            {"id": "regex", "prompt": "A code:", "structured_outputs": {"regex": "[A-C]{3}"}},
            {
                "custom_id": "json",
                "body": {
                    "messages": [{"role": "user", "content": "ok?"}],
                    "response_format": {"type": "json_schema", "json_schema": {"schema": flag}},
                },
            },
            {"id": "two", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
            {"id": "broken", "prompt": "x", "structured_outputs": {"regex": "(a"}},
        ],
    )
    out = tmp_path / "out.parquet"
    args = ["run", str(src), "-o", str(out), *tiny(chat_model, "--max-tokens", "12")]
    done = run([*args, "--choice", "good", "--choice", "bad"])
    assert done.returncode == 0, done.stderr + done.stdout
    rows = {r["id"]: r for r in read_rows(out)}
    assert rows["plain"]["completion"] in ("good", "bad")
    assert re.fullmatch("[A-C]{3}", rows["regex"]["completion"])
    assert isinstance(json.loads(rows["json"]["completion"])["ok"], bool)
    assert rows["two"]["error"] == (
        "line 4: structured_outputs: give exactly one of json, regex, choice, grammar, "
        "json_object, got regex and choice"
    )
    assert rows["broken"]["error"].startswith(
        "line 5: structured_outputs: the regex does not compile"
    )
    assert all(rows[k]["finish_reason"] == "stop" for k in ("plain", "regex", "json"))

    # another run-wide constraint would mix two kinds of answers in one output
    changed = run([*args, "--choice", "good", "--choice", "meh"])
    assert changed.returncode == 5, changed.stderr + changed.stdout
    assert "--json-schema / --regex / --choice" in changed.stderr
    several = run([*args, "--regex", "a", "--choice", "b"])
    assert several.returncode == 2 and "--regex and --choice: give one constraint" in several.stderr


def test_json_object_is_any_compact_object(chat_model: Path) -> None:
    from cbgen.models.source import resolve_model
    from cbgen.models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(str(chat_model), "dummy"))
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])

    def accepts(text: str) -> bool:
        state = grammars.state(StructuredOutputs(json_object=True))
        for t in [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]:
            state.accept(t)
        return state.finished and not state.failed

    assert accepts('{"a": [1, {"b": null}], "c": "x"}') and accepts("{}")
    assert not accepts("[1]") and not accepts('{ "a": 1}') and not accepts('{"a": 1')


def test_run_wide_constraints_from_the_command_line(tmp_path: Path) -> None:
    from cbgen.run_options import structured_defaults

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    assert structured_defaults(str(schema_file), None, None) == {"json": SCHEMA}
    assert structured_defaults(None, "a+", None) == {"regex": "a+"}
    assert structured_defaults(None, None, ["x", "y"]) == {"choice": ["x", "y"]}
    assert structured_defaults(None, None, None) is None
    (tmp_path / "list.json").write_text("[1]")
    for args, why in [
        ((str(tmp_path / "missing.json"), None, None), "--json-schema: cannot read"),
        ((str(tmp_path / "list.json"), None, None), "must hold a JSON object"),
        ((str(schema_file), "a", None), "--json-schema and --regex: give one constraint"),
    ]:
        with pytest.raises(ValueError, match=re.escape(why)):
            structured_defaults(*args)

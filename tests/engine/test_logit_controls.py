"""Per-row logit_bias, allowed_token_ids and bad_words (vLLM's names): checked on a tiny llama
with a one-character-per-token tokenizer (test_requests' model_dir), and against transformers'
greedy generation with the matching logits processors on the same weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cli import read_rows, run, tiny, write_jsonl
from helpers.models import make_engine

from cbgen.engine.engine import Engine
from cbgen.engine.sampler import Sampler, SamplingRow
from cbgen.io.parse import parse_mapping
from cbgen.io.rows import ColumnSpec
from cbgen.llm import LLM
from cbgen.sampling_params import SamplingParams
from tools.model_shapes import TINY_CHAT_LLAMA

PROMPTS = [[40, 41, 42, 43, 44, 45, 46, 47, 48], [100, 3, 77, 42, 42, 9, 250, 17], [30, 31]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return make_engine(model_dir, kv_cache_memory=4 << 20, max_num_seqs=8)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def greedy(engine: Engine, prompts: Sequence[Any], **controls: Any) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **controls)
    return [list(o.output_token_ids) for o in LLM(engine=engine).generate(list(prompts), params)]


def hf_greedy(model: Any, prompt: Sequence[int], processor: Any = None, **config: Any) -> list[int]:
    """transformers' greedy tokens, EOS ignored; config: GenerationConfig fields."""
    from transformers import GenerationConfig, LogitsProcessorList

    x = torch.tensor([list(prompt)])
    gc = GenerationConfig(
        do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=[], pad_token_id=0, **config
    )
    extra = LogitsProcessorList([processor] if processor is not None else [])
    with torch.no_grad():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), generation_config=gc, logits_processor=extra
        )
    return list(out[0, x.shape[1] :].tolist())


class _AllowOnly:
    """A transformers logits processor: every token but these gets -inf."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        keep = torch.full_like(scores, float("-inf"))
        keep[:, self.ids] = 0.0
        return scores + keep


def test_a_logit_bias_makes_its_token_win_as_in_transformers(engine: Engine, hf: Any) -> None:
    plain = greedy(engine, PROMPTS)
    target = 123
    assert all(target not in out for out in plain)  # the bias is what puts it there
    biased = greedy(engine, PROMPTS, logit_bias={str(target): 100})
    assert biased == [[target] * NEW_TOKENS] * len(PROMPTS)
    # a small bias moves some tokens and not others: the same ones as in transformers
    nudged = greedy(engine, PROMPTS, logit_bias={plain[0][3]: -2.0, 77: 1.5})
    for prompt, got in zip(PROMPTS, nudged, strict=True):
        assert got == hf_greedy(hf, prompt, sequence_bias={(plain[0][3],): -2.0, (77,): 1.5})
    assert nudged != plain


def test_allowed_token_ids_are_the_only_tokens_sampled(engine: Engine, hf: Any) -> None:
    allowed = [7, 60, 201]
    got = greedy(engine, PROMPTS, allowed_token_ids=allowed)
    for prompt, out in zip(PROMPTS, got, strict=True):
        assert set(out) <= set(allowed)
        assert out == hf_greedy(hf, prompt, _AllowOnly(allowed))
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=40, allowed_token_ids=[9, 10])
    sampled = LLM(engine=engine).generate(PROMPTS, params)
    tokens = {t for o in sampled for t in o.output_token_ids}
    assert tokens == {9, 10}  # both drawn at a high temperature, nothing else


def test_bad_words_never_appear_in_the_output(engine: Engine, hf: Any) -> None:
    plain = greedy(engine, PROMPTS)
    chars = range(4, 99)  # one token per character (write_char_tokenizer)
    # a two-character word the model writes inside an output, and a one-character one
    at = next(i for i in range(1, NEW_TOKENS - 1) if {*plain[0][i : i + 2]} <= {*chars})
    one = next(t for t in plain[2] if t in chars)
    words = [plain[0][at : at + 2], [one]]
    got = greedy(engine, PROMPTS, bad_words=[engine.tokenizer.decode(w) for w in words])
    for prompt, out in zip(PROMPTS, got, strict=True):
        for ids in words:
            assert not any(out[i : i + len(ids)] == ids for i in range(len(out))), (out, ids)
        # transformers matches a word against prompt + output, cbgen (as vLLM) the output
        # only: they agree while no prompt ends with a word's first token
        assert prompt[-1] != words[0][0]
        assert out == hf_greedy(hf, prompt, bad_words_ids=words)
    assert got[0] != plain[0] and got[2] != plain[2]


def test_bad_words_mask_a_word_only_after_its_first_tokens() -> None:
    """A multi-token word's last token is masked only where the output ends with the rest;
    a word that also tokenizes differently after a space is masked in both forms."""
    vocab = 8
    logits = torch.zeros(4, vocab)
    logits[:, 5] = 1.0  # every row's favourite
    params = SamplingParams(temperature=0.0, bad_words=["x"])
    words = ((3, 5), (6,))
    rows = [
        SamplingRow(params, [1, 2, 3], 2, None, (), words),  # output [3]: 5 masked
        SamplingRow(params, [1, 3, 2], 2, None, (), words),  # a 3 in the prompt only: allowed
        SamplingRow(params, [1, 2], 2, None, (), words),  # no output yet: allowed
        SamplingRow(params, [1, 2, 3, 5, 4], 2, None, (), words),  # output ends with 4: allowed
    ]
    logits[:, 6] = 2.0  # (6,) is a one-token word: masked everywhere
    assert Sampler()(logits, rows) == [0, 5, 5, 5]


def test_rows_with_controls_never_take_the_exact_head(engine: Engine) -> None:
    """The exact head makes token ids without float32 logits: a row with a control must be
    sampled from the logits. A head that always answers 0 shows which rows it took."""

    class ZeroHead:
        MIN_TEMPERATURE = 0.0

        def __init__(self) -> None:
            self.rows = 0

        def __call__(self, h: torch.Tensor, temperature: Any, seeds: Any) -> torch.Tensor:
            self.rows += h.shape[0]
            return torch.zeros(h.shape[0], dtype=torch.long)

    cases: list[dict[str, Any]] = [
        {"logit_bias": {99: 1.5}},
        {"allowed_token_ids": [0, 99]},
        {"bad_words": ["a"]},
    ]
    want = [greedy(engine, PROMPTS[:1], **controls) for controls in cases]
    runtime = engine.runtime
    head = ZeroHead()
    runtime.exact_head = head  # type: ignore[assignment]
    try:
        plain = greedy(engine, PROMPTS[:1])
        assert plain == [[0] * NEW_TOKENS] and head.rows == NEW_TOKENS
        for controls, tokens in zip(cases, want, strict=True):
            head.rows = 0
            assert greedy(engine, PROMPTS[:1], **controls) == tokens
            assert head.rows == 0, controls
    finally:
        runtime.exact_head = None


def test_logit_bias_keys_and_values_as_openai_gives_them() -> None:
    openai: Any = {"12": 250, 7: -0.5, "3": -1e9}  # JSON object keys are strings
    p = SamplingParams(logit_bias=openai)
    assert p.logit_bias == {12: 100.0, 7: -0.5, 3: -100.0}
    assert p.replace(n=1).logit_bias == p.logit_bias
    assert not SamplingParams(logit_bias={}).has_logit_controls
    cases: list[tuple[str, Any]] = [
        ("logit_bias", {"a": 1}),
        ("logit_bias", {"-1": 1}),
        ("logit_bias", {"1": "x"}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [-3]),
        ("bad_words", "word"),
        ("bad_words", [" "]),
    ]
    for name, value in cases:
        with pytest.raises(ValueError, match=rf"^{name}: "):
            SamplingParams(**{name: value})


def test_rows_carry_the_controls_to_sampling_params() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "logit_bias": {"5": 10},
        "allowed_token_ids": [1, 5],
    }
    row = {"custom_id": "r", "url": "/v1/chat/completions", "body": body}
    parsed = parse_mapping(row, 0, "line 1", ColumnSpec(), {})
    plain = parse_mapping({"prompt": "x", "bad_words": ["no"]}, 0, "line 1", ColumnSpec(), {})
    assert parsed.error is None and plain.error is None
    params = SamplingParams().replace(**parsed.overrides)
    assert params.logit_bias == {5: 10.0} and params.allowed_token_ids == [1, 5]
    assert SamplingParams().replace(**plain.overrides).bad_words == ["no"]


def test_cbgen_run_applies_row_controls_and_refuses_bad_ids(
    tmp_path: Path, chat_model: Path
) -> None:
    vocab = TINY_CHAT_LLAMA["vocab_size"]
    src = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"id": "bias", "prompt": "Hi", "logit_bias": {"1234": 100}, "logprobs": 0},
            {"id": "allowed", "prompt": "Hi", "allowed_token_ids": [77, 78], "logprobs": 0},
            {"id": "far", "prompt": "Hi", "allowed_token_ids": [vocab]},
            {"id": "bias_type", "prompt": "Hi", "logit_bias": {"x": 1}},
        ],
    )
    out = run(["run", str(src), *tiny(chat_model), "--max-error-rate", "1"])
    assert out.returncode == 0, out.stderr + out.stdout
    rows = {r["id"]: r for r in read_rows(tmp_path / "c.out.parquet")}
    assert [e["token_id"] for e in rows["bias"]["logprobs"]] == [1234] * 4
    assert {e["token_id"] for e in rows["allowed"]["logprobs"]} <= {77, 78}
    assert rows["far"]["error"] == (
        f"line 3: allowed_token_ids: token id {vocab} is outside the vocabulary [0, {vocab})"
    )
    assert rows["bias_type"]["error"] == "line 4: logit_bias: key 'x' is not a token id"

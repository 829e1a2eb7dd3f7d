"""Requests in: SamplingParams and EngineConfig validation, bad input that must become a clear
error for that request only, stop strings, stop token ids, EOS, ignore_eos and min_tokens.

The engine runs the tiny random-weight Llama (vocabulary 256) with a character-level
tokenizer (helpers.models.write_char_tokenizer: ids 0-3 are <pad> <s> </s> <unk>, then one id
per printable ASCII character, then two-letter strings ("aa", "ab", ...), so text is cheap and
exact; the model_dir fixture)."""

from __future__ import annotations

import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import make_engine, write_char_tokenizer

from cbgen.config import EngineConfig
from cbgen.engine.engine import Engine
from cbgen.llm import LLM
from cbgen.sampling_params import SamplingParams

VOCAB = 256
MAX_MODEL_LEN = 64
NUM_BLOCKS = 8  # of 4 tokens: 32 tokens of KV cache, less than max_model_len


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return make_engine(model_dir)


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48]


def greedy(engine: Engine, prompt: Any, **changes: Any) -> Any:
    return LLM(engine=engine).generate([prompt], GREEDY.replace(**changes))[0]


# ---- SamplingParams ---------------------------------------------------------------------

BAD_SAMPLING_PARAMS: list[tuple[str, Any]] = [
    ("n", 0), ("n", 2.0),
    ("max_tokens", 0), ("max_tokens", "16"), ("max_tokens", None),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.5),
    ("temperature", -0.5), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_k", -2), ("top_k", 2.5),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan),
    ("min_p", -0.1), ("min_p", 1.5),
    ("seed", -1), ("seed", 2**64), ("seed", 1.0), ("seed", True),
    ("stop", [""]), ("stop", None), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", None), ("stop_token_ids", ["a"]), ("stop_token_ids", [True]),
    ("stop_token_ids", "12"),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("presence_penalty", 2.5), ("presence_penalty", -3.0),
    ("frequency_penalty", -2.5), ("frequency_penalty", math.nan),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", True), ("logprobs", 1.0),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21), ("prompt_logprobs", "2"),
    ("logit_bias", [1]), ("logit_bias", {"x": 1}), ("logit_bias", {3: math.nan}),
    ("allowed_token_ids", []), ("allowed_token_ids", [1.0]), ("allowed_token_ids", "1"),
    ("bad_words", "no"), ("bad_words", [""]), ("bad_words", [3]),
    ("structured_outputs", {"json": {}, "regex": "a"}), ("structured_outputs", {"choice": []}),
    ("structured_outputs", "a+"), ("structured_outputs", {"json": "[1]"}),
]  # fmt: skip


def test_every_sampling_field_is_validated() -> None:
    assert {name for name, _ in BAD_SAMPLING_PARAMS} == set(SamplingParams.field_names())


@pytest.mark.parametrize(("name", "value"), BAD_SAMPLING_PARAMS)
def test_invalid_sampling_params_raise_value_error_naming_the_field(name: str, value: Any) -> None:
    kwargs = {"max_tokens": 16, name: value}
    with pytest.raises(ValueError, match=rf"^{name}: "):
        SamplingParams(**kwargs)


def test_valid_sampling_params_edge_values() -> None:
    p = SamplingParams(
        top_k=-1, stop="###", stop_token_ids=(5, 6), min_tokens=16, max_tokens=16, seed=2**64 - 1
    )
    assert (p.top_k, p.stop, p.stop_token_ids) == (0, ["###"], [5, 6])
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.5).greedy


BAD_ENGINE_CONFIG: list[tuple[str, Any]] = [
    ("max_num_seqs", 0), ("max_num_seqs", "8"),
    ("max_num_batched_tokens", 0), ("max_num_batched_tokens", 1.5),
    ("enable_chunked_prefill", "no"),
    ("block_size", 12), ("block_size", 0),
    ("kv_cache_memory", 0), ("kv_cache_memory", 1.5),
    ("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5), ("gpu_memory_utilization", math.nan),
    ("max_model_len", 0), ("max_model_len", "2k"),
    ("dtype", "fp8"), ("device", "tpu"), ("attention_backend", "xformers"), ("load_format", "pt"),
    ("seed", -1), ("seed", 2**32), ("seed", None),
    ("enable_prefix_caching", None),
    ("scheduling_policy", "fifo"),
    ("static_batch_size", 0),
    ("num_threads", 0),
    ("revision", ""), ("revision", 3), ("download_dir", ""),
    ("enforce_eager", "yes"), ("dequantize", 1),
    ("cpu_weight_dtype", "fp8"),
    ("kv_cache_dtype", "fp8"), ("kv_cache_dtype", 16),
]  # fmt: skip


def test_every_engine_option_but_the_model_is_validated() -> None:
    # the model is checked where it is found (a missing model is a ValueError of the loader)
    names = {f for f in EngineConfig.__dataclass_fields__ if f != "model"}
    assert {name for name, _ in BAD_ENGINE_CONFIG} == names


@pytest.mark.parametrize(("name", "value"), BAD_ENGINE_CONFIG)
def test_invalid_engine_config_raises_value_error_naming_the_field(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{name}: "):
        EngineConfig(**{name: value})


def test_a_missing_model_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not found"):
        Engine(EngineConfig(model="/no/such/model", device="cpu", num_threads=1))


# ---- bad input -----------------------------------------------------------------------


def test_bad_prompts_get_an_error_and_do_not_disturb_the_others(
    model_dir: Path, engine: Engine
) -> None:
    engine = make_engine(
        model_dir,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=NUM_BLOCKS * engine.kv_bytes_per_block,
    )
    assert engine.num_blocks == NUM_BLOCKS
    good = [PROMPT, "hello, world"]
    expected = [greedy(engine, p, max_tokens=8).output_token_ids for p in good]
    cases: list[tuple[Any, SamplingParams, str]] = [
        ([], GREEDY, r"^prompt: is empty$"),
        ("", GREEDY, r"^prompt: is empty$"),
        (
            list(range(5, 70)),
            GREEDY,
            r"^prompt: 65 tokens is longer than the 64 this engine allows",
        ),
        (
            list(range(5, 45)),
            GREEDY.replace(max_tokens=30),
            r"^max_tokens: prompt \(40 tokens\) \+ max_tokens \(30\) exceeds max_model_len \(64\)",
        ),
        (
            list(range(5, 25)),
            GREEDY.replace(max_tokens=20),
            r"^max_tokens: prompt \+ max_tokens needs 10 KV blocks, the cache has 8",
        ),
        ([5, 256, 7], GREEDY, r"^prompt: token id 256 is outside the vocabulary \[0, 256\)"),
        ([5, -1], GREEDY, r"^prompt: token id -1 is outside the vocabulary"),
        ([5, 6.0], GREEDY, r"^prompt: token id 6.0 is outside the vocabulary"),
    ]
    prompts = [good[0], *[c[0] for c in cases[:4]], good[1], *[c[0] for c in cases[4:]]]
    params = [
        GREEDY.replace(max_tokens=8),
        *[c[1] for c in cases[:4]],
        GREEDY.replace(max_tokens=8),
        *[c[1] for c in cases[4:]],
    ]
    outs = LLM(engine=engine).generate(prompts, params)
    assert len(outs) == len(prompts)
    good_outs = [outs[0], outs[5]]
    bad_outs = outs[1:5] + outs[6:]
    assert [o.output_token_ids for o in good_outs] == expected
    assert all(o.finish_reason == "length" and o.error is None for o in good_outs)
    for out, (_, _, pattern) in zip(bad_outs, cases, strict=True):
        assert out.finish_reason == "error" and out.output_token_ids == [] and out.text == ""
        assert out.error is not None
        assert re.match(pattern, out.error), out.error
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_add_request_rejects_without_changing_the_engine(engine: Engine) -> None:
    engine.add_request("kept", PROMPT, GREEDY.replace(max_tokens=2))
    before = (
        engine.num_unfinished_requests,
        set(engine.scheduler.requests),
        set(engine.runner.infos),
    )
    with pytest.raises(ValueError, match=r"^prompt: is empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("kept", PROMPT, GREEDY)
    assert (
        engine.num_unfinished_requests,
        set(engine.scheduler.requests),
        set(engine.runner.infos),
    ) == before
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step().finished
    assert [(o.request_id, o.finish_reason, len(o.output_token_ids)) for o in finished] == [
        ("kept", "length", 2)
    ]


def test_logit_control_token_ids_must_be_in_the_vocabulary(
    engine: Engine, tiny_model_dir: Callable[[str], Path]
) -> None:
    cases = [
        ({"logit_bias": {"5": 1, str(VOCAB): 2}}, rf"^logit_bias: token id {VOCAB} is outside"),
        ({"allowed_token_ids": [3, VOCAB + 7]}, rf"^allowed_token_ids: token id {VOCAB + 7} "),
        ({"bad_words": [" \t"]}, r"^bad_words: must be a list of non-blank strings"),
    ]
    for controls, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", PROMPT, GREEDY.replace(**controls))
    assert "r" not in engine.scheduler.requests
    engine.validate_request(PROMPT, GREEDY.replace(logit_bias={VOCAB - 1: 1.0}, bad_words=["ab"]))
    no_tokenizer = make_engine(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match=r"^bad_words: this model has no tokenizer"):
        no_tokenizer.validate_request(PROMPT, GREEDY.replace(bad_words=["ab"]))


def test_generate_checks_the_number_of_sampling_params(engine: Engine) -> None:
    with pytest.raises(ValueError, match=r"^sampling_params: 1 given for 2 prompts"):
        LLM(engine=engine).generate([PROMPT, PROMPT], [GREEDY])


# ---- stop strings, stop token ids ------------------------------------------------------


def test_stop_strings_end_generation_and_are_left_out_of_the_text(engine: Engine) -> None:
    free = greedy(engine, PROMPT)
    tokens, text = free.output_token_ids, free.text

    def decode(ids: list[int]) -> str:
        return str(engine.tokenizer.decode(ids, skip_special_tokens=True))

    assert text == decode(tokens) and len(tokens) == 16
    # a stop string spanning the 5th and 6th tokens' text: generation stops at the first token
    # whose text completes it, wherever it first occurs
    stop = decode(tokens[4:6])
    assert len(stop) >= 2
    cut = text.index(stop)
    n = next(i for i in range(1, 17) if stop in decode(tokens[:i]))
    out = greedy(engine, PROMPT, stop=[stop])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.output_token_ids == tokens[:n]
    assert out.text == text[:cut] and stop not in out.text
    # of two stop strings, the one that appears first in the text wins
    late = decode(tokens[10:12])
    if late not in text[: cut + len(stop)]:
        out2 = greedy(engine, PROMPT, stop=[late, stop])
        assert (out2.stop_reason, out2.text) == (stop, text[:cut])
    # a stop string that never appears changes nothing
    out3 = greedy(engine, PROMPT, stop=["\x7f\x7f"])
    assert (out3.output_token_ids, out3.finish_reason, out3.stop_reason) == (tokens, "length", None)


def test_a_stop_string_completed_by_the_last_allowed_token_still_stops(engine: Engine) -> None:
    free = greedy(engine, PROMPT)
    stop = engine.tokenizer.decode(free.output_token_ids[4:6], skip_special_tokens=True)
    n = next(
        i
        for i in range(1, 17)
        if stop in engine.tokenizer.decode(free.output_token_ids[:i], skip_special_tokens=True)
    )
    out = greedy(engine, PROMPT, stop=[stop], max_tokens=n)
    assert (out.finish_reason, out.stop_reason, out.text) == (
        "stop",
        stop,
        free.text[: free.text.index(stop)],
    )


def test_stop_strings_wait_for_min_tokens(engine: Engine) -> None:
    free = greedy(engine, PROMPT)
    stop = engine.tokenizer.decode(free.output_token_ids[4:6], skip_special_tokens=True)
    out = greedy(engine, PROMPT, stop=[stop], min_tokens=8)
    assert len(out.output_token_ids) >= 8


def test_a_prompt_of_the_wrong_type_is_an_error_result(engine: Engine) -> None:
    outs = LLM(engine=engine).generate([None, PROMPT], GREEDY)  # type: ignore[list-item]
    assert (
        outs[0].finish_reason == "error"
        and outs[0].error is not None
        and outs[0].error.startswith("prompt:")
    )
    assert outs[1].finish_reason == "length"


def test_stop_token_ids_end_generation(engine: Engine) -> None:
    tokens = greedy(engine, PROMPT).output_token_ids
    stop_id = tokens[3]
    n = tokens.index(stop_id) + 1
    out = greedy(engine, PROMPT, stop_token_ids=[stop_id, 255])
    assert out.output_token_ids == tokens[:n]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


# ---- EOS, ignore_eos, min_tokens --------------------------------------------------------


class HFGreedy:
    """Greedy decoding in transformers, with stop ids held back for the first min_tokens
    tokens and ending generation after that: the reference for EOS and min_tokens."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def __call__(
        self, prompt: list[int], stop_ids: set[int], min_tokens: int, max_tokens: int = 16
    ) -> list[int]:
        ids, out = list(prompt), []
        with torch.no_grad():
            while len(out) < max_tokens:
                logits = self.model(torch.tensor([ids])).logits[0, -1]
                if len(out) < min_tokens:
                    logits[sorted(stop_ids)] = -math.inf
                token = int(logits.argmax())
                ids.append(token)
                out.append(token)
                if token in stop_ids and len(out) > min_tokens:
                    break
        return out


def test_eos_ignore_eos_and_min_tokens(engine: Engine, tmp_path: Path) -> None:
    tokens = greedy(engine, PROMPT).output_token_ids
    assert greedy(engine, PROMPT, ignore_eos=False).output_token_ids == tokens  # no EOS (2) in it
    hf = HFGreedy(Path(engine.source.path))
    assert hf(PROMPT, set(), 0) == tokens
    # EOS: a token greedy decoding emits at position i; min_tokens = i + 1 holds it back there,
    # and generation must then run on until greedy decoding emits it again
    eos, min_tokens, want = next(
        (t, tokens.index(t) + 1, ref)
        for t in dict.fromkeys(tokens)
        if t >= 4 and (ref := hf(PROMPT, {t}, tokens.index(t) + 1))[-1] == t
    )
    assert eos not in want[:min_tokens] and len(want) > min_tokens
    # the same model with a tokenizer whose EOS is that token
    folder = tmp_path / "eos"
    shutil.copytree(engine.source.path, folder)
    write_char_tokenizer(folder, eos_token=engine.tokenizer.convert_ids_to_tokens(eos))
    eos_engine = make_engine(folder)
    assert eos_engine.eos_token_id == eos
    stops = greedy(eos_engine, PROMPT, ignore_eos=False)
    assert (stops.output_token_ids, stops.finish_reason, stops.stop_reason) == (
        tokens[:min_tokens],
        "stop",
        None,
    )
    # ignore_eos: generation goes on past EOS, which is not masked
    assert greedy(eos_engine, PROMPT, ignore_eos=True).output_token_ids == tokens
    held = greedy(eos_engine, PROMPT, ignore_eos=False, min_tokens=min_tokens)
    assert (held.output_token_ids, held.finish_reason) == (want, "stop")
    # stop token ids are held back the same way (and so is the engine's own EOS, id 2)
    assert hf(PROMPT, {eos, 2}, min_tokens) == want
    same = greedy(engine, PROMPT, ignore_eos=False, stop_token_ids=[eos], min_tokens=min_tokens)
    assert (same.output_token_ids, same.finish_reason, same.stop_reason) == (want, "stop", eos)


def test_a_cpu_kv_cache_larger_than_the_machine_is_refused(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    """The CPU cache is mapped lazily, so an impossible size must fail at start-up, not when
    its blocks fill up mid-run."""
    import psutil

    too_big = 2 * psutil.virtual_memory().total
    with pytest.raises(ValueError, match=r"^kv_cache_memory: .* GiB is more than this machine's"):
        Engine(
            EngineConfig(
                model=str(tiny_model_dir("llama")),
                device="cpu",
                dtype="float32",
                kv_cache_memory=too_big,
                num_threads=1,
            )
        )

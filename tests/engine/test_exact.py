"""Greedy output is token-for-token equal to transformers' generate on the same weights, under
default settings, chunked prefill (>= 3 chunks per prompt), preemption, and one slot; and for
prompts long enough to go through the C prefill kernel, whole and in chunks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import tiny_engine
from helpers.reference import NEW_TOKENS, hf_greedy, run_cbgen, settings

from cbgen.engine.engine import Engine
from cbgen.llm import LLM
from cbgen.sampling_params import SamplingParams

SMOLLM2_PROMPTS: list[Any] = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    [{"role": "user", "content": "What is continuous batching in LLM inference?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left the valley. Every morning he",
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers."},
        {"role": "assistant", "content": "2, 3, 5."},
        {"role": "user", "content": "Three more, larger than 100, please."},
    ],
    "1, 2, 3, 4, 5,",
    [
        {
            "role": "user",
            "content": "Explain why the sky is blue to a ten year old, in detail, "
            "covering sunlight, the atmosphere, scattering, and why sunsets are red.",
        }
    ],
]


@pytest.fixture(scope="module")
def smollm2_case(
    smollm2_engine: Engine, smollm2_hf: Any
) -> tuple[Engine, list[list[int]], list[list[int]]]:
    prompts = [
        smollm2_engine.apply_chat_template(p) if isinstance(p, list) else smollm2_engine.tokenize(p)
        for p in SMOLLM2_PROMPTS
    ]
    assert len({len(p) for p in prompts}) == len(prompts)  # all lengths differ
    expected = [hf_greedy(smollm2_hf, p, NEW_TOKENS) for p in prompts]
    return smollm2_engine, prompts, expected


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
@pytest.mark.parametrize("setting", ["default", "chunked", "preempt", "one_slot"])
def test_smollm2_greedy_matches_transformers(smollm2_case: Any, setting: str) -> None:
    engine, prompts, expected = smollm2_case
    overrides = settings([len(p) for p in prompts], engine)[setting]
    got, preemptions = run_cbgen(engine, overrides, prompts)
    if setting == "chunked":
        assert overrides["max_num_batched_tokens"] * 3 <= min(len(p) for p in prompts)
    if setting == "preempt":
        assert preemptions > 0
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, (
            f"prompt {i}: first difference at token {next(j for j in range(len(e)) if g[j] != e[j])}"
        )


LONG_TEXT = (
    "The lighthouse at the northern tip of the island was built in 1854, after three ships were "
    "lost on the reef in a single winter. Its first keeper, a former sailor named Thomas Hale, "
    "kept a logbook in which he recorded the weather every four hours, the ships that passed, and "
    "the small events of a life spent far from any town: the arrival of supply boats, the birth "
    "of a goat, the week the fog did not lift and he rang the bell by hand for six days and six "
    "nights. The lamp burned whale oil at first, then colza oil, then kerosene, and each change "
    "brought new instructions from the lighthouse board, which Hale copied carefully into the back "
    "of his log. He trimmed the wicks at dusk and at midnight, polished the great lens every "
    "morning, and painted the iron gallery every spring, because the salt air ate through any "
    "paint in less than a year. His wife taught their four children to read from the only books "
    "on the island, a Bible, an almanac and a book of navigation tables, and the eldest daughter "
    "later became the first woman to keep a light on that coast. When the station was automated "
    "in 1961, the last keeper found the old logbooks in a cupboard under the stairs, tied with "
    "tarred string, and sent them to the museum in the harbour town, where they can still be read. "
    "Historians have used them to reconstruct the storms of the nineteenth century, the routes "
    "of the coastal traders, and the slow changes in the birds that nested on the cliffs. "
)


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_long_prompts_through_the_prefill_kernel_match_transformers(
    smollm2_engine: Engine, smollm2_hf: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts long enough for the C prefill kernel (whole, and in chunks after cached
    context), greedy, against transformers."""
    from cbgen.cpu import build, kernels, thresholds

    if build.load_library() is None:
        pytest.skip(f"no prefill kernel: {build.native_status()}")
    calls = {"with context": 0, "without": 0}
    kernel = kernels.prefill_attention_f32

    def counting(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *rest: Any) -> Any:
        calls["with context" if key.shape[0] > query.shape[0] else "without"] += 1
        return kernel(query, key, value, *rest)

    monkeypatch.setattr(kernels, "prefill_attention_f32", counting)
    # every long chunk to the kernel, whatever this build's threshold
    monkeypatch.setattr(thresholds, "prefill_split", lambda: (8192, True))
    engine = smollm2_engine
    prompts = [
        engine.tokenize(LONG_TEXT + "In the logbook, Hale wrote that"),
        engine.apply_chat_template(
            [{"role": "user", "content": LONG_TEXT + "Summarise this in one sentence."}]
        ),
    ]
    assert min(len(p) for p in prompts) > 300
    expected = [hf_greedy(smollm2_hf, p, 16) for p in prompts]
    runtime = engine.runtime  # shared by the engines below
    decoder = getattr(runtime, "decoder", None)
    in_c_call = 0
    for overrides in ({}, {"max_num_batched_tokens": 128}):
        for one_call in (False, True):  # the Python forward (counted here), the one C call
            if one_call and decoder is None:
                continue
            new = Engine(engine.config.replace(**overrides), share_weights_with=engine)
            before = decoder.prompt_calls if decoder is not None else 0
            runtime.decoder = decoder if one_call else None  # type: ignore[attr-defined]
            try:
                outs = LLM(engine=new).generate(
                    prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
                )
            finally:
                runtime.decoder = decoder  # type: ignore[attr-defined]
            assert [o.output_token_ids for o in outs] == expected, (overrides, one_call)
            if one_call:
                in_c_call += decoder.prompt_calls - before
    assert calls["without"] > 0 and calls["with context"] > 0
    assert decoder is None or in_c_call > 0  # prompt chunks inside the one C call


TINY_PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13],
    [100, 3, 77, 42, 42, 9, 250, 17, 33, 61, 12, 8, 190, 4, 4, 4, 61, 99, 23, 14, 15],
    [
        30,
        31,
        32,
        33,
        34,
        35,
        36,
        37,
        38,
        39,
        40,
        41,
        42,
        43,
        44,
        45,
        46,
        47,
        48,
        49,
        50,
        51,
        52,
        53,
        54,
        55,
        56,
        57,
        58,
        59,
        60,
        61,
        62,
        63,
        64,
        65,
        66,
    ],
    [200, 201, 202, 13, 17, 19, 23, 29, 31, 37, 41, 43],
    [
        9,
        8,
        7,
        6,
        5,
        4,
        3,
        9,
        8,
        7,
        6,
        5,
        4,
        3,
        9,
        8,
        7,
        6,
        5,
        4,
        3,
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
        9,
        10,
        11,
        12,
        13,
        14,
        15,
        16,
        17,
        18,
        19,
        20,
        21,
        22,
        23,
        24,
        25,
        26,
        27,
        28,
        29,
        30,
        31,
        32,
        33,
        34,
    ],
]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tiny_models_greedy_match_transformers(
    kind: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(kind)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in TINY_PROMPTS]
    base = tiny_engine(folder)
    for name, overrides in settings([len(p) for p in TINY_PROMPTS], base).items():
        got, preemptions = run_cbgen(base, overrides, TINY_PROMPTS)
        if name == "preempt":
            assert preemptions > 0
        assert got == expected, f"{kind} under {name}"

"""A request's output does not depend on the other requests in its steps: the same prompts
give the same tokens and the same logprobs, bit for bit, whether they run all at once, one at
a time, a few slots at a time (each new prompt joining running decodes), under a small token
budget (prompts cut into chunks wherever it falls), or after other requests left their prompts'
blocks in the prefix cache. That is what lets `cbgen run --ray` with several engines give the
rows of one engine (tests/ray_cluster), and a rerun the rows of the first run.

Heads of 64, so prompt chunks take the prefill kernel (in the one-call decoder too), as
SmolLM2's do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.models import make_tiny_hf_model, tiny_engine

from cbgen.cpu import build
from cbgen.llm import LLM
from cbgen.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(build.load_library() is None, reason=build.native_status())

SYSTEM = list(range(40, 61))  # a shared prefix of 21 tokens: a cached block and a partial one
PROMPTS = [
    [*SYSTEM, 7, 8, 9],
    SYSTEM + list(range(60, 250)),  # cut into chunks by a small budget, whole otherwise
    [5, 6],
    SYSTEM + [200] * 33,
    list(range(1, 97)),
    [*SYSTEM, 3],
]


def _run(engine: Any, order: list[int]) -> dict[int, tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = LLM(engine=engine).generate([PROMPTS[i] for i in order], params)
    got = {}
    for i, o in zip(order, outs, strict=True):
        assert o.logprobs is not None
        got[i] = (o.output_token_ids, [lp.logprob for lp in o.logprobs])
    return got


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny-64"), head_dim=64)


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_seqs": 2},
        {"max_num_batched_tokens": 13},
        {"max_num_seqs": 3, "max_num_batched_tokens": 17, "enable_prefix_caching": False},
    ],
    ids=["two-slots", "small-budget", "three-slots-no-cache"],
)
def test_a_requests_tokens_and_logprobs_do_not_depend_on_its_neighbours(
    folder: Path, options: dict[str, Any]
) -> None:
    alone = {}
    engine = tiny_engine(folder, enable_prefix_caching=False)
    for i in range(len(PROMPTS)):
        alone.update(_run(engine, [i]))
    together = _run(tiny_engine(folder), list(range(len(PROMPTS))))
    assert together == alone
    other = tiny_engine(folder, **options)
    _run(other, [3, 5])  # their blocks cached (where the engine caches) before the rest arrive
    assert _run(other, [5, 1, 4, 0, 2, 3]) == alone

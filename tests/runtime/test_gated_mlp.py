"""The MLP's gate-up matmul and its activation in one pass (the CPU linear method's apply_gated):
taken by the Python forward's steps whose rows go to small_gemm's row blocks (the one-call decoder's steps
keep their own order of kernels), with the tokens of the two-step path, on the default build and
on the AVX2 one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.models import tiny_engine

from cbgen.cpu import build, gemm
from cbgen.llm import LLM
from cbgen.runtime.cpu import CpuRuntime
from cbgen.runtime.cpu_linear import PackedF32Linear
from cbgen.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(build.load_library() is None, reason=build.native_status())

PROMPTS = [list(range(30, 150)), [7, 9] * 60, list(range(200, 300))]

STEP_ROWS = 128
"""max_num_batched_tokens of the engines: prompt steps of up to 128 rows, decode steps of 3."""

BLOCKS_FROM = 32
"""Where the test starts small_gemm's row blocks: under the prompt steps, over the decode steps,
whatever the build's default (96 rows with AVX2, 256 with AVX-512) or a tuning pass would say."""


def _tokens(engine: Any) -> list[list[int]]:
    """Greedy tokens of PROMPTS through the Python forward, the row thresholds forced (small_gemm
    for every step, its blocks from BLOCKS_FROM rows) on the engine's own runtime."""
    runtime = engine.runtime
    assert isinstance(runtime, CpuRuntime)
    runtime.decoder = None
    runtime.thresholds.small_gemm_max_rows = STEP_ROWS
    runtime.thresholds.blocked_rows = BLOCKS_FROM
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.output_token_ids for o in LLM(engine=engine).generate(PROMPTS, sampling)]


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_prompt_steps_take_the_one_pass_mlp_with_the_same_tokens(
    kind: str, tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt steps take the one-pass MLP, with the tokens of small_gemm then the
    activation."""
    served: list[int] = []
    inner = gemm.small_gemm_gated

    def counted(x: Any, panels: Any, activation: str, blocked_from: int = 0) -> Any:
        got = inner(x, panels, activation, blocked_from)
        if got is not None:
            served.append(x.shape[0])
        return got

    monkeypatch.setattr(gemm, "small_gemm_gated", counted)
    engine = tiny_engine(tiny_model_dir(kind), max_num_batched_tokens=STEP_ROWS)
    got = _tokens(engine)
    assert served and min(served) >= BLOCKS_FROM and max(served) <= STEP_ROWS
    monkeypatch.setattr(PackedF32Linear, "apply_gated", lambda self, x, activation: None)
    plain = tiny_engine(tiny_model_dir(kind), max_num_batched_tokens=STEP_ROWS)
    assert _tokens(plain) == got

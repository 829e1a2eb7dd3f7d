"""The forward pass computes the last layer's output projection and MLP for the rows the LM head
reads only: those rows' hidden states are the full pass's, every family, and the steps that
score prompts still get every row."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import tiny_engine

from cbgen.llm import LLM
from cbgen.runtime.cpu import CpuRuntime
from cbgen.sampling_params import SamplingParams

PROMPTS = [list(range(30, 70)), [1, 5, 9, 200, 17], [7] * 19, [100, 3, 77, 42, 42, 9, 250, 17]]


class Pruned:
    """Stands in for model.forward_layers: each call is run again over every row (writing the
    same K/V again), and the rows asked for must be the full pass's rows: bit for bit, except
    where experts run their rows as batches of their own (a row's sum may then be blocked
    otherwise by torch)."""

    def __init__(self, model: Any, exact: bool = True) -> None:
        self.inner = model.forward_layers
        self.exact = exact
        self.asked: list[tuple[int, int]] = []  # (rows asked, rows in the step)
        model.forward_layers = self

    def __call__(self, input_ids: Any, positions: Any, kv_caches: Any, meta: Any, backend: Any,
                 rows: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        got = self.inner(input_ids, positions, kv_caches, meta, backend, rows)
        if rows is None:
            self.asked.append((len(input_ids), len(input_ids)))
            return got
        full = self.inner(input_ids, positions, kv_caches, meta, backend)
        assert got.shape == (len(rows), full.shape[1])
        if self.exact:
            assert torch.equal(got, full[rows]), (got - full[rows]).abs().max()
        else:
            torch.testing.assert_close(got, full[rows], rtol=1e-5, atol=1e-5)
        self.asked.append((len(rows), len(input_ids)))
        return got


def _generate(engine: Any, prompts: list[list[int]], **params: Any) -> list[Any]:
    sampling = SamplingParams(**{"temperature": 0, "max_tokens": 6, "ignore_eos": True, **params})
    return LLM(engine=engine).generate(prompts, sampling)


def python_forward(engine: Any) -> None:
    """Every step through the model's Python forward (not the runtime's one-call decoder)."""
    runtime = engine.runtime
    assert isinstance(runtime, CpuRuntime)
    runtime.decoder = None


@pytest.mark.parametrize(
    "kind", ["llama", "qwen3", "phi3", "phi4_mini", "gemma2", "gemma3", "mixtral", "qwen3_moe"]
)
def test_the_rows_the_head_reads_are_the_full_passes(
    kind: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    """Steps of prompt chunks only (no row sampled), chunks that end a prompt beside decodes,
    and decode-only steps (every row asked: the model is given no rows)."""
    engine = tiny_engine(tiny_model_dir(kind), max_num_batched_tokens=16)
    model = engine.runner.model
    python_forward(engine)
    pruned = Pruned(model, exact=kind not in ("mixtral", "qwen3_moe"))
    outputs = _generate(engine, PROMPTS)
    assert all(len(o.output_token_ids) == 6 for o in outputs)
    assert (0, 16) in pruned.asked  # the 40-token prompt's first chunk samples nothing
    assert any(0 < asked < rows for asked, rows in pruned.asked)
    assert any(asked == rows for asked, rows in pruned.asked)
    # the tokens of a pass that computes every row and hands the head its rows
    plain = tiny_engine(tiny_model_dir(kind), max_num_batched_tokens=16)
    full_model = plain.runner.model
    python_forward(plain)
    every_row = full_model.forward_layers

    def unpruned(input_ids: Any, positions: Any, kv_caches: Any, meta: Any, backend: Any,
                 rows: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        hidden = every_row(input_ids, positions, kv_caches, meta, backend)
        return hidden if rows is None else hidden[rows]

    full_model.forward_layers = unpruned
    want = [o.output_token_ids for o in _generate(plain, PROMPTS)]
    assert [o.output_token_ids for o in outputs] == want


def test_prompt_logprobs_get_every_row(tiny_model_dir: Callable[[str], Path]) -> None:
    engine = tiny_engine(tiny_model_dir("llama"), max_num_batched_tokens=16)
    model = engine.runner.model
    python_forward(engine)
    pruned = Pruned(model)
    (out,) = _generate(engine, PROMPTS[:1], prompt_logprobs=1)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPTS[0])
    prompt_steps = [(a, r) for a, r in pruned.asked if r > 1]
    assert prompt_steps and all(a == r for a, r in prompt_steps)

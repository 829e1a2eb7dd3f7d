"""The exact greedy head: bfloat16 logits with a proven error bound, float32 recomputes of the
tokens that could still win. It must pick the argmax of the float32 head every time."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cbgen.attention import native
from cbgen.models.llama import GreedyHead, bf16_matmul_fast, onednn_packing_available

pytestmark = pytest.mark.skipif(
    native.load_library() is None or not onednn_packing_available(), reason="no C compiler or oneDNN"
)


def exact_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (hidden.double() @ weight.double().T).argmax(-1)


def test_picks_the_exact_argmax_even_where_bfloat16_cannot_tell_the_tokens_apart() -> None:
    torch.manual_seed(0)
    vocab, dim, rows = 5000, 96, 64
    weight = torch.randn(vocab, dim) * 0.05
    hidden = torch.randn(rows, dim) * 3
    # near-ties: for each row, copies of its best token moved by noise far above a bf16 ulp
    # but orthogonal to the row's hidden state, plus a float32-visible nudge along it (some
    # up, some down): bf16 orders these tokens at random, only the recompute gets them right
    best = exact_argmax(hidden, weight)
    for r in range(0, rows, 2):
        h = hidden[r] / hidden[r].norm()
        for j, sign in enumerate((1.0, -1.0, 1.0)):
            target = (17 * r + 5 * j) % vocab
            noise = torch.randn(dim) * 2e-3
            noise -= (noise @ h) * h
            weight[target] = weight[best[r]] + noise + sign * (j + 1) * 1e-4 * h / hidden[r].norm()
    head = GreedyHead(weight)
    got = head(hidden)
    assert got is not None
    want = exact_argmax(hidden, weight)
    assert torch.equal(got, want)
    assert torch.equal(got, (hidden @ weight.T).argmax(-1))
    assert 1 <= head.last_candidates < vocab // 10  # the bound is tight enough to pay


def test_ties_go_to_the_first_token_as_in_argmax() -> None:
    torch.manual_seed(1)
    weight = torch.randn(300, 32)
    weight[200] = weight[7] = weight[100] * 4  # three identical, largest rows
    hidden = weight[100:101].clone()
    got = GreedyHead(weight)(hidden)
    assert got is not None and got.tolist() == [7]


def test_a_non_finite_logit_hands_back_to_the_float32_path() -> None:
    weight = torch.randn(64, 16)
    hidden = torch.randn(2, 16)
    hidden[1, 3] = float("inf")
    assert GreedyHead(weight)(hidden) is None


@pytest.mark.skipif(not bf16_matmul_fast(), reason="bf16 matmuls are emulated on this CPU")
def test_engine_greedy_steps_take_the_head_and_keep_the_tokens(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy rows go through the head; a penalty, a min_tokens hold or a sampled row in the
    batch sends the whole step to the logits path. Same tokens as with no head at all."""
    from cbgen.config import SamplingParams
    from cbgen.engine.engine import Engine

    def run(with_head: bool) -> tuple[dict[str, list[int]], int]:
        engine = Engine(model=str(tiny_model_dir("llama")), device="cpu", dtype="float32", kv_cache_memory=8 << 20)
        model = engine.runner.model
        assert model.greedy_head is not None
        if not with_head:
            model.greedy_head = None
        calls = 0
        inner = model.greedy_tokens

        def counted(hidden: torch.Tensor) -> torch.Tensor | None:
            nonlocal calls
            calls += 1
            return inner(hidden)

        monkeypatch.setattr(model, "greedy_tokens", counted)
        plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"g{i}", [5 + i, 9, 30, 41][: 2 + i], plain)
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step().finished:
                out[o.request_id] = o.output_token_ids
        greedy_calls = calls
        engine.add_request("pen", [5, 9], plain.replace(repetition_penalty=1.3))
        engine.add_request("g9", [7, 8, 9], plain)
        while engine.has_unfinished_requests():
            for o in engine.step().finished:
                out[o.request_id] = o.output_token_ids
        assert calls == greedy_calls  # the penalised row kept every step on the logits path
        return out, greedy_calls

    with_head, calls = run(True)
    without, _ = run(False)
    assert calls >= 12
    assert with_head == without

"""The exact LM heads: cheap logits (bfloat16 through oneDNN, int16 through the C kernel) with a
proven error bound, float32 recomputes of a few tokens. Greedy rows must get the argmax of the
float32 head every time; sampled rows a draw from the float32 softmax (by rejection), depending
only on the row and its seed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from cbgen.cpu import build, head_kernels
from cbgen.cpu.linear import Bf16Head, ExactHead, Int16Head, bf16_matmul_supported

pytestmark = pytest.mark.skipif(build.load_library() is None, reason=build.native_status())

HEADS = [
    pytest.param(
        Bf16Head,
        marks=pytest.mark.skipif(not bf16_matmul_supported(), reason="no oneDNN bf16"),
        id="bf16",
    ),
    pytest.param(
        Int16Head,
        marks=pytest.mark.skipif(
            build.load_library() is not None and not head_kernels.head_i16_available(),
            reason="no int16 head in this build (x86-64 with AVX2)",
        ),
        id="int16",
    ),
]


@pytest.fixture(params=HEADS)
def make_head(request: pytest.FixtureRequest) -> type[ExactHead]:
    cls: type[ExactHead] = request.param
    return cls


def exact_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (hidden.double() @ weight.double().T).argmax(-1)


def greedy(head: ExactHead, hidden: torch.Tensor) -> torch.Tensor:
    m = hidden.shape[0]
    return head(hidden, torch.zeros(m), torch.zeros(m, dtype=torch.int64))


def test_picks_the_exact_argmax_even_where_the_cheap_logits_cannot_tell_the_tokens_apart(
    make_head: type[ExactHead],
) -> None:
    torch.manual_seed(0)
    vocab, dim, rows = 5000, 96, 64
    weight = torch.randn(vocab, dim) * 0.05
    hidden = torch.randn(rows, dim) * 3
    # near-ties: for each row, copies of its best token moved by noise far above a bf16 ulp
    # and an int16 step but orthogonal to the row's hidden state, plus a float32-visible nudge
    # along it (some up, some down): the cheap logits order these tokens at random, only the
    # recompute gets them right
    best = exact_argmax(hidden, weight)
    for r in range(0, rows, 2):
        h = hidden[r] / hidden[r].norm()
        for j, sign in enumerate((1.0, -1.0, 1.0)):
            target = (17 * r + 5 * j) % vocab
            noise = torch.randn(dim) * 2e-3
            noise -= (noise @ h) * h
            weight[target] = weight[best[r]] + noise + sign * (j + 1) * 1e-4 * h / hidden[r].norm()
    head = make_head(weight)
    got = greedy(head, hidden)
    want = exact_argmax(hidden, weight)
    assert torch.equal(got, want)
    assert torch.equal(got, (hidden @ weight.T).argmax(-1))
    assert 1 <= head.last_candidates < vocab // 10  # the bound is tight enough to pay


def test_ties_go_to_the_first_token_as_in_argmax(make_head: type[ExactHead]) -> None:
    torch.manual_seed(1)
    weight = torch.randn(300, 32)
    weight[200] = weight[7] = weight[100] * 4  # three identical, largest rows
    hidden = weight[100:101].clone()
    assert greedy(make_head(weight), hidden).tolist() == [7]


def skewed_head(
    make_head: type[ExactHead], vocab: int = 40, dim: int = 64
) -> tuple[ExactHead, torch.Tensor, torch.Tensor]:
    """A head whose logits for one hidden state h are evenly spread over [0, 2], every other
    token's weight carrying a large component orthogonal to h: its logit is unchanged but its
    error bound is ~20x the others'. A proposal from the bounds alone (no rejection step) would
    favour those tokens by up to exp(bound / T)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(dim, generator=g)
    h *= 30 / h.norm()
    logits = torch.linspace(0, 2, vocab)
    ortho = torch.randn(vocab, dim, generator=g)
    ortho -= (ortho @ h)[:, None] * h / h.norm() ** 2
    ortho *= (torch.tensor([0.1, 10.0]).repeat(vocab // 2) / ortho.norm(dim=1))[:, None]
    weight = logits[:, None] * h / h.norm() ** 2 + ortho
    return make_head(weight), h, (h.double() @ weight.double().T)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_the_float32_softmax(make_head: type[ExactHead], temperature: float) -> None:
    """20,000 rows with their own seeds: the counts against softmax(exact logits / T), by a
    chi-square over the 40 tokens (39 degrees of freedom: above 80 has probability < 1e-4 if
    the draws are right; without the rejection step the statistic is in the thousands)."""
    head, h, exact = skewed_head(make_head)
    n = 20000
    seeds = torch.randint(0, 1 << 62, (n,), generator=torch.Generator().manual_seed(5))
    got = head(h.repeat(n, 1), torch.full((n,), temperature), seeds)
    assert (got >= 0).all()
    counts = np.bincount(got.numpy(), minlength=exact.numel())
    expected = n * torch.softmax(exact / temperature, 0).numpy()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 80, chi2


def test_a_row_draws_by_its_seed_alone_whatever_the_batch(make_head: type[ExactHead]) -> None:
    head, h, _ = skewed_head(make_head)
    others = torch.randn(12, h.numel(), generator=torch.Generator().manual_seed(2)) * 10
    seeds = torch.arange(100, 112)
    temp = torch.tensor([1.0, 0.0, 0.7] * 4)
    draws = []
    for seed in range(20):
        alone = head(h[None], torch.ones(1), torch.tensor([seed]))
        batch = torch.cat([others[:5], h[None], others[5:]])
        s = torch.cat([seeds[:5], torch.tensor([seed]), seeds[5:]])
        t = torch.cat([temp[:5], torch.ones(1), temp[5:]])
        inside = head(batch, t, s)
        assert inside[5] == alone[0]
        draws.append(int(alone[0]))
    assert len(set(draws)) > 3  # a real draw, not an argmax
    assert head(h[None], torch.ones(1), torch.tensor([7])) == head(
        h[None], torch.ones(1), torch.tensor([7])
    )


def test_greedy_and_sampled_rows_in_one_call(make_head: type[ExactHead]) -> None:
    torch.manual_seed(3)
    weight = torch.randn(3000, 48) * 0.1
    hidden = torch.randn(16, 48) * 5
    temp = torch.tensor([0.0, 1.0] * 8)
    got = make_head(weight)(hidden, temp, torch.arange(16))
    assert torch.equal(got[::2], exact_argmax(hidden[::2], weight))
    assert (got[1::2] >= 0).all()


def test_rows_it_cannot_answer_come_back_as_minus_one(make_head: type[ExactHead]) -> None:
    """A hidden state that is not finite, and a draw rejected MAX_ATTEMPTS times: -1 for that
    row only (the runner sends it through the float32 head)."""
    head, h, _ = skewed_head(make_head)
    hidden = h.repeat(3, 1)
    hidden[1, 3] = float("inf")
    got = head(hidden, torch.tensor([1.0, 1.0, 0.0]), torch.arange(3))
    assert got[1] == -1 and got[0] >= 0 and got[2] >= 0
    head.MAX_ATTEMPTS = 1  # a proposal for a high-bound token is almost always rejected
    got = head(h.repeat(400, 1), torch.full((400,), 0.25), torch.arange(400))
    assert 0 < int((got == -1).sum()) < 400


def test_engine_steps_take_the_head_and_keep_the_greedy_tokens(
    make_head: type[ExactHead],
    tiny_model_dir: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain greedy and plain sampled rows go through the exact head (each head given to the
    model here, whichever the loader would choose for this CPU); a penalised row, a top-p row
    and a low temperature take the float32 logits, the others still take the head. Greedy
    tokens are those of an engine without the head."""
    from cbgen.engine.engine import Engine
    from cbgen.sampling_params import SamplingParams

    def run(with_head: bool) -> tuple[dict[str, list[int]], list[int], int]:
        engine = Engine(
            model=str(tiny_model_dir("llama")),
            device="cpu",
            dtype="float32",
            kv_cache_memory=8 << 20,
        )
        model = engine.runner.model
        cls = make_head
        engine.runtime.exact_head = cls(model.head_weight.data) if with_head else None
        rows: list[int] = []
        logits_rows = 0
        inner_logits = model.compute_logits

        def counted_logits(hidden: torch.Tensor) -> torch.Tensor:
            nonlocal logits_rows
            logits_rows += hidden.shape[0]
            return inner_logits(hidden)

        monkeypatch.setattr(model, "compute_logits", counted_logits)
        if with_head:
            call = cls.__call__
            monkeypatch.setattr(
                cls, "__call__", lambda self, h, *a: rows.append(h.shape[0]) or call(self, h, *a)
            )
        plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"g{i}", [5 + i, 9, 30, 41][: 2 + i], plain)
        engine.add_request("pen", [5, 9], plain.replace(repetition_penalty=1.3))
        engine.add_request(
            "s", [7, 8, 9], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
        )
        engine.add_request(
            "top_p",
            [7, 8],
            SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True),
        )
        engine.add_request(
            "cold", [7, 8], SamplingParams(temperature=0.1, max_tokens=12, ignore_eos=True)
        )
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step().finished:
                out[o.request_id] = o.output_token_ids
        return out, rows, logits_rows

    with_head, head_rows, logits_rows = run(True)
    without, _, all_rows = run(False)
    assert sum(head_rows) == 4 * 12  # three greedy rows and the plain sampled one, every step
    assert logits_rows == 3 * 12 and all_rows == 7 * 12  # the penalised, top-p and cold rows
    assert {k: with_head[k] for k in ("g0", "g1", "g2", "pen")} == {
        k: without[k] for k in ("g0", "g1", "g2", "pen")
    }
    assert all(len(v) == 12 for v in with_head.values())


# ---- the int16 head's own: its integers never overflow, its packing pads ------------------

needs_int16 = pytest.mark.skipif(  # without the kernels, the module's mark says why
    build.load_library() is not None and not head_kernels.head_i16_available(),
    reason="no int16 head in this build (x86-64 with AVX2)",
)


@needs_int16
@pytest.mark.parametrize("dim", [4096, 20000])
def test_int16_sums_cannot_overflow_at_the_largest_magnitudes(dim: int) -> None:
    """Every hidden element and weight at its row's maximum, all of one sign: the worst case for
    the int32 sums (wrapped, token 0's logit would turn negative and lose). The hidden state's
    scale leaves |p|_1 W below 2^31 whatever the values."""
    weight = torch.full((40, dim), 0.01)
    weight[0] = 1.0  # the largest logit by far
    weight[1] = -1.0
    weight[5, : dim // 2] = 1.0  # second: half of token 0's logit
    hidden = torch.full((4, dim), 7.0)
    hidden[1] = 1e12  # large: the scale absorbs it
    hidden[2, 0] = 3e4  # one element far above the rest
    hidden[3] = 1e30  # logits near 2^100 and more: the float32 head takes the row (-1)
    head = Int16Head(weight)
    assert head.packed[3] * dim < 2**31  # W itself leaves room
    assert greedy(head, hidden).tolist() == [0, 0, 0, -1]
    assert head.last_candidates == 1


@needs_int16
@pytest.mark.parametrize(
    ("vocab", "dim", "rows"), [(1, 1, 1), (17, 3, 5), (1000, 97, 9), (333, 64, 64)]
)
def test_int16_head_pads_odd_sizes(vocab: int, dim: int, rows: int) -> None:
    """A vocabulary past a multiple of 16 (the padded tokens must never win, even when every
    real logit is negative), an odd hidden size and a row count past a multiple of 4."""
    gen = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, dim, generator=gen)
    hidden = torch.randn(rows, dim, generator=gen)
    hidden[0] = -weight.sum(0)  # pushes every logit of row 0 below zero
    head = Int16Head(weight)
    got = greedy(head, hidden)
    assert torch.equal(got, exact_argmax(hidden, weight))
    drawn = head(hidden, torch.ones(rows), torch.arange(rows))
    assert bool(((drawn >= 0) & (drawn < vocab)).all())


@needs_int16
def test_int16_head_refuses_inputs_that_do_not_match_its_packing() -> None:
    """The integer range is what keeps the int32 sums exact: a packing with another W, or one of
    another weight, is refused before C sees it."""
    gen = torch.Generator().manual_seed(6)
    weight, hidden = torch.randn(40, 24, generator=gen), torch.randn(3, 24, generator=gen)
    head = Int16Head(weight)
    q, scale, wres, levels = head.packed
    args = (head.weight, head.padded_norms, head.bound, torch.zeros(3), torch.zeros(3), 1)
    scratch = torch.empty(head_kernels.head_i16_scratch(3, 40))
    with pytest.raises(ValueError, match="levels"):
        head_kernels.head_i16(hidden, (q, scale, wres, levels * 2 + 1), *args, scratch)
    with pytest.raises(ValueError, match="not the packing"):
        head_kernels.head_i16(hidden, Int16Head(torch.randn(60, 24)).packed, *args, scratch)
    with pytest.raises(ValueError, match="scratch"):
        head_kernels.head_i16(hidden, head.packed, *args, scratch[:10])
    got, _ = head_kernels.head_i16(hidden, head.packed, *args, scratch)
    assert torch.equal(got, exact_argmax(hidden, weight))


@needs_int16
def test_int16_head_refuses_a_weight_that_is_not_finite() -> None:
    weight = torch.randn(20, 8)
    weight[3, 2] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        Int16Head(weight)


@needs_int16
def test_int16_residual_norms_bound_the_rounding() -> None:
    """r_v, the bound's weight term, is at least the real |s_v q_v - w_v| and not far above it."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(100, 50, generator=gen) * torch.logspace(-3, 2, 100)[:, None]
    q, scale, wres, levels = head_kernels.head_i16_pack(weight)
    ints = q.permute(0, 2, 1, 3).reshape(-1, q.shape[1] * 2)[:100, :50].double()
    assert float(ints.abs().max()) == levels
    residual = (ints * scale[:100, None].double() - weight.double()).norm(dim=1)
    assert bool((wres[:100].double() >= residual).all())
    assert bool((wres[:100].double() <= residual * (1 + 1e-5) + 1e-30).all())
    assert bool((wres[100:] == 0).all())

"""Batched sampling: grammar masks (structured outputs), logit_bias / allowed_token_ids /
bad_words, penalties, min_tokens, greedy, temperature / top-k / top-p / min-p.

One call per step for the requests that sample from float32 logits (on the CPU, plain greedy
and plain temperature rows take an exact LM head from bf16 or int16 logits instead, the
runtime's exact_head, and come here only if it hands them back). Each random row draws one
uniform number from its request's own generator and takes the token where the cumulative distribution passes
it (inverse CDF), so a seeded request gives the same tokens alone or
inside any batch, at the cost of one draw per row rather than one per vocabulary entry. Where the
runtime has a one-pass kernel for it (the CPU: cbgen.cpu.kernels.sample), rows without top-k /
top-p / min-p take that rule in one pass per row; the others take the torch ops. What is done to
the logits before a draw (controls, penalties, top-k / top-p / min-p) is
cbgen.engine.logit_processors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cbgen.engine.logit_processors import (
    apply_logit_controls,
    apply_penalties_rows,
    filter_logits,
    to_device,
)
from cbgen.engine.logprobs import PositionLogprobs
from cbgen.engine.structured import GrammarState, apply_grammar_masks
from cbgen.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    token_ids: Sequence[int]
    """Prompt + output so far."""
    prompt_len: int
    generator: torch.Generator | None
    """A host generator: the row's uniform number is drawn on the CPU whatever the logits' device."""
    stop_ids_for_min_tokens: Sequence[int]
    """EOS and stop token ids: masked while fewer than min_tokens exist."""
    bad_words_token_ids: Sequence[Sequence[int]] = ()
    """The token sequences of params.bad_words (see apply_logit_controls)."""
    grammar: GrammarState | None = None
    """The row's structured-outputs state (params.structured_outputs), if any."""
    seed: int = 0
    draws: int = 0
    """Device draws (Sampler(device_draws=True)): the request's seed (modulo 2^64) and how
    many numbers it has drawn before this one."""

    @property
    def constrained(self) -> bool:
        """Whether a grammar masks this row's next token."""
        return self.grammar is not None and self.grammar.active

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def plain_draw(self, vocab: int, min_temperature: float) -> bool:
        """The token is a draw from softmax(raw logits / T): sampled at T >= min_temperature,
        no penalty, no top-k / top-p / min-p mask, nothing held back."""
        p = self.params
        return (
            not p.greedy
            and p.temperature >= min_temperature
            and not p.has_penalties
            and not p.has_logit_controls
            and not self.constrained
            and not _filters(p, vocab)
            and not (self.num_output_tokens < p.min_tokens and self.stop_ids_for_min_tokens)
        )

    @property
    def plain_argmax(self) -> bool:
        """The token is the argmax of the raw logits: greedy, no penalty, no logit control,
        nothing held back."""
        p = self.params
        return (
            p.greedy
            and not p.has_penalties
            and not p.has_logit_controls
            and not self.constrained
            and not (self.num_output_tokens < p.min_tokens and self.stop_ids_for_min_tokens)
        )


def _filters(p: SamplingParams, vocab: int) -> bool:
    """Whether top-k, top-p or min-p can mask a token of this row."""
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def seed_int64(seed: int) -> int:
    """A request seed as the int64 whose bits are the seed modulo 2^64 (a device draw's key)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass(frozen=True)
class SamplingTensors:
    """The rows' sampling parameters already on the logits' device (the runner stages them
    with the step's inputs, cbgen.engine.step_inputs): row i is the sampler's row i."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = all
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seed: torch.Tensor | None = None  # [B] int64, device draws only (SamplingRow.seed)
    draws: torch.Tensor | None = None  # [B] int64, device draws only (SamplingRow.draws)

    def select(self, index: torch.Tensor) -> SamplingTensors:
        """The rows index (a tensor on the same device)."""
        return SamplingTensors(
            *(t[index] for t in (self.temperature, self.top_k, self.top_p, self.min_p)),
            *(None if t is None else t[index] for t in (self.seed, self.draws)),
        )


def _rows(sel: list[int], n: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The rows sel of each tensor (of n rows): the tensors themselves when sel is all of them."""
    return list(tensors) if len(sel) == n else [t[sel] for t in tensors]


def _sample_torch(
    ps: Sequence[SamplingParams],
    sub: torch.Tensor,
    temp: torch.Tensor,
    u: torch.Tensor,
    staged: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Divide by the temperature, apply the masks, then the first token whose cumulative
    weight exceeds u x total: never a zero-weight token (adding 0 leaves the sum exactly as it
    was), never past the last one. sub [B, V] is the sampler's own: modified in place.
    staged: the rows' (top_k, top_p, min_p) on the device (None: made from ps)."""
    vocab = sub.shape[-1]
    dev = sub.device
    sub = sub.div_(temp[:, None])
    top_k, top_p, min_p = staged or (
        torch.tensor([p.top_k for p in ps], device=dev),
        torch.tensor([p.top_p for p in ps], device=dev, dtype=sub.dtype),
        torch.tensor([p.min_p for p in ps], device=dev, dtype=sub.dtype),
    )
    sub = filter_logits(
        sub,
        top_k,
        top_p,
        min_p,
        # from the parameters, not the device (a row they flag that the tensors would not,
        # such as a top_p that rounds to 1.0 in float32, is left unmasked all the same)
        truncate=any(p.top_k > 0 or p.top_p < 1.0 for p in ps),
        floor=any(p.min_p > 0.0 for p in ps),
    )
    weights = sub.sub_(sub.amax(dim=-1, keepdim=True)).exp_()  # unnormalised softmax
    cdf = weights.cumsum(dim=-1)
    target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return picked.clamp_(max=vocab - 1)


def position_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[PositionLogprobs]:
    """Row i of logits [N, V] (raw: before temperature, penalties and masks): the float32
    log-softmax of token_ids[i] and the num_top[i] best entries, best first. One host read."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), device=lp.device)
    chosen = lp.gather(1, ids[:, None]).squeeze(1)
    k = min(max(num_top), lp.shape[-1])
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], ids[:, None][:, :0])
    # one float64 table [N, 1 + 2k]: float32 values and token ids are both exact in it
    parts = (chosen[:, None], top_lp, top_ids)
    table = torch.cat([t.double() for t in parts], dim=1).tolist()
    return [
        PositionLogprobs(t, row[0], [int(x) for x in row[1 + k : 1 + k + n]], row[1 : 1 + n])
        for t, n, row in zip(token_ids, [min(n, k) for n in num_top], table, strict=True)
    ]


class Sampler:
    def __init__(
        self,
        device_draws: bool = False,
        plain_sample: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]
        | None = None,
    ) -> None:
        """device_draws: each random row's uniform number comes from a counter-based generator
        on the logits' device (cbgen_kernels.uniform_draws of the row's seed and draw count)
        instead of its host generator: no per-step host draws or copies, and still the same
        numbers alone or in any batch. The CUDA path; needs triton (or its interpreter).
        plain_sample: a one-pass kernel for the rows without top-k / top-p / min-p, (logits,
        temperature, u) -> token ids or None (the CPU runtime's cbgen.cpu.kernels.sample)."""
        self.device_draws = device_draws
        self.plain_sample = plain_sample

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        staged: SamplingTensors | None = None,
    ) -> list[int]:
        """logits [B, V] for the B requests in rows; returns one token id per row. staged:
        the rows' parameters on the device already (None: made from their params)."""
        logits = logits.float()
        vocab = logits.shape[-1]
        constrained = [i for i, row in enumerate(rows) if row.constrained]
        if constrained:  # structured outputs: only the grammar's next tokens stay
            states = [g for i in constrained if (g := rows[i].grammar) is not None]
            apply_grammar_masks(logits, constrained, states)
        for i, row in enumerate(rows):
            if row.params.has_logit_controls:
                apply_logit_controls(
                    logits[i], row.params, row.output_token_ids, row.bad_words_token_ids
                )
        penalised = [(i, row) for i, row in enumerate(rows) if row.params.has_penalties]
        if penalised:
            apply_penalties_rows(logits, penalised)
        # min_tokens: stop ids held back, all rows' in one copy (a stop id outside the
        # vocabulary can never be sampled: nothing to hold back)
        held = [
            (i, t)
            for i, row in enumerate(rows)
            if row.num_output_tokens < row.params.min_tokens
            for t in row.stop_ids_for_min_tokens
            if t < vocab
        ]
        if held:
            where = to_device([x for pair in held for x in pair], logits.device, torch.long)
            logits[where[0::2], where[1::2]] = float("-inf")
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        every_row = len(random_rows) == len(rows)
        out = (
            torch.empty(len(rows), dtype=torch.long, device=logits.device)
            if every_row
            else logits.argmax(dim=-1)
        )
        if random_rows:
            idx = to_device(random_rows, logits.device, torch.long)
            sub = logits if every_row else logits[idx]  # logits are ours: the step's own
            ps = [rows[i].params for i in random_rows]
            dev = logits.device
            if staged is not None and not every_row:
                staged = staged.select(idx)
            temp = (
                torch.tensor([p.temperature for p in ps], device=dev, dtype=sub.dtype)
                if staged is None
                else staged.temperature
            )
            u = (
                self._device_uniforms(rows, random_rows, staged, dev)
                if self.device_draws
                else torch.cat(
                    [torch.rand(1, generator=rows[i].generator, device="cpu") for i in random_rows]
                ).to(dev)
            )
            # a row without masks takes the plain kernel where there is one (the same rule, one
            # pass per row); the choice depends on the row alone, so a seeded row draws the
            # same tokens whatever shares its batch
            plain = self.plain_sample
            kernel = (
                [] if plain is None else [j for j, p in enumerate(ps) if not _filters(p, vocab)]
            )
            picked = torch.empty(len(ps), dtype=torch.long, device=dev)
            if kernel and plain is not None:
                got = plain(*_rows(kernel, len(ps), sub, temp, u))
                if got is None:  # no kernels, or a NaN / +inf logit: the torch ops decide
                    kernel = []
                else:
                    picked[kernel] = got
            rest = sorted(set(range(len(ps))) - set(kernel))
            if rest:
                filters = None
                if staged is not None:
                    filters = _rows(rest, len(ps), staged.top_k, staged.top_p, staged.min_p)
                rest_sub, rest_temp, rest_u = _rows(rest, len(ps), sub, temp, u)
                picked[rest] = _sample_torch(
                    [ps[i] for i in rest], rest_sub, rest_temp, rest_u, filters
                )
            out[idx] = picked
        return out.tolist()

    @staticmethod
    def _device_uniforms(
        rows: Sequence[SamplingRow],
        random_rows: list[int],
        staged: SamplingTensors | None,
        device: torch.device,
    ) -> torch.Tensor:
        """The random rows' uniform numbers from their (seed, draw count), staged already or
        made from the rows."""
        import cbgen_kernels

        if staged is not None and staged.seed is not None and staged.draws is not None:
            seeds, draws = staged.seed, staged.draws
        else:
            seeds = torch.tensor([seed_int64(rows[i].seed) for i in random_rows], device=device)
            draws = torch.tensor([rows[i].draws for i in random_rows], device=device)
        return cbgen_kernels.uniform_draws(seeds, draws)

"""What a step does to a row's float32 logits before a token is drawn: allowed_token_ids, bad
words and logit_bias (vLLM's order), the repetition / presence / frequency penalties (one row,
or a step's rows at once), and the top-k / top-p / min-p masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from cbgen.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cbgen.engine.sampler import SamplingRow


def apply_logit_controls(
    logits: torch.Tensor,
    params: SamplingParams,
    output_token_ids: Sequence[int],
    bad_words_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Apply allowed_token_ids, bad words and logit_bias to one row of logits [V] in place,
    in vLLM's order, and return it. A bad word's last token is masked when the output so far
    ends with the word's other tokens (a one-token word always):

        output   ... a  b        bad word  a b c   ->  c masked
    """
    vocab = logits.shape[-1]
    device = logits.device
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=device)
        keep[torch.tensor(params.allowed_token_ids, device=device)] = True
        logits.masked_fill_(~keep, float("-inf"))
    banned = [
        ids[-1]
        for ids in bad_words_token_ids
        if len(ids) <= len(output_token_ids) + 1
        and list(output_token_ids[len(output_token_ids) - len(ids) + 1 :]) == list(ids[:-1])
    ]
    if banned:
        logits[banned] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=device)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), device=device)
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    repetition_penalty: float,
    presence_penalty: float,
    frequency_penalty: float,
) -> torch.Tensor:
    """Penalise one row of logits [V] in place and return it.

    repetition: every token seen in prompt or output has its logit divided by the penalty when
    positive, multiplied when negative; frequency and presence: subtract penalty x count and
    penalty x (count > 0) over output tokens.
    """
    vocab = logits.shape[-1]
    device = logits.device
    if repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        ids = list(prompt_token_ids) + list(output_token_ids)
        if ids:
            seen[torch.tensor(ids, device=device)] = True
        penalised = torch.where(
            logits > 0, logits / repetition_penalty, logits * repetition_penalty
        )
        logits.copy_(torch.where(seen, penalised, logits))
    if (presence_penalty != 0.0 or frequency_penalty != 0.0) and output_token_ids:
        counts = torch.bincount(
            torch.tensor(list(output_token_ids), device=device), minlength=vocab
        ).to(logits.dtype)
        logits -= frequency_penalty * counts + presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def to_device(data: Sequence[Any], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A host list as a tensor on device without waiting for the device: a pinned host copy
    sent with a non-blocking copy (torch.tensor(data, device=cuda) waits for every queued
    kernel first)."""
    host = torch.tensor(data, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def apply_penalties_rows(logits: torch.Tensor, rows: Sequence[tuple[int, SamplingRow]]) -> None:
    """apply_penalties on rows (index into logits [B, V], row) of one step at once: the token
    ids of every row, padded, reach the device in one non-blocking copy, and the penalties are
    applied as batched tensor operations (the same values as row by row)."""
    vocab, device = logits.shape[-1], logits.device
    idx = [i for i, _ in rows]
    seen_ids = [list(r.prompt_token_ids) + list(r.output_token_ids) for _, r in rows]
    out_ids = [list(r.output_token_ids) for _, r in rows]
    width_seen = max(1, max(map(len, seen_ids)))
    width_out = max(1, max(map(len, out_ids)))
    # one int64 block: row indices, then seen ids and output ids padded with vocab (a column
    # dropped after the scatter)
    flat = idx[:]
    for ids in seen_ids:
        flat += ids + [vocab] * (width_seen - len(ids))
    for ids in out_ids:
        flat += ids + [vocab] * (width_out - len(ids))
    block = to_device(flat, device, torch.long)
    n = len(rows)
    rows_t = block[:n]
    seen_t = block[n : n + n * width_seen].view(n, width_seen)
    out_t = block[n + n * width_seen :].view(n, width_out)
    scalars = to_device(
        [
            v
            for _, r in rows
            for v in (
                r.params.repetition_penalty,
                r.params.presence_penalty,
                r.params.frequency_penalty,
            )
        ],
        device,
        logits.dtype,
    ).view(n, 3)
    rep, presence, frequency = scalars[:, :1], scalars[:, 1:2], scalars[:, 2:]
    sub = logits[rows_t]
    seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, seen_t, True)
    sub = torch.where(seen[:, :vocab], torch.where(sub > 0, sub / rep, sub * rep), sub)
    counts = torch.zeros(n, vocab + 1, dtype=logits.dtype, device=device)
    counts.scatter_add_(1, out_t, torch.ones_like(out_t, dtype=logits.dtype))
    counts = counts[:, :vocab]
    sub -= frequency * counts + presence * (counts > 0).to(logits.dtype)
    logits[rows_t] = sub


def filter_logits(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    *,
    truncate: bool | None = None,
    floor: bool | None = None,
) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, outside the top-p nucleus, or under min_p x p_max.

    logits [B, V] already divided by temperature; top_k [B] (0 = all), top_p [B], min_p [B].
    truncate / floor: whether any row may have top-k or top-p / min-p, when the caller knows it
    on the host (None: read from the tensors, one device-to-host read each on a GPU).
    """
    vocab = logits.shape[-1]
    if truncate is None:
        truncate = bool((top_k > 0).any()) or bool((top_p < 1.0).any())
    if floor is None:
        floor = bool((min_p > 0).any())
    if truncate:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        drop = ranks >= k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # keep a token if the mass strictly before it is < top_p (the top token always stays);
        # rows with top_p = 1 keep everything: their cumulative sum may round past 1.0
        before = probs.cumsum(dim=-1) - probs
        drop |= (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    if floor:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits

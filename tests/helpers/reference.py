"""The references results are checked against: transformers' greedy tokens, the four settings
every model is checked under (default, chunked prefill, preemption, one slot) and cbgen's tokens
under each; causal attention written out in float64 (the C prefill kernel's reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cbgen.engine.engine import Engine
from cbgen.llm import LLM
from cbgen.sampling_params import SamplingParams

NEW_TOKENS = 32
"""Tokens each request generates in the token-exact tests."""


def hf_greedy(model: Any, prompt_ids: Sequence[int], n: int) -> list[int]:
    from transformers import GenerationConfig

    x = torch.tensor([list(prompt_ids)])
    # ignore_eos: no EOS anywhere, so generation runs to n tokens without masking EOS.
    model.generation_config.eos_token_id = None
    gc = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=[], pad_token_id=0)
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)
    return out[0, x.shape[1] :].tolist()


def settings(prompt_lens: list[int], engine_for_sizes: Engine) -> dict[str, dict[str, Any]]:
    """The four configurations every model is checked under."""
    longest = max(prompt_lens) + NEW_TOKENS
    per_block = engine_for_sizes.kv_bytes_per_block
    bs = engine_for_sizes.config.block_size
    chunk = max(1, min(prompt_lens) // 3)
    # room for the longest request plus a little: several requests cannot coexist
    preempt: dict[str, Any] = {"enable_prefix_caching": False}
    windows = engine_for_sizes.model_config.layer_windows
    if windows and None not in windows:
        # a window in every layer: a request holds at most its window and a chunk of blocks
        preempt["max_num_batched_tokens"] = chunk
        longest = min(longest, max(w for w in windows if w is not None) + chunk)
    preempt["kv_cache_memory"] = per_block * (-(-longest // bs) + 2)
    return {
        "default": {},
        "chunked": {"max_num_batched_tokens": chunk},
        "preempt": preempt,
        "one_slot": {"max_num_seqs": 1},
    }


def run_cbgen(
    base: Engine, overrides: dict[str, Any], prompts: list[list[int]]
) -> tuple[list[list[int]], int]:
    engine = Engine(base.config.replace(**overrides), share_weights_with=base)
    llm = LLM(engine=engine)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    assert engine.kv.num_used_blocks == 0
    return [o.output_token_ids for o in outs], engine.total_preemptions


def attention_float64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    cap: float | None = None,
) -> torch.Tensor:
    """Causal attention written out in float64, the C prefill kernel's reference: q [Q, H, D]
    at positions L - Q .. L - 1 over k, v [L, Hkv, D]; query row t at position p = L - Q + t
    sees keys p - W < j <= p (W: window, None for all), scores capped as cap * tanh(s / cap)."""
    group = q.shape[1] // k.shape[1]
    weights = attention_weights_float64(q, k, scale, window, cap)
    return torch.einsum("hqk,khd->qhd", weights, v.double().repeat_interleave(group, 1))


def attention_weights_float64(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    window: int | None = None,
    cap: float | None = None,
) -> torch.Tensor:
    """attention_float64's softmax weights [H, Q, L] (0 for the keys a row does not see)."""
    qlen, heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    kk = k.double().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    pos = seq_len - qlen + torch.arange(qlen)[:, None]
    keys = torch.arange(seq_len)[None, :]
    visible = (keys <= pos) & (keys > pos - (window if window is not None else seq_len + 1))
    return scores.masked_fill(~visible, float("-inf")).softmax(-1)

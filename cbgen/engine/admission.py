"""What a request must satisfy to be queued (Engine.add_request): checked before anything
changes, so a refused request leaves the engine as it was."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cbgen.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cbgen.engine.engine import Engine


def check_request(engine: Engine, token_ids: Sequence[int], params: SamplingParams) -> None:
    """ValueError, naming the field, for a request that can never run on this engine: an empty
    prompt, a token id outside the vocabulary (prompt, logit_bias, allowed_token_ids), bad words
    or a grammar that do not compile, a prompt or prompt + max_tokens longer than the engine
    allows, or more KV blocks than the cache holds."""
    if not token_ids:
        raise ValueError("prompt: is empty")
    vocab = engine.model_config.vocab_size
    bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt: token id {bad!r} is outside the vocabulary [0, {vocab})")
    for name, ids in (
        ("logit_bias", list(params.logit_bias or ())),
        ("allowed_token_ids", params.allowed_token_ids or []),
    ):
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
    engine.bad_words_token_ids(params)
    if params.structured_outputs is not None:
        engine.grammars.compile(params.structured_outputs)
    n = len(token_ids)
    if n > engine.max_prompt_len:
        raise ValueError(
            f"prompt: {n} tokens is longer than the {engine.max_prompt_len} this engine allows"
            + (
                " (max_model_len)"
                if engine.max_prompt_len == engine.max_model_len
                else " (max_num_batched_tokens without chunked prefill)"
            )
        )
    if n + params.max_tokens > engine.max_model_len:
        raise ValueError(
            f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len ({engine.max_model_len})"
        )
    need = engine.kv.max_blocks_held(n + params.max_tokens, engine.config.max_num_batched_tokens)
    if need > engine.num_blocks:
        raise ValueError(
            f"max_tokens: prompt + max_tokens needs {need} KV blocks, the cache has {engine.num_blocks}"
        )

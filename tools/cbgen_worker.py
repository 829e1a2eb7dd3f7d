"""Peer worker: the workload through cbgen's public API (run with this repo's .venv python).

The engine is driven step by step (Engine.add_request / Engine.step) rather than through
LLM.generate, so that every StepStats record is kept: model FLOP utilisation is computed
from them (see `flop_summary`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tools.peer_common import (
    PROCESS_START,
    Result,
    TimedWindow,
    check_lengths,
    fill_window,
    load_workload,
    run_worker,
    tpot_extra,
    worker_args,
)

if TYPE_CHECKING:  # cbgen is imported inside the timed start-up, not here
    from cbgen.engine.outputs import StepStats


def flop_summary(
    steps: Sequence[StepStats], non_embedding_params: int, lm_head_params: int, max_num_seqs: int
) -> dict[str, float]:
    """FLOPs counted as 2 x parameters per computed token, plus 2 x LM-head parameters per
    sampled token (logits are taken only there).

    Decode-only steps (no prefill token) compute and sample exactly num_decode_tokens tokens;
    full-batch steps are the decode-only steps with every slot busy (num_scheduled ==
    max_num_seqs). With all requests submitted at once the batch only shrinks after the
    first finish, so full-batch steps are the first decode steps.
    End to end: prefill tokens computed (cache hits excluded by the scheduler) + decodes;
    sampled tokens = decodes + one per prompt that finished its prefill, i.e. the output
    tokens, which the caller adds.
    """
    full_tokens, full_s, dec_tokens, dec_s, all_tokens, all_s = 0, 0.0, 0, 0.0, 0, 0.0
    for s in steps:
        n_pre, n_dec = s.num_prefill_tokens, s.num_decode_tokens
        all_tokens += n_pre + n_dec
        all_s += s.duration_s
        if n_pre == 0:  # decode-only: every computed token is sampled
            dec_tokens += n_dec
            dec_s += s.duration_s
            if s.num_scheduled == max_num_seqs:
                full_tokens += n_dec
                full_s += s.duration_s
    per_token = 2 * (non_embedding_params + lm_head_params)
    return {
        "full_batch_steps_s": full_s,
        "full_batch_tokens": float(full_tokens),
        "full_batch_flops": float(full_tokens * per_token),
        "decode_steps_s": dec_s,
        "decode_tokens": float(dec_tokens),
        "decode_flops": float(dec_tokens * per_token),
        "num_decode_steps": float(sum(1 for s in steps if s.num_prefill_tokens == 0)),
        "all_steps_s": all_s,
        "computed_tokens": float(all_tokens),
        "flops_body": float(all_tokens * 2 * non_embedding_params),
        "flops_per_sampled_token_head": float(2 * lm_head_params),
    }


def keys_read(positions: int, window: int | None) -> int:
    """Keys the queries at positions 0 .. positions - 1 read in all: position p reads its
    p + 1 causal keys, at most `window` of them."""
    if window is None or positions <= window:
        return positions * (positions + 1) // 2
    return window * (window + 1) // 2 + (positions - window) * window


def attention_flops(
    lengths: Sequence[tuple[int, int]],
    windows: Sequence[int | None],
    num_heads: int,
    head_dim: int,
) -> float:
    """The attention's FLOPs for requests of (prompt, output) tokens, whoever runs them: a
    request runs prompt + output - 1 positions (the last token is sampled, never fed back);
    a query head reading a key does 2 x head_dim for q.k and 2 x head_dim for p x v, in every
    layer, whose window limits the keys (`windows`, one per layer). The matmuls' count is
    flop_summary's; this is the rest of the model's arithmetic, which grows with the context."""
    per_key = 4 * num_heads * head_dim
    return float(
        sum(per_key * keys_read(max(p + o - 1, 0), w) for p, o in lengths for w in windows)
    )


def main() -> None:
    p = worker_args(__doc__.splitlines()[0])
    p.add_argument(
        "--load-format", default="auto", help="cbgen's load format (dummy: random weights)"
    )
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="a GGUF file's float path (every tensor dequantized) instead of its own types",
    )
    args = p.parse_args()

    def body(result: Result) -> None:
        from cbgen.llm import LLM
        from cbgen.sampling_params import SamplingParams

        items = load_workload(args.workload)
        llm = LLM(
            args.model or None,
            load_format=args.load_format,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            dtype=args.dtype,
            dequantize=args.dequantize,
        )
        engine = llm.engine
        # Warm-up: one short request of token ids no real prompt starts with (no prefix-cache help).
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        engine.add_request("warm-up", [7] * 24, warm)
        while engine.has_unfinished_requests():
            engine.step()
        result.startup_s = time.perf_counter() - PROCESS_START

        outputs: dict[str, list[int]] = {}
        tpots: list[float | None] = []
        steps = []
        with TimedWindow() as w:
            for it in items:
                params = SamplingParams(temperature=0, max_tokens=it.output_len, ignore_eos=True)
                engine.add_request(it.request_id, it.prompt_token_ids, params)
            while engine.has_unfinished_requests():
                out = engine.step()
                steps.append(out.stats)
                for r in out.finished:
                    if result.first_finished_s is None:
                        result.first_finished_s = time.perf_counter() - PROCESS_START
                    if r.finish_reason not in ("length", "stop"):
                        raise RuntimeError(f"request {r.request_id}: {r.finish_reason} {r.error}")
                    outputs[r.request_id] = list(r.output_token_ids)
                    tpots.append(r.metrics.tpot_s)
        fill_window(result, w)
        result.output_token_ids = [outputs[it.request_id] for it in items]
        check_lengths(result, items)
        result.prompt_tokens = sum(len(it.prompt_token_ids) for it in items)
        result.output_tokens = sum(it.output_len for it in items)
        mc = engine.model_config
        result.extra = flop_summary(
            steps,
            mc.num_parameters(include_embeddings=False),
            mc.vocab_size * mc.hidden_size,
            args.max_num_seqs,
        )
        result.extra["flops_attention"] = attention_flops(
            [(len(it.prompt_token_ids), it.output_len) for it in items],
            mc.layer_windows,
            mc.num_attention_heads,
            mc.head_dim,
        )
        result.extra["num_steps"] = float(len(steps))
        result.extra["total_preemptions"] = float(steps[-1].total_preemptions if steps else 0)
        result.extra["cached_tokens"] = float(sum(s.num_cached_tokens for s in steps))
        result.extra.update(tpot_extra(tpots))
        result.detail = engine.describe()

    run_worker("cbgen, --dequantize" if args.dequantize else "cbgen", args.out, body)


if __name__ == "__main__":
    main()

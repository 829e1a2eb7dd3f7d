"""Peer worker: the workload through llama.cpp (llama-cpp-python built for this CPU, in this repo's
.venv: `pip install -e '.[llamacpp]'`), every request a parallel sequence of one context.

llama-cpp-python's `Llama` runs one sequence; its server, like llama.cpp's, runs parallel slots.
This worker does what llama-server's loop does for N slots, without the HTTP layer, through the
library's own C API (llama_batch / llama_decode, as llama.cpp's `batched` and `parallel`
examples do): one context with n_seq_max = the number of requests and one KV cache they share
(kv_unified, sized for every request's prompt + output), and at each step one llama_decode of a
batch holding every generating sequence's last token, then prompt tokens of the sequences still
reading theirs, in chunks, up to n_batch tokens (2,048, llama.cpp's default; micro-batches of
n_ubatch 512). Logits are asked for at each sequence's last token in the batch; the next token is
the argmax (greedy, no sampler chain), and a sequence stops at exactly its output length (EOS
ignored) and frees its KV cells. Threads: every CPU this process may use, for prompts and decode.
Everything else is llama.cpp's default (flash attention auto, F16 KV cache, weights memory-mapped).
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field

import numpy as np

from tools.peer_common import (
    PROCESS_START,
    Result,
    TimedWindow,
    WorkItem,
    check_lengths,
    fill_window,
    load_workload,
    run_worker,
    tpot_extra,
    worker_args,
)

N_BATCH = 2048
N_UBATCH = 512


@dataclass
class Sequence:
    """One request as a llama.cpp sequence: prompt tokens fed so far, tokens sampled and when."""

    seq_id: int
    item: WorkItem
    fed: int = 0
    """Tokens of the sequence in the KV cache (prompt first, then outputs fed back)."""
    out: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.out) >= self.item.output_len

    @property
    def reading_prompt(self) -> bool:
        return self.fed < len(self.item.prompt_token_ids)


def plan_batch(seqs: list[Sequence], n_batch: int) -> list[tuple[Sequence, int, int, bool]]:
    """One step's batch: (sequence, token, position, wants logits) per entry. Every generating
    sequence's last sampled token first (a decode is one token), then prompt tokens in request
    order while the batch has room, a prompt's last token asking for logits."""
    entries: list[tuple[Sequence, int, int, bool]] = []
    for s in seqs:
        if not s.done and not s.reading_prompt:
            entries.append((s, s.out[-1], s.fed, True))
    for s in seqs:
        if s.done or not s.reading_prompt:
            continue
        prompt = s.item.prompt_token_ids
        room = n_batch - len(entries)
        if room <= 0:
            break
        take = min(room, len(prompt) - s.fed)
        for j in range(s.fed, s.fed + take):
            entries.append((s, prompt[j], j, j == len(prompt) - 1))
    return entries


class LlamaCpp:
    """A llama.cpp model and one context for n_seq sequences, through llama-cpp-python's C API."""

    def __init__(self, path: str, n_seq: int, n_ctx: int, threads: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(
            path.encode(), llama_cpp.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {os.path.basename(path)}")
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = N_BATCH
        p.n_ubatch = N_UBATCH
        p.n_seq_max = n_seq
        p.n_threads = p.n_threads_batch = threads
        p.kv_unified = True
        self.params = p
        self.ctx = llama_cpp.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create its context")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)
        self.memory = llama_cpp.llama_get_memory(self.ctx)

    def decode(self, entries: list[tuple[Sequence, int, int, bool]]) -> list[int]:
        """Run one batch; the argmax token at each entry that asked for logits, in order."""
        b = self.batch
        for i, (s, token, pos, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = s.seq_id
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (1: no room in the KV cache)")
        picked = []
        for i, (_, _, _, logits) in enumerate(entries):
            if logits:
                row = self.lib.llama_get_logits_ith(self.ctx, i)
                picked.append(int(np.ctypeslib.as_array(row, shape=(self.n_vocab,)).argmax()))
        return picked

    def forget(self, seq_id: int) -> None:
        self.lib.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)

    def describe(self) -> str:
        p = self.params
        info = ctypes.string_at(self.lib.llama_print_system_info()).decode(errors="replace")
        return (
            f"llama-cpp-python {self.lib.__version__}, n_seq_max {p.n_seq_max}, n_ctx {p.n_ctx} "
            f"(kv_unified), n_batch {p.n_batch}, n_ubatch {p.n_ubatch}, threads {p.n_threads}, "
            f"flash_attn_type {p.flash_attn_type} (-1 auto), type_k {p.type_k} (1 F16); "
            f"{info.strip()}"
        )

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def run(engine: LlamaCpp, items: list[WorkItem]) -> list[Sequence]:
    """Every request at once, continuous batching as llama-server's slots do, to the end."""
    seqs = [Sequence(i, it) for i, it in enumerate(items)]
    while not all(s.done for s in seqs):
        entries = plan_batch(seqs, N_BATCH)
        picked = iter(engine.decode(entries))
        now = time.perf_counter()
        for s, _, _, logits in entries:
            s.fed += 1
            if logits:
                s.out.append(next(picked))
                s.times.append(now)
                if s.done:
                    engine.forget(s.seq_id)
    return seqs


def main() -> None:
    p = worker_args(__doc__.splitlines()[0])
    args = p.parse_args()

    def body(result: Result) -> None:
        items = load_workload(args.workload)
        n_ctx = sum(len(it.prompt_token_ids) + it.output_len for it in items)
        n_ctx = -(-(n_ctx + 256) // 256) * 256  # a little spare, in whole 256-cell pages
        threads = len(os.sched_getaffinity(0))
        engine = LlamaCpp(args.model, max(len(items), 1), n_ctx, threads)
        # warm-up: one short sequence of token ids no prompt starts with
        run(engine, [WorkItem("warm-up", [7] * 24, 4)])
        engine.clear()
        result.startup_s = time.perf_counter() - PROCESS_START
        with TimedWindow() as w:
            seqs = run(engine, items)
        fill_window(result, w)
        result.output_token_ids = [s.out for s in seqs]
        check_lengths(result, items)
        result.prompt_tokens = sum(len(it.prompt_token_ids) for it in items)
        result.output_tokens = sum(it.output_len for it in items)
        result.first_finished_s = min(s.times[-1] for s in seqs) - PROCESS_START
        result.extra = tpot_extra(
            [(t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None for t in (s.times for s in seqs)]
        )
        result.detail = engine.describe()
        engine.close()

    run_worker("llama.cpp", args.out, body)


if __name__ == "__main__":
    main()

"""CUDA graphs for decode-only steps: the forward pass captured once per batch-size bucket,
then replayed with each step's inputs in the runner's static buffers (step_inputs).

A decode-only step (every sequence computes one token) of B sequences runs as the smallest
bucket N >= B; rows B..N-1 are padding rows that write no K/V (step_inputs.fill_padding):

    buckets     1  2  4  8  16  24  32  ...  (multiples of 8)  ...  max_num_seqs
    B = 5    ->          8        (3 padding rows)
    B = 17   ->             24    (7 padding rows)

Larger steps, and steps with a prefill chunk, run eagerly. A graph replays the kernels it
recorded on the tensors it recorded, so a backend is capturable only when its prepare() does
host work alone and its forward() launches kernels whose grids follow the shapes a bucket fixes
and read everything else (slots, sequence lengths, block table) from device tensors:

    triton   yes. Its plan chooses split-KV from max_seq_len, which a capture sets to
             max_model_len, the bound every replayed step respects (each sequence splits its
             own keys by its own length, on the device)
    torch    no: its plan reads query_start_loc and seq_lens on the host (.tolist())
    cpu      no: the CPU has no graphs
    flash    not yet: flash_attn_varlen_func under capture is untested here, it runs eagerly

What this module needs of CUDA is confined to DecodeGraphs.capture and replay; choosing a
bucket and padding run (and are tested) on the CPU.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

CAPTURABLE_BACKENDS = ("triton",)


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets for a runner of max_num_seqs slots: 1, 2, 4, then every multiple of 8 up to
    max_num_seqs, and max_num_seqs itself (vLLM's sizes)."""
    sizes = {n for n in (1, 2, 4) if n <= max_num_seqs}
    sizes.update(range(8, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def bucket_for(sizes: Sequence[int], num_seqs: int) -> int | None:
    """The smallest of sizes (sorted) that holds num_seqs rows, or None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def graphs_unavailable(device: torch.device, backend_name: str, enforce_eager: bool) -> str | None:
    """Why decode steps cannot replay CUDA graphs here (None: they can)."""
    if enforce_eager:
        return "enforce_eager"
    if device.type != "cuda":
        return f"no CUDA graphs on {device.type}"
    if backend_name not in CAPTURABLE_BACKENDS:
        return f"the {backend_name} attention backend is not capturable"
    return None


def graph_memory_reserve(
    activation_bytes: int, max_num_batched_tokens: int, sizes: Sequence[int], hidden_bytes: int
) -> int:
    """Bytes to keep out of the KV cache for the graphs' memory pool (the graphs are captured
    after the KV cache is allocated). The largest bucket runs a forward pass of sizes[-1]
    tokens, whose intermediates take at most that share of activation_bytes, measured for a
    step of max_num_batched_tokens tokens (activations grow with the tokens); each graph's
    output (hidden_bytes a row) stays allocated; 64 MiB more for segments and workspaces."""
    share = min(1.0, sizes[-1] / max_num_batched_tokens)
    return int(activation_bytes * share) + sum(sizes) * hidden_bytes + (64 << 20)


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    hidden: torch.Tensor
    """The captured forward's output [N, hidden]: each replay overwrites it."""
    keep: Any
    """What the captured kernels read besides the static buffers (the attention plan and its
    workspace): alive as long as the graph."""


class DecodeGraphs:
    """One captured forward pass per bucket size."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = tuple(sorted(sizes))
        self._graphs: dict[int, _Graph] = {}
        self.capture_time_s = 0.0

    def capture(
        self,
        stage: Callable[[int], None],
        forward: Callable[[int], tuple[torch.Tensor, Any]],
    ) -> None:
        """For each size N, largest first: stage(N) fills the static buffers with N padding rows,
        forward(N) runs the forward pass on them and returns (hidden [N, hidden], what must stay
        alive). A first, eager call compiles every kernel (nothing may compile under capture);
        the second is captured. All graphs share one memory pool: they never run at once."""
        t0 = time.perf_counter()
        pool = None
        for n in reversed(self.sizes):
            stage(n)
            forward(n)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden, keep = forward(n)
            pool = graph.pool()
            self._graphs[n] = _Graph(graph, hidden, keep)
        torch.cuda.synchronize()
        self.capture_time_s = time.perf_counter() - t0

    def replay(self, size: int) -> torch.Tensor:
        """Run bucket size's graph on what the static buffers hold now: its hidden [N, hidden]."""
        g = self._graphs[size]
        g.graph.replay()
        return g.hidden

    def __len__(self) -> int:
        return len(self._graphs)

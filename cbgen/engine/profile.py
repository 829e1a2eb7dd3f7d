"""Size the KV cache on CUDA: run one forward pass at the full token budget and measure it.

The engine calls profile_peak_memory after the weights are loaded and before the KV cache
exists; the cache then gets gpu_memory_utilization x total memory minus what this returns.

The profiling batch is the worst step the scheduler can build: max_num_batched_tokens tokens
in min(max_num_seqs, max_num_batched_tokens) sequences, every one of which samples (so the
logits and the sampler's float32 copies are as large as they get):

    sequence:   0                 1    2   ...  S-1
    tokens:     |<- long chunk ->| 1  | 1 | ... | 1 |      (chunks capped at max_model_len)

It runs through the engine's own model and attention backend (so kernel workspaces count) on
a throwaway KV cache just big enough for this batch, whose bytes are subtracted again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from cbgen.attention import AttentionBackend, AttentionMetadata
from cbgen.config import EngineConfig
from cbgen.engine.sampler import Sampler, SamplingRow
from cbgen.models.base import CausalLM
from cbgen.sampling_params import SamplingParams

logger = logging.getLogger("cbgen")

GiB = 1 << 30


@dataclass
class ProfileBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] last token of every sequence
    num_blocks: int
    """KV blocks the batch writes into (blocks 0 .. num_blocks - 1, each used once)."""


def profile_seq_lens(num_tokens: int, num_seqs: int, max_model_len: int) -> list[int]:
    """Lengths of the profiling sequences: as many tokens as the budget allows (at most
    num_tokens), at least one per sequence, none longer than max_model_len, longest first."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    lens = []
    remaining = num_tokens
    for i in range(num_seqs):
        still_to_fill = num_seqs - i - 1
        take = max(1, min(max_model_len, remaining - still_to_fill))
        lens.append(take)
        remaining -= take
    return lens


def build_profile_batch(seq_lens: list[int], block_size: int, device: torch.device) -> ProfileBatch:
    """Prompts of the given lengths (context 0), each in fresh consecutive blocks."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    blocks_per_seq = -(-lens // block_size)
    first_block = np.concatenate(([0], np.cumsum(blocks_per_seq)[:-1]))
    num_blocks = int(blocks_per_seq.sum())
    width = int(blocks_per_seq.max())
    # Row i: blocks first_block[i] .. first_block[i] + blocks_per_seq[i] - 1, then zeros.
    cols = np.arange(width)
    block_table = np.where(
        cols[None, :] < blocks_per_seq[:, None], first_block[:, None] + cols[None, :], 0
    ).astype(np.int32)
    qsl = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    total = int(qsl[-1])
    positions = np.arange(total) - np.repeat(qsl[:-1], lens)
    seq_of_token = np.repeat(np.arange(len(lens)), lens)
    slot_mapping = block_table[seq_of_token, positions // block_size].astype(
        np.int64
    ) * block_size + (positions % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(lens.astype(np.int32)).to(device),
        block_table=torch.from_numpy(block_table).to(device),
        max_query_len=int(lens.max()),
        max_seq_len=int(lens.max()),
        block_size=block_size,
    )
    return ProfileBatch(
        input_ids=torch.zeros(total, dtype=torch.long, device=device),
        positions=torch.from_numpy(positions).to(device),
        meta=meta,
        logits_indices=torch.from_numpy(qsl[1:] - 1).to(device),
        num_blocks=num_blocks,
    )


@torch.inference_mode()
def run_profile_forward(
    model: CausalLM,
    backend: AttentionBackend,
    config: EngineConfig,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, int]:
    """One forward pass of the profiling batch for config's budgets through model and
    backend, plus the logits and a float32 softmax of them (the sampler's largest buffers).
    Returns (the probabilities [S, vocab], bytes of the throwaway KV cache)."""
    cfg, mc = config, model.config
    lens = profile_seq_lens(cfg.max_num_batched_tokens, cfg.max_num_seqs, max_model_len)
    batch = build_profile_batch(lens, cfg.block_size, device)
    kv_caches = [
        torch.zeros(
            2,
            batch.num_blocks,
            cfg.block_size,
            mc.num_key_value_heads,
            mc.head_dim,
            dtype=dtype,
            device=device,
        )
        for _ in range(mc.num_hidden_layers)
    ]
    kv_bytes = sum(c.numel() * c.element_size() for c in kv_caches)
    backend.prepare(batch.meta)
    hidden = model(batch.input_ids, batch.positions, kv_caches, batch.meta, backend)
    logits = model.compute_logits(hidden[batch.logits_indices])
    del hidden, kv_caches
    probs = torch.softmax(logits.float(), dim=-1)
    # the sampler's own buffers at their largest: every row penalised, top-k, top-p and min-p
    # masked and drawn at random (sorts and float32 copies of [S, vocab]), as the runner draws
    Sampler(device.type == "cuda")(logits, _heaviest_rows(len(lens), mc.vocab_size))
    return probs, kv_bytes


def _heaviest_rows(num_rows: int, vocab: int) -> list[SamplingRow]:
    params = SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.1,
        frequency_penalty=0.1,
        seed=0,
    )
    seen = list(range(min(vocab, 64)))
    return [
        SamplingRow(params, seen, 1, torch.Generator().manual_seed(i), (), seed=i)
        for i in range(num_rows)
    ]


def cuda_memory_in_use(device: torch.device) -> tuple[int, int]:
    """(bytes torch's allocator holds, bytes in use on the device outside it: CUDA contexts,
    libraries, graph executables, other processes)."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return reserved, max(0, (total - free) - reserved)


def cap_allocator(device: torch.device, budget: float, reserved: int, outside: int) -> float:
    """Cap torch's allocator on device at budget less what is held outside it (never below
    what it holds already): at the cap it frees cached blocks instead of growing. Returns the
    fraction of the device's memory set."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, max(reserved, budget - outside) / total)
    index = torch.cuda.current_device() if device.index is None else device.index
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def profile_peak_memory(
    model: CausalLM,
    backend: AttentionBackend,
    config: EngineConfig,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Peak bytes of GPU memory that weights + activations of the largest step take, plus
    memory outside torch's allocator (CUDA context, libraries, other processes)."""
    if device.type != "cuda":
        raise ValueError(f"profile_peak_memory: needs a CUDA device, the engine runs on {device}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    probs, kv_bytes = run_profile_forward(model, backend, config, max_model_len, dtype, device)
    torch.cuda.synchronize(device)
    # reserved, not allocated: what the process holds of the device, the allocator's partly
    # used segments included (on an H200 the allocated peak fell 0.4 GiB short of it)
    torch_peak = torch.cuda.max_memory_reserved(device) - kv_bytes
    _, outside_torch = cuda_memory_in_use(device)
    total = torch.cuda.get_device_properties(device).total_memory
    del probs
    torch.cuda.empty_cache()
    peak = int(torch_peak + outside_torch)
    logger.info(
        "profile: a step of %d tokens in %d sequences peaks at %.2f GiB in torch "
        "(weights + activations) + %.2f GiB outside torch, of %.2f GiB",
        config.max_num_batched_tokens,
        min(config.max_num_seqs, config.max_num_batched_tokens),
        torch_peak / GiB,
        outside_torch / GiB,
        total / GiB,
    )
    return peak

"""What the GPU check builds on the machine it runs on, which has no network and no model files:
random-weight Hugging Face checkpoints of real Llama and Qwen shapes (tools.model_shapes:
CHECKPOINTS and QUICK_CHECKPOINTS; transformers writes them, cbgen and transformers both read
them), a ShareGPT-like workload from a fixed seed, and a synthetic decode step at a chosen batch
and context for timing.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cbgen.attention import AttentionBackend, AttentionMetadata
from cbgen.models.base import CausalLM
from cbgen.models.config import ModelConfig
from cbgen.models.registry import build_model
from tools.model_shapes import hf_model


def build_checkpoint(
    fields: dict[str, Any], folder: Path, dtype: torch.dtype = torch.float32, seed: int = 0
) -> Path:
    """A random-weight checkpoint saved by transformers (config.json + model.safetensors).

    Projections get N(0, 1/fan_in) (activations keep their scale through the layers), norms
    U(0.8, 1.2), the embedding and LM head rows N(0, 0.5) times a log-normal norm per row (as in
    trained heads, where some tokens' rows are much longer: the logits are peaked, near-ties
    rare). Every weight is a bfloat16 value, as in a checkpoint released in bfloat16, so a
    float32 run and a bfloat16 run multiply by the same weights."""
    model = hf_model(
        fields, seed, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0.0, 0.5).mul_(torch.randn(p.shape[0], 1).exp_())
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            else:  # biases
                p.normal_(0.0, 0.1)
            p.copy_(p.to(torch.bfloat16))
    model.to(dtype).save_pretrained(folder, safe_serialization=True)
    return folder


def sharegpt_like_prompts(
    n: int, vocab_size: int, seed: int, max_len: int = 1024
) -> list[list[int]]:
    """n prompts of random token ids whose lengths follow ShareGPT's first turns: log-normal,
    median 110 tokens, mean about 180, a long tail cut at max_len (at least 4)."""
    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(math.log(110), 1.0, size=n).astype(int), 4, max_len)
    lo = min(vocab_size // 100 + 3, vocab_size - 1)  # clear of special ids
    return [[int(t) for t in rng.integers(lo, vocab_size, size=int(k))] for k in lens]


def random_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int
) -> CausalLM:
    """cbgen's model of a shape with random weights drawn on the device (load_format="dummy"
    draws them on the host, which takes minutes for an 8B model); for timing only."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(cfg, max_positions)
    finally:
        torch.set_default_dtype(saved)
    model.rope.build()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval().requires_grad_(False)


@dataclass
class DecodeBatch:
    """Every sequence decodes one token after `context` cached ones, in blocks of its own."""

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    meta: AttentionMetadata
    num_blocks: int
    """Blocks the batch reads: batch x ceil((context + 1) / block_size)."""


def decode_batch(
    batch: int, context: int, block_size: int, vocab_size: int, device: torch.device
) -> DecodeBatch:
    """Sequence i owns blocks [i * per_seq, (i + 1) * per_seq); its new token goes to slot
    `context` of them (position context, after keys 0 .. context - 1)."""
    per_seq = -(-(context + 1) // block_size)
    table = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    slots = table[:, context // block_size].long() * block_size + context % block_size
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32).to(device),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32).to(device),
        block_table=table.to(device),
        max_query_len=1,
        max_seq_len=context + 1,
        block_size=block_size,
    )
    ids = torch.randint(3, vocab_size, (batch,), generator=torch.Generator().manual_seed(0))
    return DecodeBatch(
        ids.to(device), torch.full((batch,), context).to(device), meta, batch * per_seq
    )


def kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, kv heads, head_dim] zero tensor per layer."""
    shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]


@torch.inference_mode()
def time_decode_step(
    model: CausalLM,
    backend: AttentionBackend,
    caches: list[torch.Tensor],
    batch: DecodeBatch,
    sync: Callable[[], None],
    iters: int,
    graph: bool = False,
) -> float:
    """Median seconds of one decode step: forward, LM head on every row, argmax, and the read
    of the sampled ids (the step's one device-to-host copy). graph (CUDA): the forward pass
    replayed from a CUDA graph, the LM head and argmax eager after it, as the engine runs a
    decode step."""

    def step() -> None:
        backend.prepare(batch.meta)
        hidden = model(batch.input_ids, batch.positions, caches, batch.meta, backend)
        model.compute_logits(hidden).argmax(dim=-1).tolist()

    step()  # compiles and warms up
    sync()
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            backend.prepare(batch.meta)
            hidden = model(batch.input_ids, batch.positions, caches, batch.meta, backend)

        def step() -> None:
            captured.replay()
            model.compute_logits(hidden).argmax(dim=-1).tolist()

        step()
        sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_bytes_read(cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype) -> int:
    """Bytes a decode step must read at least once: every weight it multiplies by (all but an
    untied embedding table, of which it reads B rows) and the K/V of every context token."""
    elem = torch.empty((), dtype=dtype).element_size()
    weights = cfg.num_parameters() * elem
    if not cfg.tie_word_embeddings:
        weights -= cfg.vocab_size * cfg.hidden_size * elem
    kv = (
        batch
        * (context + 1)
        * 2
        * cfg.num_key_value_heads
        * cfg.head_dim
        * elem
        * cfg.num_hidden_layers
    )
    return weights + kv

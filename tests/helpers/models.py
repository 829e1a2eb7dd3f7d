"""Tiny checkpoints with random weights, written by transformers itself so that cbgen and
transformers read the very same weights, and the engines the tests run on them.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

from cbgen.config import EngineConfig
from cbgen.engine.engine import Engine
from tools.model_shapes import TINY_CONFIGS, hf_model

CHAR_VOCAB = 256
"""The character tokenizer's size (write_char_tokenizer): TINY_CONFIGS' vocabulary."""


def make_tiny_hf_model(kind: str, folder: Path, seed: int = 0, **changes: Any) -> Path:
    """Random weights (std 0.5, so logits are far apart and greedy is well defined),
    saved by transformers as config.json + model.safetensors; `changes` override fields of
    TINY_CONFIGS[kind] (the same seed gives the same weights where the shapes stay)."""
    fields = {**TINY_CONFIGS[kind], **changes}
    model = hf_model(fields, seed, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return save_random(model, folder)


def save_random(model: Any, folder: Path, seed: int | None = None) -> Path:
    """A transformers model's weights drawn anew (norms near 1, std 0.5 for the embedding and
    head, 0.2 elsewhere; from torch's generator as it stands, or seeded with `seed`) and saved
    as config.json + model.safetensors."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.5 if "embed" in name or "lm_head" in name else 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def tiny_engine(folder: Path, **options: Any) -> Engine:
    """cbgen's Engine on a tiny checkpoint, as the token-exact tests run it: CPU, float32,
    blocks of 4 tokens, 8 MiB of KV cache, one thread; options override the config."""
    config = EngineConfig(
        model=str(folder),
        device="cpu",
        dtype="float32",
        kv_cache_memory=8 << 20,
        block_size=4,
        num_threads=1,
    )
    return Engine(config.replace(**options))


def write_char_tokenizer(folder: Path, eos_token: str = "</s>") -> None:
    """A character-level tokenizer: ids 0-3 are <pad> <s> </s> <unk>, then one id per printable
    ASCII character, then two-letter strings ("aa", "ab", ...), so text is cheap and exact."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = [chr(c) for c in range(32, 127)]
    pairs = [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
    tokens = (special + chars + pairs)[:CHAR_VOCAB]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token=eos_token,
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    ).save_pretrained(folder)


def make_engine(folder: Path, **overrides: Any) -> Engine:
    """tiny_engine with 1 MiB of KV cache (the request tests' small cache)."""
    return tiny_engine(folder, **{"kv_cache_memory": 1 << 20, **overrides})

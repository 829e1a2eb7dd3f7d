"""A model too big for the CPU's memory is refused at start-up with what it needs, before any
weight is allocated (never a swap storm or an out-of-memory kill halfway through loading)."""

from __future__ import annotations

from types import SimpleNamespace

import psutil
import pytest
import torch

import cbgen.engine.engine as engine_module
from cbgen.engine import memory
from cbgen.engine.engine import Engine
from cbgen.engine.memory import GiB, check_cpu_memory, cpu_model_bytes
from cbgen.models.config import BUILTIN_SHAPES


def test_the_estimate_counts_the_packed_copies_of_float32_weights() -> None:
    mc = BUILTIN_SHAPES["llama-8b"]
    params = mc.num_parameters()
    assert cpu_model_bytes(mc, torch.float32) == 3 * 4 * params
    # bf16: the packed panels replace the weights (untied head); fp16: the weights as stored
    assert cpu_model_bytes(mc, torch.bfloat16) == cpu_model_bytes(mc, torch.float16) == 2 * params
    check_cpu_memory(mc, torch.bfloat16, 2 * params, "m")  # just fits
    with pytest.raises(ValueError, match=r"needs about .* in bfloat16 on the CPU \(weights\)"):
        check_cpu_memory(mc, torch.bfloat16, 2 * params - 1, "m")
    tied = BUILTIN_SHAPES["smollm2-135m"]  # a tied head is packed beside the embedding
    head = tied.vocab_size * tied.hidden_size
    assert cpu_model_bytes(tied, torch.bfloat16) == 2 * (tied.num_parameters() + head)


def test_an_8b_model_in_float32_is_refused_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-8b in float32 needs ~90 GiB here; allocating it would take minutes and the machine."""
    monkeypatch.setattr(
        psutil,
        "virtual_memory",
        lambda: SimpleNamespace(available=20 * GiB, total=24 * GiB),
    )
    monkeypatch.setattr(memory, "cgroup_available", lambda: None)  # no container limit below it
    loaded: list[object] = []
    monkeypatch.setattr(engine_module, "load_model", lambda *a, **k: loaded.append(a))
    with pytest.raises(ValueError) as e:
        Engine(model="llama-8b", load_format="dummy", device="cpu", dtype="float32")
    assert loaded == []  # refused before a weight was allocated
    message = str(e.value)
    assert message.startswith("model llama-8b needs about ")
    assert "GiB of memory in float32 on the CPU (weights and their packed copies)" in message
    assert "20.0 GiB is available: use --dtype bfloat16 (about 1" in message


def test_a_mixture_of_experts_counts_its_experts_once() -> None:
    """The stacked expert weights are not packed: float32 keeps them once, the rest three times."""
    from cbgen.engine.memory import expert_parameters
    from cbgen.models.config import ModelConfig
    from cbgen.models.registry import build_model
    from tools.model_shapes import TINY_CONFIGS

    mc = ModelConfig.from_hf_dict(TINY_CONFIGS["qwen3_moe"])
    model = build_model(mc, 64)
    stacked = sum(
        p.numel()
        for name, p in model.named_parameters()
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj")
    )
    assert stacked == expert_parameters(mc) > 0
    params = mc.num_parameters()
    assert cpu_model_bytes(mc, torch.float32) == 4 * (3 * (params - stacked) + stacked)
    assert cpu_model_bytes(mc, torch.bfloat16) == 2 * (
        params + (mc.vocab_size * mc.hidden_size if mc.tie_word_embeddings else 0)
    )
    assert expert_parameters(BUILTIN_SHAPES["llama-8b"]) == 0

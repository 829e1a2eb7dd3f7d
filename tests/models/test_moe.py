"""Mixture-of-experts models (Qwen3-MoE, Mixtral): the config's expert fields, the router against
transformers' routers, the grouped block against a per-token loop, the Triton grouped kernel
against its torch reference (in the interpreter without CUDA), loading per-expert and stacked
checkpoints, and greedy tokens equal to transformers' on tiny random checkpoints in float32, with
and without a sliding window.

Tolerances of the Triton kernel: its sums run in another order than torch's matmul, so float32
agrees within 1e-5 (observed ~3e-7 relative), bfloat16 within one bfloat16 ulp."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.models import make_tiny_hf_model, tiny_engine
from helpers.reference import hf_greedy
from safetensors.torch import save_file

from cbgen.config import EngineConfig
from cbgen.engine.engine import Engine
from cbgen.llm import LLM
from cbgen.models.config import ModelConfig
from cbgen.models.errors import ModelFileError
from cbgen.models.moe import SparseMoeBlock, grouped_experts, route, sort_by_expert
from cbgen.models.ops import TORCH_OPS
from cbgen.sampling_params import SamplingParams
from tools.model_shapes import TINY_CONFIGS

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KINDS = pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13],
    [100, 3, 77, 42, 42, 9, 250, 17, 33, 61, 12, 8, 190, 4, 4, 4, 61, 99, 23, 14, 15],
    list(range(30, 67)),
    [200, 201, 202],
    [9, 8, 7, 6, 5, 4, 3] * 4,
]
NEW_TOKENS = 16


def hf_config(kind: str, **changes: Any) -> dict[str, Any]:
    return {**TINY_CONFIGS[kind], **changes}


def test_config_reads_the_experts_and_counts_every_parameter() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    qwen = ModelConfig.from_hf_dict(
        hf_config("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    )
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (8, 3, 32)
    assert [n for n in range(6) if qwen.is_sparse_layer(n)] == [1, 5]  # 3 is mlp_only
    assert qwen.qk_norm and not qwen.norm_topk_prob
    mixtral = ModelConfig.from_hf_dict(hf_config("mixtral"))
    assert (mixtral.num_experts, mixtral.moe_intermediate_size) == (4, 64)
    assert mixtral.norm_topk_prob and all(mixtral.is_sparse_layer(n) for n in range(2))
    for kind in ("qwen3_moe", "mixtral"):
        fields = hf_config(kind)
        model_type = fields.pop("model_type")
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
        mine = ModelConfig.from_hf_dict(hf_config(kind))
        assert mine.num_parameters() == sum(p.numel() for p in hf.parameters()), kind
    with pytest.raises(ValueError, match=r"'num_experts_per_tok' \(9\) is more than"):
        ModelConfig.from_hf_dict(hf_config("qwen3_moe", num_experts_per_tok=9))
    with pytest.raises(ValueError, match="'mlp_only_layers' must be a list"):
        ModelConfig.from_hf_dict(hf_config("qwen3_moe", mlp_only_layers="1"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", [False, True])
@KINDS
def test_route_matches_transformers_routers(kind: str, norm: bool, dtype: torch.dtype) -> None:
    """Top-k experts, weights and the weights' dtype (Qwen3-MoE rounds them to the activation
    dtype, Mixtral keeps float32)."""
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    fields = hf_config(kind, norm_topk_prob=norm)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    router = (Qwen3MoeTopKRouter if kind == "qwen3_moe" else MixtralTopKRouter)(cfg).to(dtype)
    g = torch.Generator().manual_seed(int(norm))
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.3)
        hidden = torch.randn(23, 64, generator=g).to(dtype)
        _, want_weights, want_experts = router(hidden)
    mine = ModelConfig.from_hf_dict(hf_config(kind, norm_topk_prob=norm))
    block = SparseMoeBlock(mine)
    with torch.no_grad():
        logits = hidden @ router.weight.T
    weights, experts = route(
        logits, mine.num_experts_per_tok, block.renormalize, block.round_weights
    )
    assert torch.equal(experts, want_experts)
    assert weights.dtype == want_weights.dtype
    assert torch.equal(weights, want_weights)
    sums = weights.float().sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-2) == (norm or kind == "mixtral")


def random_block(kind: str, seed: int) -> SparseMoeBlock:
    block = SparseMoeBlock(ModelConfig.from_hf_dict(hf_config(kind)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return block


@pytest.mark.parametrize("tokens", [1, 2, 29])
@KINDS
def test_grouped_block_matches_a_per_token_loop(kind: str, tokens: int) -> None:
    """The block's output against the plainest formulation: for each token, for each of its top
    k experts, weight x that expert's MLP of the token, summed."""
    block = random_block(kind, seed=tokens)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = block(x, TORCH_OPS)
        weights, experts = route(block.gate(x), block.top_k, block.renormalize, block.round_weights)
        want = torch.zeros_like(x)
        w13, w2 = block.experts.gate_up_proj, block.experts.down_proj
        for t in range(tokens):
            for j in range(block.top_k):
                e = int(experts[t, j])
                gate, up = (w13[e] @ x[t]).chunk(2)
                want[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if tokens == 1:  # most experts have no rows: they are skipped, not run on empty groups
        assert len(set(experts.flatten().tolist())) < block.num_experts


def test_sort_by_expert_groups_the_pairs() -> None:
    experts = torch.tensor([[3, 0], [0, 2], [3, 1], [0, 3]])
    order, offsets = sort_by_expert(experts, num_experts=5)
    flat = experts.flatten()
    assert flat[order].tolist() == [0, 0, 0, 1, 2, 3, 3, 3]
    assert offsets.tolist() == [0, 3, 4, 5, 8, 8]  # expert 4 has no rows
    assert (order // 2).tolist() == [0, 1, 3, 2, 1, 0, 2, 3]  # each pair's token, stable


def grouped_inputs(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(tokens * 100 + experts)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    if tokens > 1:
        chosen[chosen == experts - 1] = 0  # one expert without rows
    order, offsets = sort_by_expert(chosen, experts)
    return tuple(t.to(DEVICE) for t in (x, order // top_k, offsets, w13, w2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape",
    [(1, 4, 2, 64, 32), (37, 8, 3, 48, 40), (5, 16, 2, 64, 96)],
    ids=["one-token", "odd-sizes", "sparse"],
)
def test_triton_grouped_moe_matches_the_reference(
    shape: tuple[int, int, int, int, int], dtype: torch.dtype
) -> None:
    """Groups longer than a tile (37 x 3 rows over 7 experts), sizes no power of two, experts
    with no rows, a lone token."""
    import cbgen_kernels

    x, rows, offsets, w13, w2 = grouped_inputs(*shape, dtype=dtype)
    counts = offsets.diff()
    assert (counts == 0).any()  # experts without rows
    if shape[0] == 37:
        assert (counts > cbgen_kernels.moe.BLOCK_M).any()  # an expert over several tiles
    got = cbgen_kernels.grouped_moe(x, rows, offsets, w13, w2)
    want = grouped_experts(x, rows, offsets, w13, w2)
    assert got.shape == want.shape == (rows.shape[0], shape[3]) and got.dtype == dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_triton_grouped_moe_refuses_mismatched_weights() -> None:
    import cbgen_kernels

    x, rows, offsets, w13, w2 = grouped_inputs(3, 4, 2, 64, 32, torch.float32)
    with pytest.raises(ValueError, match=r"are not \[E, 2I, H\] and \[E, H, I\]"):
        cbgen_kernels.grouped_moe(x, rows, offsets, w13, w2[:, :, :16])
    assert cbgen_kernels.grouped_moe(x, rows[:0], offsets * 0, w13, w2).shape == (0, 64)


def hf_greedy_all(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens of each prompt, EOS ignored (helpers.reference.hf_greedy)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [hf_greedy(model, p, NEW_TOKENS) for p in prompts]


def cbgen_greedy(folder: Path, **overrides: Any) -> list[list[int]]:
    engine = tiny_engine(folder, **overrides)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = LLM(engine=engine).generate(PROMPTS, params)
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.output_token_ids for o in outs]


@KINDS
def test_greedy_matches_transformers(kind: str, tiny_model_dir: Callable[[str], Path]) -> None:
    """Five prompts of 3-37 tokens in one batch, on the torch and cpu attention backends, and
    in prefill chunks of 4 tokens."""
    folder = tiny_model_dir(kind)
    expected = hf_greedy_all(folder, PROMPTS)
    for overrides in (
        {"attention_backend": "torch"},
        {"attention_backend": "cpu"},
        {"attention_backend": "cpu", "max_num_batched_tokens": 4},
    ):
        assert cbgen_greedy(folder, **overrides) == expected, (kind, overrides)


@KINDS
def test_stacked_checkpoint_loads_as_per_expert_one(
    kind: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """transformers' in-memory names (experts stacked as gate_up_proj [E, 2I, H], the router as
    mlp.gate) load into the same parameters as the per-expert names save_pretrained writes; a
    checkpoint missing one expert's tensor is refused, naming what is incomplete."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(kind)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((folder / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(stacked / "model.safetensors"))
    engine_cfg = EngineConfig(device="cpu", dtype="float32", kv_cache_memory=1 << 20)
    per_expert = Engine(engine_cfg.replace(model=str(folder))).model.state_dict()
    from_stacked = Engine(engine_cfg.replace(model=str(stacked))).model.state_dict()
    assert per_expert.keys() == from_stacked.keys()
    for name, tensor in per_expert.items():
        assert torch.equal(tensor, from_stacked[name]), name

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(
        json.dumps(json.loads((folder / "config.json").read_text()))
    )
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    dropped = next(
        k for k in tensors if ".experts.1." in k and k.endswith(("up_proj.weight", "w3.weight"))
    )
    del tensors[dropped]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(
        ModelFileError, match=r"missing weights \['layers\.0\.mlp\.experts\.gate_up_proj'\]"
    ):
        Engine(engine_cfg.replace(model=str(broken)))


def test_triton_ops_greedy_tokens_match_torch_ops(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole Qwen3-MoE forward on TritonOps (the grouped kernel in each sparse layer) gives
    TorchOps' greedy tokens, in float32."""
    from cbgen.models.triton_ops import TritonOps

    cfg = EngineConfig(
        model=str(tiny_model_dir("qwen3_moe")),
        device="cuda" if DEVICE.type == "cuda" else "cpu",
        dtype="float32",
        kv_cache_memory=4 << 20,
        attention_backend="torch",
        enable_prefix_caching=False,  # the second run computes its prompts again
    )
    engine = Engine(cfg)
    prompts, params = PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.model.ops = TORCH_OPS
    want = [o.output_token_ids for o in LLM(engine=engine).generate(prompts, params)]
    triton_ops = TritonOps()
    calls: list[int] = []
    kernel = triton_ops.grouped_experts

    def counted(
        x: torch.Tensor,
        rows: torch.Tensor,
        offsets: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
    ) -> torch.Tensor:
        calls.append(rows.shape[0])
        return kernel(x, rows, offsets, w13, w2)

    monkeypatch.setattr(triton_ops, "grouped_experts", counted)
    engine.model.ops = triton_ops
    got = [o.output_token_ids for o in LLM(engine=engine).generate(prompts, params)]
    assert got == want
    assert calls and calls[0] == 3 * (len(prompts[0]) + len(prompts[1]))  # a prefill, 3 per token


@pytest.mark.parametrize(
    ("kind", "window"),
    [("mixtral", {}), ("qwen3_moe", {"use_sliding_window": True})],
    ids=["mixtral", "qwen3_moe"],
)
def test_sliding_window_matches_transformers(
    kind: str, window: dict[str, Any], tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """A window of 8 in every layer (Mixtral whenever set, Qwen3-MoE with use_sliding_window),
    prompts and generations past it: transformers' tokens, which differ from the same weights'
    without a window."""
    folder = make_tiny_hf_model(kind, tmp_path / kind, sliding_window=8, **window)
    expected = hf_greedy_all(folder, PROMPTS)
    assert expected != hf_greedy_all(tiny_model_dir(kind), PROMPTS)
    for backend in ("torch", "cpu"):
        assert cbgen_greedy(folder, attention_backend=backend) == expected, backend

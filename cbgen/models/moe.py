"""Mixture-of-experts models, Qwen3-MoE and Mixtral: the Llama/Qwen decoder whose feed-forward
block, in its sparse layers, sends each token to the top k of E expert MLPs.

    router   logits = x W_r^T [T, E];  p = softmax(logits) in float32;  top k of p per token,
             rescaled to sum to 1 where the config says (Mixtral always, Qwen3-MoE by
             norm_topk_prob); Qwen3-MoE rounds the weights to the activation dtype, Mixtral keeps
             them in float32 (as transformers' routers do)
    experts  the T*k (token, expert) pairs sorted by expert, so that each expert's rows are one
             contiguous group and each group is one matmul per projection:

                 pair p = token * k + slot        sorted rows: | expert 0 | expert 1 | ... |
                 order[r] = the pair in sorted row r           offsets[e] .. offsets[e+1]

             row r computes down_e(silu(gate_e x) * up_e x) for x = x[order[r] // k]
             (grouped_experts; on CUDA the Triton kernel cbgen_kernels.grouped_moe)
    combine  each row times its routing weight goes back to its pair's place, and a token's k
             slots are summed in slot order, as transformers' grouped path does

Expert weights are stacked: gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj
[E, H, I], the layout (and names) transformers keeps in memory; checkpoints that store one
tensor per expert (what save_pretrained writes) are packed into them by load_weights.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from itertools import pairwise
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from cbgen.models.base import TORCH_LINEAR, Linear
from cbgen.models.config import ModelConfig
from cbgen.models.llama import MLP, LlamaForCausalLM
from cbgen.models.ops import TORCH_OPS, Ops


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, round_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k experts of each token [T, k] (by falling probability) and their weights [T, k]:
    softmax in float32, top k, optionally rescaled to sum to 1, then rounded to the logits'
    dtype when round_weights (else float32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return (weights.to(logits.dtype) if round_weights else weights), experts


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """order [T*k]: the (token, slot) pairs of experts [T, k] sorted by expert; offsets [E+1]:
    expert e's rows are order[offsets[e]:offsets[e+1]]. No host read (CUDA graphs)."""
    flat = experts.flatten()
    sorted_experts, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=sorted_experts.dtype)
    return order, torch.searchsorted(sorted_experts, bounds)


def grouped_experts(
    x: torch.Tensor,
    token_rows: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """The reference: row r of the result [S, H] is expert e's MLP of x[token_rows[r]], where
    expert_offsets[e] <= r < expert_offsets[e + 1]; one matmul per projection and expert that
    has rows (a loop over experts, never over tokens)."""
    rows = x[token_rows]
    out = rows.new_empty(rows.shape[0], w_down.shape[1])
    bounds = expert_offsets.tolist()
    for e, (start, end) in enumerate(pairwise(bounds)):
        if start == end:
            continue
        gate_up = TORCH_LINEAR.apply(rows[start:end], w_gate_up[e], None)
        out[start:end] = TORCH_LINEAR.apply(TORCH_OPS.silu_mul(gate_up), w_down[e], None)
    return out


@runtime_checkable
class GroupedExpertsOps(Protocol):
    """Ops that compute grouped_experts themselves (TritonOps on CUDA)."""

    def grouped_experts(
        self,
        x: torch.Tensor,
        token_rows: torch.Tensor,
        expert_offsets: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
    ) -> torch.Tensor: ...


class Experts(nn.Module):
    """E expert MLPs' weights, stacked."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class SparseMoeBlock(nn.Module):
    """A sparse layer's feed-forward block: router, top-k, grouped experts, weighted sum."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob or cfg.model_type == "mixtral"
        self.round_weights = cfg.model_type != "mixtral"
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        t, hidden = x.shape
        weights, experts = route(self.gate(x), self.top_k, self.renormalize, self.round_weights)
        order, offsets = sort_by_expert(experts, self.num_experts)
        grouped = ops.grouped_experts if isinstance(ops, GroupedExpertsOps) else grouped_experts
        out = grouped(
            x, order // self.top_k, offsets, self.experts.gate_up_proj, self.experts.down_proj
        )
        weighted = out * weights.flatten()[order, None]
        pairs = torch.empty_like(weighted)
        pairs[order] = weighted
        return pairs.view(t, self.top_k, hidden).sum(dim=1).to(x.dtype)


_EXPERT_WEIGHT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_PARTS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", 0),  # Mixtral's names
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
}
"""A per-expert checkpoint tensor's place: the stacked parameter, and which half of its rows
(gate, up) or all of them (None)."""


class MoeCausalLM(LlamaForCausalLM):
    """Qwen3-MoE (Qwen3 attention with Q/K norm; dense MLPs in cfg.dense_layers) and Mixtral
    (Llama attention; every layer sparse)."""

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return SparseMoeBlock(cfg) if cfg.is_sparse_layer(layer) else MLP(cfg)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As CausalLM's, plus expert weights: stacked ones load under their own names,
        per-expert ones (Qwen3-MoE's experts.N.gate_proj, Mixtral's block_sparse_moe.experts.N.w1)
        into their expert's slice; a stacked parameter counts as loaded once every slice is."""
        params = dict(self.named_parameters())
        filled: defaultdict[str, set[tuple[int, int | None]]] = defaultdict(set)

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
                match = _EXPERT_WEIGHT.fullmatch(name)
                if match is None:
                    yield name, tensor
                    continue
                self._load_expert(name, match, tensor, params, filled)

        loaded = super().load_weights(others())
        cfg = self.config
        for target, slices in filled.items():
            halves = 2 if target.endswith("gate_up_proj") else 1
            if len(slices) == cfg.num_experts * halves:
                loaded.add(target)
        return loaded

    def _load_expert(
        self,
        name: str,
        match: re.Match[str],
        tensor: torch.Tensor,
        params: dict[str, nn.Parameter],
        filled: defaultdict[str, set[tuple[int, int | None]]],
    ) -> None:
        layer, expert, part = match[1], int(match[2]), match[3]
        stacked, half = _EXPERT_PARTS.get(part, ("", None))
        target = f"layers.{layer}.mlp.experts.{stacked}"
        param = params.get(target)
        if param is None or expert >= self.config.num_experts:
            raise ValueError(f"unexpected weight {name!r} for a {self.config.model_type} model")
        view = param.data[expert]
        if half is not None:
            size = self.config.moe_intermediate_size
            view = view.narrow(0, half * size, size)
        if tuple(view.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(view.shape)}"
            )
        view.copy_(tensor)
        filled[target].add((expert, half))

    def expected_weight_names(self) -> set[str]:
        names = super().expected_weight_names()
        for n in range(self.config.num_hidden_layers):
            if self.config.is_sparse_layer(n):
                p = f"layers.{n}.mlp."
                names -= {f"{p}{x}_proj.weight" for x in ("gate", "up", "down")}
                names |= {f"{p}gate.weight", f"{p}experts.gate_up_proj", f"{p}experts.down_proj"}
        return names

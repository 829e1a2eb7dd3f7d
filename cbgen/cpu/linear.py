"""CPU matmuls beside the C kernels: oneDNN's packed float32 matmul (a weight reordered once
for it), whether bf16 matmuls are native here, and the exact LM heads: tokens of the float32
head from a bfloat16 copy (where the CPU has bf16 dot products) or an int16 copy (AVX2).
Which matmul serves which rows is the runtime's choice (cbgen.runtime.cpu_linear)."""

from __future__ import annotations

import torch

from cbgen.cpu import head_kernels
from cbgen.cpu.features import kernel_cpu


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered once for oneDNN's CPU matmul (1.2-1.8x faster than the default
    BLAS path at every batch size measured, 1 to 2048 tokens)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def bf16_matmul_supported() -> bool:
    """oneDNN runs bfloat16 matmuls here, natively or emulated (any AVX-512 CPU)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return onednn_packing_available() and check is not None and bool(check())


def bf16_matmul_fast() -> bool:
    """oneDNN runs bfloat16 matmuls natively here, at about twice the float32 rate: the CPU has
    bf16 dot products (AVX512_BF16 or AMX-BF16). oneDNN's own check is also true where it
    emulates them, and there a bf16 head is about 3x slower than the float32 one. The flags
    are those CBGEN_CPU_ISA leaves (features.kernel_cpu)."""
    return kernel_cpu().bf16_dot and bf16_matmul_supported()


class ExactHead:
    """The LM head with the tokens of the float32 head, from cheaper logits: greedy rows get
    the argmax of the float32 logits, sampled rows a draw from their softmax, from logits with
    a proven error bound plus float32 recomputes of a few tokens (cbgen/cpu/csrc/head_select.h
    has the bound and the rejection step). Subclasses make the cheap logits: Bf16Head where the
    CPU has bf16 dot products, Int16Head (AVX2) where it does not."""

    MIN_TEMPERATURE = 0.25
    """Sampled rows below this temperature take the float32 head: a proposal is accepted with
    probability about exp(-bound / T), and the bound (~0.5 on SmolLM2's likely tokens with bf16)
    would have them retry too often."""

    MAX_ATTEMPTS = 1000
    """Rejected proposals after which a row takes the float32 head."""

    ROUNDING = 0.0
    """b of the bound: the relative error of the cheap logits' last roundings."""

    DESCRIPTION = ""
    """What the start-up line calls it."""

    def __init__(self, weight: torch.Tensor) -> None:
        hidden = weight.shape[1]
        self.weight = weight
        up = 1 + 1e-6  # norms rounded up
        self.norms = (weight.double().norm(dim=1) * up).float()
        f32_unit = 2.0**-24
        # g: float32 accumulation over a row (slack for blocked sums); m: 25 % margin for the
        # bound's own float arithmetic; b: the cheap logits' rounding
        g = (hidden + 32) * f32_unit / (1 - (hidden + 32) * f32_unit)
        self.bound = (g, 1.25, self.ROUNDING, 1e-5)
        self.last_candidates = 0
        """The most candidates a greedy row needed in the last call (a diagnostic)."""

    def __call__(
        self, hidden: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
    ) -> torch.Tensor:
        """Token ids [M] (int64) for hidden [M, hidden] float32, temperature [M] (0: greedy,
        else >= MIN_TEMPERATURE) and seeds [M] int64 (a sampled row's draw depends only on its
        logits and seed); -1 for a row that must take the float32 head (a value not finite,
        or MAX_ATTEMPTS proposals rejected)."""
        raise NotImplementedError


class Bf16Head(ExactHead):
    """The exact head from a bfloat16 copy through oneDNN: about half the cost of the float32
    head on a CPU with bf16 dot products."""

    UNIT = 2.0**-8
    """bfloat16 unit roundoff (8 significant bits, round to nearest)."""

    ROUNDING = 1.25 * 2 * UNIT / (1 - 2 * UNIT)
    """The result rounded to bf16 (a whole ulp allowed)."""

    DESCRIPTION = "bf16 logits, exact (float32 recomputes)"

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        w16 = weight.to(torch.bfloat16)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w16, 64)
        up = 1 + 1e-6
        self.residual_norms = ((w16.double() - weight.double()).norm(dim=1) * up).float()

    def __call__(
        self, hidden: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
    ) -> torch.Tensor:
        hidden16 = hidden.to(torch.bfloat16)
        logits = packed_linear(hidden16, self.packed, None)
        weights = (self.weight, self.residual_norms, self.norms)
        tokens, self.last_candidates = head_kernels.head_bf16(
            logits, hidden, hidden16, *weights, self.bound, temperature, seeds, self.MAX_ATTEMPTS
        )
        return tokens


class Int16Head(ExactHead):
    """The exact head from an int16 copy (each row scaled to integers, cbgen/cpu/csrc/
    int16_head.c), for CPUs without bf16 dot products: vpmaddwd makes twice the multiply-adds of
    a float32 FMA per instruction, and the copy is half the float32 head to stream. Needs the
    kernels' int16 head (head_kernels.head_i16_available: x86-64 with AVX2)."""

    ROUNDING = 1.25 * 4 * 2.0**-24
    """The int32 sum converted to float32 and scaled twice: three float32 roundings, with slack."""

    DESCRIPTION = "int16 logits, exact (float32 recomputes)"

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        self.packed = head_kernels.head_i16_pack(weight)
        self.padded_norms = torch.zeros(self.packed[2].shape)
        self.padded_norms[: self.norms.numel()] = self.norms
        self.scratch = torch.empty(0, dtype=torch.float32)
        """The upper bounds, reused by every call (grown as batches grow)."""

    def __call__(
        self, hidden: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
    ) -> torch.Tensor:
        need = head_kernels.head_i16_scratch(hidden.shape[0], self.weight.shape[0])
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=torch.float32)
        tokens, self.last_candidates = head_kernels.head_i16(
            hidden,
            self.packed,
            self.weight,
            self.padded_norms,
            self.bound,
            temperature,
            seeds,
            self.MAX_ATTEMPTS,
            self.scratch,
        )
        return tokens

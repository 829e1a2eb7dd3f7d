/* The gated MLP activations, lane by lane in vexp.h's vn: act(gate) * up. Shared by the
 * activation pass over a gate-up product (activation.c) and the gate-up matmul that applies
 * them to its tiles (small_gemm.c), so both give the same bits. */
#ifndef CBGEN_GATED_H
#define CBGEN_GATED_H

#include "vexp.h"

/* In vexp.h's vn, the vector an ISA holds in one register (16 floats with AVX-512, else 8):
 * the activation is lane-wise, so the width changes no result. */
static inline vn silu_mul_vn(vn g, vn u) {
    const ivn neg = (ivn)(g < 0.0f);
    const vn a = (vn)((ivn)g & 0x7fffffff); /* |g| */
    const vn e = exp_vn(-a);
    const vn num = (vn)(((ivn)(g * e) & neg) | ((ivn)g & ~neg));
    return num / (1.0f + e) * u;
}

/* GeGLU's GELU in its tanh form, written as a sigmoid: 0.5 g (1 + tanh(z / 2)) = g / (1 + exp(-z))
 * with z = 2 sqrt(2 / pi) (g + 0.044715 g^3); the same stable split as silu_mul_vn, so it never
 * overflows and keeps its relative precision in the far negative tail, where torch's
 * 0.5 g (1 + tanh(...)) cancels to 0. Agrees with torch's F.gelu(approximate="tanh") to a few
 * ulp elsewhere. */
static inline vn gelu_tanh_mul_vn(vn g, vn u) {
    const vn z = 1.5957691216057308f * (g + 0.044715f * (g * g * g));
    const ivn neg = (ivn)(z < 0.0f);
    const vn a = (vn)((ivn)z & 0x7fffffff); /* |z| */
    const vn e = exp_vn(-a);
    const vn num = (vn)(((ivn)(g * e) & neg) | ((ivn)g & ~neg));
    return num / (1.0f + e) * u;
}

/* activation.c: the activation over a tile of 32 columns, with activation.c's bits */
void cbgen_gated_tile(const float *g, const float *u, int64_t rows, int act, float *y,
                      int64_t ldy);

#endif

/* Sixteen-float vectors, a lane-wise max and a vectorised exp for x <= 0, shared by the attention kernel's
 * softmax and the MLP's SiLU. GCC vector extensions: the same code builds for AVX2 (two
 * registers) and AVX-512 (one). */
#ifndef CBGEN_VEXP_H
#define CBGEN_VEXP_H
#include <stdint.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t i16v __attribute__((vector_size(64)));

/* Lane-wise a > b ? a : b (C has no vector conditional); a NaN lane of either yields b's. */
static inline v16 vmax16(v16 a, v16 b) {
    const i16v gt = a > b;
    return (v16)(((i16v)a & gt) | ((i16v)b & ~gt));
}

/* exp(x) for x <= 0 (a score minus its row's maximum): Cody-Waite reduction by ln 2 and a
 * degree-6 polynomial (the Cephes expf coefficients), within 3 ulp of expf; 0 below -87.33. */
static inline v16 exp_nonpositive(v16 x) {
    const i16v n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i16v); /* rounds x log2(e) for x <= 0 */
    const v16 nf = __builtin_convertvector(n, v16);
    v16 r = x - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    i16v bits = (i16v)p + (n << 23);
    bits &= ~(i16v)(x < -87.33f); /* below, the result would leave the normal range; NaN stays NaN */
    return (v16)bits;
}

#endif

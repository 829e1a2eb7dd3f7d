/* float32 -> bfloat16 rounding shared by the kernels that write or multiply bf16 (the K/V
 * cache's writes, the bf16 matmuls' rows, the bf16 prefill attention's queries and
 * probabilities): one definition, torch's rounding. */
#ifndef CBGEN_BF16_ROUND_H
#define CBGEN_BF16_ROUND_H
#include <stdint.h>
#include <string.h>

/* float32 -> bfloat16, rounded to nearest even (a NaN stays a NaN), as torch converts. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* A row of x [K] as K2 bf16 pairs (the low half k, the high half k + 1; 0 past K): the operand
 * vdpbf16ps broadcasts. */
static inline void round_pairs(const float *x, int64_t K, int64_t K2, uint32_t *xp) {
    for (int64_t k2 = 0; k2 < K2; ++k2) {
        const uint32_t lo = to_bf16(x[2 * k2]);
        const uint32_t hi = 2 * k2 + 1 < K ? to_bf16(x[2 * k2 + 1]) : 0;
        xp[k2] = lo | hi << 16;
    }
}
#endif

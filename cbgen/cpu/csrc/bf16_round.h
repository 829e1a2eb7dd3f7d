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

#if defined(__AVX512F__)
#include <immintrin.h>

/* to_bf16 on 16 floats at once, the same integer steps (the same bits), in 32-bit lanes. */
static inline __m512i to_bf16_16(__m512i u) {
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_blend_epi32(nan, r, q);
}
#endif

/* A row of x [K] as K2 bf16 pairs (the low half k, the high half k + 1; 0 past K): the operand
 * vdpbf16ps broadcasts. With AVX-512, 32 values a step (the scalar loop took 4 % of a bf16
 * chat run). */
static inline void round_pairs(const float *x, int64_t K, int64_t K2, uint32_t *xp) {
    int64_t k2 = 0;
#if defined(__AVX512F__)
    for (; 2 * k2 + 32 <= K; k2 += 16) {
        const __m512i a = to_bf16_16(_mm512_loadu_si512(x + 2 * k2));
        const __m512i b = to_bf16_16(_mm512_loadu_si512(x + 2 * k2 + 16));
        /* 16-bit halves in order: pair k2 = value 2 k2 (low) | value 2 k2 + 1 (high) */
        _mm256_storeu_si256((__m256i *)(xp + k2), _mm512_cvtepi32_epi16(a));
        _mm256_storeu_si256((__m256i *)(xp + k2 + 8), _mm512_cvtepi32_epi16(b));
    }
#endif
    for (; k2 < K2; ++k2) {
        const uint32_t lo = to_bf16(x[2 * k2]);
        const uint32_t hi = 2 * k2 + 1 < K ? to_bf16(x[2 * k2 + 1]) : 0;
        xp[k2] = lo | hi << 16;
    }
}
#endif

/* Vectors of 8 and 16 floats, a lane-wise max and a vectorised exp for x <= 0, shared by the
 * attention kernels' softmax, the MLP's SiLU and the sampler. GCC vector extensions, so the same
 * code builds for AVX-512, AVX2 and other ISAs. On AVX2, GCC lowers a compare of 16-lane
 * vectors (the exp's underflow mask, the max) to one scalar compare and move per lane, which
 * made the exp several times slower than its arithmetic: there the 16-lane functions run as two
 * 8-lane halves. */
#ifndef CBGEN_VEXP_H
#define CBGEN_VEXP_H
#include <stdint.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t i8v __attribute__((vector_size(32)));

/* The body of exp(x) for x <= 0 (a score minus its row's maximum) in vectors of type V with
 * lanes of integer type I: Cody-Waite reduction by ln 2 and a degree-6 polynomial (the Cephes
 * expf coefficients), within 3 ulp of expf; 0 below -87.33. NaN stays NaN. */
#define CBGEN_EXP_NONPOSITIVE(V, I, x)                                                         \
    do {                                                                                       \
        const I n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, I); /* rounds */ \
        const V nf = __builtin_convertvector(n, V);                                            \
        V r = x - nf * 0.693359375f;                                                           \
        r = r - nf * -2.12194440e-4f;                                                          \
        V p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                         \
        p = p * r + 8.3334519073e-3f;                                                          \
        p = p * r + 4.1665795894e-2f;                                                          \
        p = p * r + 1.6666665459e-1f;                                                          \
        p = p * r + 5.0000001201e-1f;                                                          \
        p = p * (r * r) + r + 1.0f;                                                            \
        I bits = (I)p + (n << 23);                                                             \
        bits &= ~(I)(x < -87.33f); /* below, the result would leave the normal range */       \
        return (V)bits;                                                                        \
    } while (0)

static inline v8 exp8(v8 x) { CBGEN_EXP_NONPOSITIVE(v8, i8v, x); }

/* Lane-wise a > b ? a : b (C has no vector conditional); a NaN lane of either yields b's. */
#if defined(__AVX2__)
#include <immintrin.h>
static inline v8 vmax8(v8 a, v8 b) { return (v8)_mm256_max_ps((__m256)a, (__m256)b); }
#else
static inline v8 vmax8(v8 a, v8 b) {
    const i8v gt = a > b;
    return (v8)(((i8v)a & gt) | ((i8v)b & ~gt));
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* A 16-float vector as the two 8-float registers AVX2 holds it in: the 16-lane functions below
 * work on the halves, the same arithmetic lane by lane, so results do not depend on the ISA. */
#define CBGEN_V16_HALVES 1
typedef union {
    v16 v;
    v8 h[2];
} v16_halves;
#endif

static inline v16 vmax16(v16 a, v16 b) {
#ifdef CBGEN_V16_HALVES
    v16_halves x = {.v = a}, y = {.v = b};
    x.h[0] = vmax8(x.h[0], y.h[0]);
    x.h[1] = vmax8(x.h[1], y.h[1]);
    return x.v;
#else
    const i16v gt = a > b;
    return (v16)(((i16v)a & gt) | ((i16v)b & ~gt));
#endif
}

static inline v16 exp_nonpositive(v16 x) {
#ifdef CBGEN_V16_HALVES
    v16_halves r = {.v = x};
    r.h[0] = exp8(r.h[0]);
    r.h[1] = exp8(r.h[1]);
    return r.v;
#else
    CBGEN_EXP_NONPOSITIVE(v16, i16v, x);
#endif
}

/* The vector one register holds, for lane-wise loops whose results do not depend on it. */
#if defined(__AVX512F__)
#define VN 16
typedef v16 vn;
typedef v16u vnu;
typedef i16v ivn;
static inline vn exp_vn(vn x) { return exp_nonpositive(x); }
static inline vn vmax_vn(vn a, vn b) { return vmax16(a, b); }
#else
#define VN 8
typedef v8 vn;
typedef v8u vnu;
typedef i8v ivn;
static inline vn exp_vn(vn x) { return exp8(x); }
static inline vn vmax_vn(vn a, vn b) { return vmax8(a, b); }
#endif

#endif

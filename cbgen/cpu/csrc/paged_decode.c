/* Paged decode attention for the CPU, float32: one query token per sequence, read straight
 * from the block table (no gathered copy of K/V).
 *
 *   q            [B, H, D], row b at q + b * q_stride (the heads of a row packed: a slice of
 *                the fused QKV projection's rows is read in place)
 *   out          [B, H, D]                  contiguous
 *   k_cache      [num_blocks, bs, Hkv, D]   contiguous (kv_cache[0] of one layer), float32
 *                (cbgen_paged_decode_f32) or bfloat16 (cbgen_paged_decode_bf16kv: each element
 *                widened to float32 as it is loaded, then the float32 kernel's arithmetic)
 *   v_cache      [num_blocks, bs, Hkv, D]   contiguous (kv_cache[1] of one layer), likewise
 *   block_table  [B, bt_stride] int32; token t of sequence b is at
 *                block block_table[b][t / bs], offset t % bs
 *   seq_lens     [B] int32; sequence b attends to tokens [0, seq_lens[b])
 *   window       > 0: only to the last `window` of them, [seq_lens[b] - window, seq_lens[b])
 *                (a sliding window; its query sits at seq_lens[b] - 1); 0: all
 *   softcap      > 0: each score s (after scale) becomes softcap * tanh(s / softcap); 0: none
 *
 * Keys are read from the block of the window's first key on: the blocks before are never
 * touched (they may belong to another sequence by now), so a decode costs O(window).
 *
 * Work item = (sequence, a range of KV heads): a whole batch of decodes is one item per
 * sequence, so each block is read as one contiguous run of bs * Hkv * D floats. The KV heads
 * are split into ranges only when there are too few sequences to keep every thread busy. The
 * G = H / Hkv query heads of a group share every K/V row they read. Softmax is exact
 * (max-subtracted, normalised at the end); its exponentials are a vectorised polynomial.
 *
 * Cold caches are the normal case (a step touches every layer's KV once), so the kernel is
 * as fast as its memory reads. Blocks sit anywhere in the cache, which the hardware
 * prefetchers cannot guess: the kernel walks its reads in order (K blocks, then V blocks,
 * then the first K blocks of the item it takes next) and prefetches two blocks ahead a slice
 * at a time, between the query heads' passes over the current block. Issuing a whole block's
 * prefetches at once stalls on the miss buffers; spread out, the reads overlap the arithmetic.
 */
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cbgen.h"
#include "vexp.h" /* v16, exp_nonpositive */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_HEADS 1024

/* Eight floats: GCC vector extensions, so the same code builds for AVX2 and AVX-512. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));

static inline float hsum8(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* fmaxf(m, s) for an m that is never NaN (a NaN s leaves m), inline: without finite-math,
 * GCC calls libm's fmaxf for every score */
static inline float max_score(float m, float s) { return s > m ? s : m; }

/* s[t] = exp(s[t] - m) for t < n; returns their sum */
static float exp_sub_sum(float *s, int64_t n, float m) {
    v16 acc = {0};
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        const v16 e = exp_nonpositive(*(v16u *)(s + t) - m);
        *(v16u *)(s + t) = e;
        acc += e;
    }
    v16 x;
    for (int i = 0; i < 16; ++i) x[i] = t + i < n ? s[t + i] - m : -INFINITY;
    const v16 e = exp_nonpositive(x);
    for (int i = 0; t + i < n; ++i) s[t + i] = e[i];
    acc += e; /* lanes past n are exp(-inf) = 0 */
    float a = 0.0f;
    for (int i = 0; i < 16; ++i) a += acc[i];
    return a;
}

/* the softmax's exponentials on their own, for the tests */
float cbgen_exp_sub_sum_f32(float *s, int64_t n, float m) { return exp_sub_sum(s, n, m); }

/* The first key sequence b attends to: seq_len - window under a window, else 0. */
static inline int64_t first_key(int64_t seq_len, int64_t window) {
    return window > 0 && seq_len > window ? seq_len - window : 0;
}

/* s = c * tanh(s / c) for n scores; returns their new max (tanh keeps the order) */
static float softcap_scores(float *s, int64_t n, float c, float mx) {
    const float inv = 1.0f / c;
    for (int64_t t = 0; t < n; ++t) s[t] = c * tanhf(s[t] * inv);
    return c * tanhf(mx * inv);
}

/* FN(name): name with the instance's suffix (name_f32, name_bf16) */
#define FN__(x, s) x##_##s
#define FN_(x, s) FN__(x, s)
#define FN(x) FN_(x, KVSUF)
#define AHEAD 2 /* blocks the prefetching runs ahead of the reads */

static inline v8 widen8(const uint16_t *p) {
    typedef uint16_t h8 __attribute__((vector_size(16)));
    typedef uint32_t w8 __attribute__((vector_size(32)));
    h8 h;
    memcpy(&h, p, sizeof h);
    const w8 w = __builtin_convertvector(h, w8) << 16;
    v8 f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__AVX512F__)
static inline __m512 widen16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The transposing reduction of qk16_d64 (both instances, grouped or not): four tokens' 16-wide
 * partial sums a0..a3 to their four sums in every 128-bit lane (pairs, then quads). */
static inline __m512 quad_sums(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 b0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 b1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512d x = _mm512_castps_pd(b0), y = _mm512_castps_pd(b1);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

/* ... and its end: the four 128-bit lanes of c[0..3] added (token t in lane t), scaled, stored
 * to dst[0..16), the running maximum *mx raised. */
static inline void scores16(const __m512 c[4], float scale, float *dst, float *mx) {
    const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
    const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
    __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xdd));
    r = _mm512_mul_ps(r, _mm512_set1_ps(scale));
    _mm512_storeu_ps(dst, r);
    const float m = _mm512_reduce_max_ps(r);
    if (m > *mx) *mx = m;
}
#endif

#define KV_T float
#define KVSUF f32
#define LOAD8(p) (*(const v8u *)(p))
#define LOAD16(p) _mm512_loadu_ps(p)
#define TOF(x) (x)
#define LINE 16
#define KERNEL_NAME cbgen_paged_decode_f32
#define GROUPED 0
#include "paged_decode_kv.h"
#undef KV_T
#undef KVSUF
#undef LOAD8
#undef LOAD16
#undef TOF
#undef LINE
#undef KERNEL_NAME
#undef GROUPED

#define KV_T uint16_t
#define KVSUF bf16
#define LOAD8(p) widen8(p)
#define LOAD16(p) widen16(p)
#define TOF(x) bf16_to_f32(x)
#define LINE 32
#define KERNEL_NAME cbgen_paged_decode_bf16kv
#define GROUPED 1
#include "paged_decode_kv.h"

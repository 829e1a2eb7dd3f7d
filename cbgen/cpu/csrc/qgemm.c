/* Matmuls over GGUF-quantized weights, executed in their own blocks: y[M, N] = x[M, K] @ W^T
 * (+ bias), x, y and the bias float32, W in one of the ggml block types below. x is quantized
 * per row to 8-bit blocks of 32 (scale dx = max|x| / 127, q = x / dx rounded to nearest even,
 * the block's sum sx and the sum of its first 16, sl), and each weight sub-block's integer dot
 * product with x's block is scaled in float32:
 *
 *   type  file block (weights)                   weight value        sub-block  min
 *   Q8_0  d, 32 int8 (32)                          d q                32         -
 *   Q4_0  d, 16 bytes of nibbles (32)              d (q - 8)          32         -
 *   Q4_1  d, m, 16 bytes (32)                      d q + m            32         m
 *   Q5_0  d, 32 high bits, 16 bytes (32)           d (q - 16)         32         -
 *   Q5_1  d, m, high bits, 16 bytes (32)           d q + m            32         m
 *   Q4_K  d, dmin, 6-bit scales and mins, (256)    d sc_j q - dmin m_j 32        dmin m_j
 *   Q5_K  the same and 256 high bits (256)         d sc_j q - dmin m_j 32        dmin m_j
 *   Q6_K  4 + 2 bits, 16 int8 scales, d (256)      d sc_j (q - 32)    16         -
 *
 * (d, m, dmin fp16; q the stored unsigned value). Per sub-block j of a column and x's block
 * b, with isum = sum_k q_k qx_k exact in int32 less the type's offset times x's sum over the
 * sub-block:
 *
 *   acc = fma(float(isum), s_j dx_b, acc)      s_j = d, or d sc_j for the K-quants (exact)
 *   acc = fma(m, dx_b sx_b, acc)               Q4_1, Q5_1
 *   acc = fma(-(dmin m_j), dx_b sx_b, acc)     Q4_K, Q5_K
 *
 * in that order, sub-blocks in k order. Every path (AVX512-VNNI, AVX2, the scalar reference)
 * computes the same integers and the same float32 operations in the same order (the fused
 * multiply-adds written out, no other contraction: the file is built with -ffp-contract=off),
 * so the reference (cbgen_q_gemm with ref = 1, and tests/ NumPy) gives their bits exactly.
 *
 * The weight is repacked once into panels of 16 output columns, file block by file block:
 *
 *   header:  d[16] fp16 | (a min) m or dmin[16] fp16 | (K) scales[subs][16]
 *            | (Q4_K, Q5_K) mins[8][16]
 *   then per group of 32 weights:
 *     4-bit and more: 4 runs of 64 bytes, run r byte 4 j + t = column j's k = 8 r + t (low
 *                     nibble) and k = 8 r + 4 + t (high nibble); then per bit above the
 *                     fourth, per run, a 64-bit mask of the low nibbles' and one of the high
 *                     nibbles' bits (bit i for byte i)
 *     8-bit:          8 runs of 64 bytes, run r byte 4 j + t = column j's k = 4 r + t
 *
 * so a 64-byte load holds four consecutive k of each of the 16 columns, the operand of one
 * AVX512-VNNI vpdpbusd against four of x's values broadcast, the high bits going in with one
 * masked byte add. Weights are kept unsigned (Q8_0's q + 128, an offset like Q4_0's 8), so one
 * unsigned-by-signed dot product serves every type. The panel holds the file's bytes (the
 * K-quants' packed 6-bit scales unpacked to bytes: 148 bytes a column of 256 for Q4_K's 144).
 * AVX2 builds take the same layout 8 columns at a time with vpmaddubsw + vpmaddwd.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cbgen.h"
#include "thread_buffer.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QISA 1
#else
#define QISA 0
#endif

#define QK 32    /* weights per group (x's block) */
#define QCOLS 16 /* output columns per packed panel */
#define RMAX 8   /* rows of a register tile */

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

typedef struct {
    int bits;  /* stored bits a weight: 4, 5, 6 or 8 */
    int off;   /* subtracted from every stored value (types without a min) */
    int min;   /* 1: + m (Q4_1, Q5_1); 2: - dmin m_j (Q4_K, Q5_K) */
    int super; /* weights a file block: 32, or 256 (K-quants) */
    int sub;   /* weights a scale: 32, or 16 (Q6_K) */
    int kq;    /* integer scales per sub-block under the block's d */
    int file;  /* bytes of a file block */
} qtype;

static const qtype T_Q4_0 = {4, 8, 0, 32, 32, 0, 18}, T_Q4_1 = {4, 0, 1, 32, 32, 0, 20},
                   T_Q5_0 = {5, 16, 0, 32, 32, 0, 22}, T_Q5_1 = {5, 0, 1, 32, 32, 0, 24},
                   T_Q8_0 = {8, 128, 0, 32, 32, 0, 34}, T_Q4_K = {4, 0, 2, 256, 32, 1, 144},
                   T_Q5_K = {5, 0, 2, 256, 32, 1, 176}, T_Q6_K = {6, 32, 0, 256, 16, 1, 210};

static int qtype_of(int type, qtype *t) {
    static const qtype *const Q[] = {
        [Q4_0] = &T_Q4_0, [Q4_1] = &T_Q4_1, [Q5_0] = &T_Q5_0, [Q5_1] = &T_Q5_1,
        [Q8_0] = &T_Q8_0, [Q4_K] = &T_Q4_K, [Q5_K] = &T_Q5_K, [Q6_K] = &T_Q6_K,
    };
    if (type < 0 || type > Q6_K || !Q[type]) return 0;
    *t = *Q[type];
    return 1;
}

/* A tile function's body inlined once per type with that type's constant descriptor (and once
 * more for one row, decode's case), so that the compiler folds every field the loops test and
 * unrolls them by their constant trip counts; the operations and their order are the same, so
 * the bits are too. A type is known by its bits and min. */
#define BOTH(BODY, T, R, ...)                                                                  \
    do {                                                                                       \
        if ((R) == 1)                                                                          \
            BODY(&T, 1, __VA_ARGS__);                                                          \
        else if ((R) == RMAX)                                                                  \
            BODY(&T, RMAX, __VA_ARGS__);                                                       \
        else                                                                                   \
            BODY(&T, R, __VA_ARGS__);                                                          \
    } while (0)
#define DISPATCH(BODY, t, R, ...)                                                              \
    switch ((t)->bits * 4 + (t)->min) {                                                        \
    case 16: BOTH(BODY, T_Q4_0, R, __VA_ARGS__); break;                                        \
    case 17: BOTH(BODY, T_Q4_1, R, __VA_ARGS__); break;                                        \
    case 18: BOTH(BODY, T_Q4_K, R, __VA_ARGS__); break;                                        \
    case 20: BOTH(BODY, T_Q5_0, R, __VA_ARGS__); break;                                        \
    case 21: BOTH(BODY, T_Q5_1, R, __VA_ARGS__); break;                                        \
    case 22: BOTH(BODY, T_Q5_K, R, __VA_ARGS__); break;                                        \
    case 24: BOTH(BODY, T_Q6_K, R, __VA_ARGS__); break;                                        \
    default: BOTH(BODY, T_Q8_0, R, __VA_ARGS__); break;                                        \
    }

int64_t cbgen_q_isa(void) { return QISA; }

static int64_t header_bytes(const qtype *t) {
    const int64_t subs = t->super / t->sub;
    return QCOLS * 2 * (t->min ? 2 : 1) + (t->kq ? QCOLS * subs * (t->min ? 2 : 1) : 0);
}

/* A group of 32 weights of 16 columns: nibble runs (or bytes) and the high bits' masks. */
static int64_t group_bytes(const qtype *t) {
    return t->bits == 8 ? 8 * 64 : 4 * 64 + (t->bits - 4) * 4 * 16;
}

/* One file block of 16 columns, packed. */
static int64_t super_bytes(const qtype *t) {
    return header_bytes(t) + t->super / QK * group_bytes(t);
}

int64_t cbgen_q_packed_bytes(int type, int64_t N, int64_t K) {
    qtype t;
    if (!qtype_of(type, &t) || N % QCOLS || K % t.super || K <= 0 || N <= 0) return -1;
    return N / QCOLS * (K / t.super) * super_bytes(&t);
}

/* The K-quants' 6-bit scale and min of sub-block j from their 12 packed bytes. */
static void scale_min_k4(int j, const uint8_t *s, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | (s[j - 4] >> 6) << 4;
        *mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

/* A file block: its stored values u (unsigned), d and the min (fp16 bits), the sub-blocks'
 * integer scales and mins. */
static void unpack_block(int type, const uint8_t *blk, uint8_t *u, uint16_t *d, uint16_t *m,
                         int *sc, int *mn) {
    *m = 0;
    switch (type) {
    case Q8_0:
        memcpy(d, blk, 2);
        for (int i = 0; i < 32; ++i) u[i] = (uint8_t)((int8_t)blk[2 + i] + 128);
        return;
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
        const int two = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
        memcpy(d, blk, 2);
        if (two) memcpy(m, blk + 2, 2);
        const uint8_t *p = blk + (two ? 4 : 2);
        uint32_t qh = 0;
        if (five) {
            memcpy(&qh, p, 4); /* little-endian, as the file stores it */
            p += 4;
        }
        for (int i = 0; i < 16; ++i) {
            u[i] = (uint8_t)((p[i] & 0x0F) | (five ? ((qh >> i) & 1) << 4 : 0));
            u[i + 16] = (uint8_t)((p[i] >> 4) | (five ? ((qh >> (i + 16)) & 1) << 4 : 0));
        }
        return;
    }
    case Q4_K:
    case Q5_K: {
        memcpy(d, blk, 2);
        memcpy(m, blk + 2, 2);
        for (int j = 0; j < 8; ++j) scale_min_k4(j, blk + 4, &sc[j], &mn[j]);
        const uint8_t *qh = blk + 16, *qs = blk + (type == Q5_K ? 48 : 16);
        for (int c = 0; c < 4; ++c)
            for (int l = 0; l < 32; ++l) {
                const uint8_t b = qs[32 * c + l];
                int lo = b & 0x0F, hi = b >> 4;
                if (type == Q5_K) {
                    lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                }
                u[64 * c + l] = (uint8_t)lo;
                u[64 * c + 32 + l] = (uint8_t)hi;
            }
        return;
    }
    case Q6_K: {
        const uint8_t *ql = blk, *qh = blk + 128;
        for (int j = 0; j < 16; ++j) sc[j] = (int8_t)blk[192 + j];
        memcpy(d, blk + 208, 2);
        for (int h = 0; h < 2; ++h)
            for (int l = 0; l < 32; ++l) {
                const uint8_t *a = ql + 64 * h, *b = qh + 32 * h;
                uint8_t *o = u + 128 * h;
                o[l] = (uint8_t)((a[l] & 0x0F) | ((b[l] >> 0) & 3) << 4);
                o[l + 32] = (uint8_t)((a[l + 32] & 0x0F) | ((b[l] >> 2) & 3) << 4);
                o[l + 64] = (uint8_t)((a[l] >> 4) | ((b[l] >> 4) & 3) << 4);
                o[l + 96] = (uint8_t)((a[l + 32] >> 4) | ((b[l] >> 6) & 3) << 4);
            }
        return;
    }
    }
}

/* w: the file's rows (N rows of K / super blocks each, in the file's block layout). */
int cbgen_q_pack(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    qtype t;
    if (cbgen_q_packed_bytes(type, N, K) < 0 || !qtype_of(type, &t)) return -1;
    const int64_t SB = K / t.super, sbb = super_bytes(&t), hb = header_bytes(&t);
    const int64_t gb = group_bytes(&t), subs = t.super / t.sub;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < N / QCOLS; ++p)
        for (int64_t s = 0; s < SB; ++s) {
            uint8_t *dst = out + (p * SB + s) * sbb;
            memset(dst, 0, (size_t)sbb);
            for (int j = 0; j < QCOLS; ++j) {
                const uint8_t *blk = w + ((p * QCOLS + j) * SB + s) * t.file;
                uint8_t u[256];
                uint16_t dh, mh;
                int sc[16], mn[16];
                unpack_block(type, blk, u, &dh, &mh, sc, mn);
                memcpy(dst + 2 * j, &dh, 2);
                if (t.min) memcpy(dst + QCOLS * 2 + 2 * j, &mh, 2);
                uint8_t *scales = dst + QCOLS * 2 * (t.min ? 2 : 1);
                if (t.kq)
                    for (int64_t i = 0; i < subs; ++i) {
                        scales[i * QCOLS + j] = (uint8_t)sc[i];
                        if (t.min) scales[(subs + i) * QCOLS + j] = (uint8_t)mn[i];
                    }
                for (int g = 0; g < t.super / QK; ++g) {
                    uint8_t *q = dst + hb + g * gb;
                    const uint8_t *ug = u + g * QK;
                    if (t.bits == 8) {
                        for (int r = 0; r < 8; ++r)
                            for (int e = 0; e < 4; ++e) q[r * 64 + 4 * j + e] = ug[4 * r + e];
                        continue;
                    }
                    for (int r = 0; r < 4; ++r)
                        for (int e = 0; e < 4; ++e) {
                            const int i = 4 * j + e, lo = ug[8 * r + e], hi = ug[8 * r + 4 + e];
                            q[r * 64 + i] = (uint8_t)((lo & 0x0F) | (hi & 0x0F) << 4);
                            for (int b = 0; b < t.bits - 4; ++b) {
                                uint8_t *mask = q + 256 + (b * 4 + r) * 16;
                                mask[i / 8] |= (uint8_t)(((lo >> (4 + b)) & 1) << (i % 8));
                                mask[8 + i / 8] |= (uint8_t)(((hi >> (4 + b)) & 1) << (i % 8));
                            }
                        }
                }
            }
        }
    return 0;
}

/* fp16 -> float32, exactly (the scales: no NaN or infinity expected, but kept as such). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) u = sign;
        else { /* subnormal: normalise */
            int e = -1;
            uint32_t m = man;
            do { ++e; m <<= 1; } while (!(m & 0x400));
            u = sign | (uint32_t)(127 - 15 - e) << 23 | (m & 0x3FF) << 13;
        }
    } else if (exp == 31) u = sign | 0x7F800000u | man << 13;
    else u = sign | (exp + 127 - 15) << 23 | man << 13;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* One block's scale d = max|x| / 127 and its inverse; every path computes them here, so that
 * the vector blocks round as the scalar one does. */
static inline void q8_scale(float amax, float *d, float *inv) {
    *d = amax / 127.0f;
    *inv = *d != 0.0f ? 1.0f / *d : 0.0f;
}

#if QISA == 1
static inline int32_t hsum8_epi32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}
#endif

/* One block of 32: q = x / d rounded to nearest even (nearbyintf, cvtps2dq: the default
 * rounding), its sum s and the sum l of its first 16. */
static inline void q8_block(const float *xb, int8_t *qb, float *d, int32_t *s, int32_t *l) {
    float inv;
#if QISA == 2
    const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
    q8_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))), d, &inv);
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vinv));
    const __m512i qb2 = _mm512_cvtps_epi32(_mm512_mul_ps(b, vinv));
    _mm_storeu_si128((__m128i *)qb, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(qb + 16), _mm512_cvtsepi32_epi8(qb2));
    *l = _mm512_reduce_add_epi32(qa);
    *s = *l + _mm512_reduce_add_epi32(qb2);
#elif QISA == 1
    const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        m = _mm256_max_ps(m, _mm256_and_ps(v[i], mask));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    q8_scale(_mm_cvtss_f32(h), d, &inv);
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i iq[4];
    for (int i = 0; i < 4; ++i) iq[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv));
    /* packs work within 128-bit lanes: dwords come out as 0 4 1 5 2 6 3 7 */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iq[0], iq[1]),
                                         _mm256_packs_epi32(iq[2], iq[3]));
    _mm256_storeu_si256((__m256i *)qb,
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *l = hsum8_epi32(_mm256_add_epi32(iq[0], iq[1]));
    *s = *l + hsum8_epi32(_mm256_add_epi32(iq[2], iq[3]));
#else
    float amax = 0.0f;
    for (int i = 0; i < QK; ++i) {
        const float a = fabsf(xb[i]);
        amax = a > amax ? a : amax;
    }
    q8_scale(amax, d, &inv);
    int32_t sum = 0;
    for (int i = 0; i < QK; ++i) {
        const int v = (int)nearbyintf(xb[i] * inv);
        qb[i] = (int8_t)v;
        sum += v;
        if (i == 15) *l = sum;
    }
    *s = sum;
#endif
}

/* x's rows quantized: per block of 32, q (int8), d = max|x| / 127, s = sum q and l = the sum
 * of its first 16 q. */
void cbgen_q8_quantize(const float *x, int64_t M, int64_t K, int8_t *q, float *d, int32_t *s,
                       int32_t *l) {
    const int64_t KB = K / QK;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < KB; ++b)
            q8_block(x + m * K + b * QK, q + m * K + b * QK, d + m * KB + b, s + m * KB + b,
                     l + m * KB + b);
}

/* x quantized, as the tiles read it. */
typedef struct {
    const int8_t *q;
    const float *d;
    const int32_t *s, *l;
    const float *ds; /* d (float)s: the min term's factor, once a block rather than once a panel */
    int64_t K, KB;   /* row strides of q and of d, s, l, ds */
} qrows;

/* x's sum over sub-block i of group b of a row (Q6_K: halves of 16). */
static inline int32_t sub_sum(const qrows *x, int64_t row, int64_t b, int sub, int i) {
    const int32_t s = x->s[row * x->KB + b];
    if (sub == QK) return s;
    const int32_t l = x->l[row * x->KB + b];
    return i ? s - l : l;
}

/* Column j's sub-block scale s_i of one packed block (d, or d sc_i), and (kq) its dmin m_i. */
static inline float sub_scale(const qtype *t, const uint8_t *hdr, int i, int j) {
    uint16_t dh;
    memcpy(&dh, hdr + 2 * j, 2);
    const float d = half_to_float(dh);
    if (!t->kq) return d;
    const uint8_t *scales = hdr + QCOLS * 2 * (t->min ? 2 : 1);
    const int sc = t->off ? (int)(int8_t)scales[i * QCOLS + j] : (int)scales[i * QCOLS + j];
    return d * (float)sc;
}

static inline float sub_min(const qtype *t, const uint8_t *hdr, int i, int j) {
    uint16_t mh;
    memcpy(&mh, hdr + QCOLS * 2 + 2 * j, 2);
    const float m = half_to_float(mh);
    if (!t->kq) return m;
    const int64_t subs = t->super / t->sub;
    return m * (float)hdr[QCOLS * 2 * 2 + (subs + i) * QCOLS + j];
}

/* Column j's stored value k (0..31) of a packed group. */
static inline int stored(const qtype *t, const uint8_t *q, int j, int k) {
    if (t->bits == 8) return q[(k / 4) * 64 + 4 * j + k % 4];
    const int r = k / 8, e = k % 4, hi = k % 8 >= 4, i = 4 * j + e;
    int v = hi ? q[r * 64 + i] >> 4 : q[r * 64 + i] & 0x0F;
    for (int b = 0; b < t->bits - 4; ++b)
        v |= ((q[256 + (b * 4 + r) * 16 + 8 * hi + i / 8] >> (i % 8)) & 1) << (4 + b);
    return v;
}

/* The float step after sub-block i of group b (every path: these operations, this order). */
static inline float sub_step(float acc, int32_t isum, float s, float dx) {
    return fmaf((float)isum, s * dx, acc);
}

/* The scalar reference (and the path of builds without AVX2): one column, one row. */
static float dot_ref(const qtype *t, const uint8_t *panel, int64_t SB, int j, const qrows *x,
                     int64_t row) {
    const int64_t sbb = super_bytes(t), hb = header_bytes(t), gb = group_bytes(t);
    const int groups = t->super / QK, per = QK / t->sub;
    float acc = 0.0f;
    for (int64_t s = 0; s < SB; ++s) {
        const uint8_t *hdr = panel + s * sbb;
        for (int g = 0; g < groups; ++g) {
            const int64_t b = s * groups + g;
            const uint8_t *q = hdr + hb + g * gb;
            const int8_t *qx = x->q + row * x->K + b * QK;
            const float dx = x->d[row * x->KB + b];
            for (int h = 0; h < per; ++h) {
                int32_t isum = 0;
                for (int k = h * t->sub; k < (h + 1) * t->sub; ++k)
                    isum += stored(t, q, j, k) * qx[k];
                isum -= t->off * sub_sum(x, row, b, t->sub, h);
                acc = sub_step(acc, isum, sub_scale(t, hdr, g * per + h, j), dx);
            }
            if (t->min) {
                const float dxs = dx * (float)x->s[row * x->KB + b];
                if (t->min == 1) acc = fmaf(sub_min(t, hdr, g, j), dxs, acc);
                else acc = fmaf(-sub_min(t, hdr, g, j), dxs, acc);
            }
        }
    }
    return acc;
}

#if QISA == 2
/* AVX512-VNNI: a tile of R rows x the panel's 16 columns. */
static inline __attribute__((always_inline)) void tile_vnni_body(
    const qtype *t, int R, const uint8_t *panel, int64_t SB, const qrows *x, int64_t row0,
    float *y, int64_t ldy, const float *bias) {
    const int64_t sbb = super_bytes(t), hb = header_bytes(t), gb = group_bytes(t);
    const int groups = t->super / QK, per = QK / t->sub, subs = t->super / t->sub;
    const int runs = t->bits == 8 ? 8 : 4, per_sub = runs / per;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[RMAX];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < SB; ++s) {
        const uint8_t *hdr = panel + s * sbb;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hdr));
        const __m512 m =
            t->min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hdr + 32))) : d;
        const uint8_t *scales = hdr + QCOLS * 2 * (t->min ? 2 : 1);
        for (int g = 0; g < groups; ++g) {
            const int64_t b = s * groups + g;
            const uint8_t *q = hdr + hb + g * gb;
            for (int h = 0; h < per; ++h) {
                const int i = g * per + h;
                __m512 sc = d;
                if (t->kq) {
                    const __m128i raw = _mm_loadu_si128((const __m128i *)(scales + i * QCOLS));
                    const __m512i wide =
                        t->off ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
                    sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(wide));
                }
                __m512i is[RMAX];
                for (int r = 0; r < R; ++r) /* the offset's share, subtracted up front */
                    is[r] = _mm512_set1_epi32(-t->off * sub_sum(x, row0 + r, b, t->sub, h));
                for (int run = h * per_sub; run < (h + 1) * per_sub; ++run) {
                    const __m512i v = _mm512_loadu_si512(q + run * 64);
                    if (t->bits == 8) {
                        for (int r = 0; r < R; ++r) {
                            int32_t x0;
                            memcpy(&x0, x->q + (row0 + r) * x->K + b * QK + 4 * run, 4);
                            is[r] = _mm512_dpbusd_epi32(is[r], v, _mm512_set1_epi32(x0));
                        }
                        continue;
                    }
                    __m512i lo = _mm512_and_si512(v, low4);
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                    for (int bit = 0; bit < t->bits - 4; ++bit) {
                        const uint8_t *mk = q + 256 + (bit * 4 + run) * 16;
                        uint64_t ml, mh;
                        memcpy(&ml, mk, 8);
                        memcpy(&mh, mk + 8, 8);
                        const __m512i add = _mm512_set1_epi8((char)(16 << bit));
                        lo = _mm512_mask_add_epi8(lo, (__mmask64)ml, lo, add);
                        hi = _mm512_mask_add_epi8(hi, (__mmask64)mh, hi, add);
                    }
                    for (int r = 0; r < R; ++r) {
                        const int8_t *xr = x->q + (row0 + r) * x->K + b * QK + 8 * run;
                        int32_t x0, x1;
                        memcpy(&x0, xr, 4);
                        memcpy(&x1, xr + 4, 4);
                        is[r] = _mm512_dpbusd_epi32(is[r], lo, _mm512_set1_epi32(x0));
                        is[r] = _mm512_dpbusd_epi32(is[r], hi, _mm512_set1_epi32(x1));
                    }
                }
                for (int r = 0; r < R; ++r) {
                    const __m512 dxr = _mm512_set1_ps(x->d[(row0 + r) * x->KB + b]);
                    const __m512 tt = _mm512_mul_ps(sc, dxr);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), tt, acc[r]);
                }
            }
            if (t->min) {
                __m512 mv = m;
                if (t->kq) {
                    const __m128i raw =
                        _mm_loadu_si128((const __m128i *)(scales + (subs + g) * QCOLS));
                    mv = _mm512_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(raw)));
                }
                for (int r = 0; r < R; ++r) {
                    const int64_t k = (row0 + r) * x->KB + b;
                    const __m512 dxs = _mm512_set1_ps(x->ds[k]);
                    if (t->min == 1) acc[r] = _mm512_fmadd_ps(mv, dxs, acc[r]);
                    else acc[r] = _mm512_fnmadd_ps(mv, dxs, acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        __m512 v = acc[r];
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
        _mm512_storeu_ps(y + r * ldy, v);
    }
}

static void tile_vnni(const qtype *t, const uint8_t *panel, int64_t SB, int R, const qrows *x,
                      int64_t row0, float *y, int64_t ldy, const float *bias) {
    DISPATCH(tile_vnni_body, t, R, panel, SB, x, row0, y, ldy, bias);
}
#elif QISA == 1
/* AVX2: a tile of R rows x 8 of the panel's 16 columns (half h); vpmaddubsw pairs u8 x s8 into
 * s16 (no saturation: a stored value below 64 makes a pair at most 2 x 63 x 127), vpmaddwd
 * sums them into the column's int32 lane; 8-bit weights widen to s16 first. */
static inline __m256i dot4(__m256i w, __m256i x, int eight) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (!eight) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
    const __m256i even = _mm256_set1_epi16(0x00FF);
    const __m256i we = _mm256_and_si256(w, even), wo = _mm256_srli_epi16(w, 8);
    const __m256i xe = _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 8), xo = _mm256_srai_epi16(x, 8);
    return _mm256_add_epi32(_mm256_madd_epi16(we, xe), _mm256_madd_epi16(wo, xo));
}

/* 32 mask bits -> 32 bytes, 0xFF where the bit is set. */
static inline __m256i expand_bits(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                            2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i one = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, one), one);
}

static inline __m256 cvt_scales(const uint8_t *p, int is_signed) {
    const __m128i raw = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw));
}

static inline __attribute__((always_inline)) void tile_avx2_body(
    const qtype *t, int R, const uint8_t *panel, int64_t SB, const qrows *x, int64_t row0,
    float *y, int64_t ldy, const float *bias, int half) {
    const int64_t sbb = super_bytes(t), hb = header_bytes(t), gb = group_bytes(t);
    const int groups = t->super / QK, per = QK / t->sub, subs = t->super / t->sub;
    const int runs = t->bits == 8 ? 8 : 4, per_sub = runs / per, nib = t->bits != 8;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[RMAX];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < SB; ++s) {
        const uint8_t *hdr = panel + s * sbb;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 16 * half)));
        const __m256 m =
            t->min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 32 + 16 * half)))
                   : d;
        const uint8_t *scales = hdr + QCOLS * 2 * (t->min ? 2 : 1) + 8 * half;
        for (int g = 0; g < groups; ++g) {
            const int64_t b = s * groups + g;
            const uint8_t *q = hdr + hb + g * gb;
            for (int h = 0; h < per; ++h) {
                const int i = g * per + h;
                const __m256 sc =
                    t->kq ? _mm256_mul_ps(d, cvt_scales(scales + i * QCOLS, t->off)) : d;
                __m256i is[RMAX];
                for (int r = 0; r < R; ++r) /* the offset's share, subtracted up front */
                    is[r] = _mm256_set1_epi32(-t->off * sub_sum(x, row0 + r, b, t->sub, h));
                for (int run = h * per_sub; run < (h + 1) * per_sub; ++run) {
                    const __m256i v =
                        _mm256_loadu_si256((const __m256i *)(q + run * 64 + 32 * half));
                    __m256i lo = nib ? _mm256_and_si256(v, low4) : v;
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                    for (int bit = 0; nib && bit < t->bits - 4; ++bit) {
                        const uint8_t *mk = q + 256 + (bit * 4 + run) * 16 + 4 * half;
                        uint32_t ml, mh;
                        memcpy(&ml, mk, 4);
                        memcpy(&mh, mk + 8, 4);
                        const __m256i add = _mm256_set1_epi8((char)(16 << bit));
                        lo = _mm256_add_epi8(lo, _mm256_and_si256(expand_bits(ml), add));
                        hi = _mm256_add_epi8(hi, _mm256_and_si256(expand_bits(mh), add));
                    }
                    for (int r = 0; r < R; ++r) {
                        const int8_t *xr =
                            x->q + (row0 + r) * x->K + b * QK + (nib ? 8 : 4) * run;
                        int32_t x0, x1;
                        memcpy(&x0, xr, 4);
                        is[r] = _mm256_add_epi32(is[r], dot4(lo, _mm256_set1_epi32(x0), !nib));
                        if (nib) {
                            memcpy(&x1, xr + 4, 4);
                            is[r] = _mm256_add_epi32(is[r], dot4(hi, _mm256_set1_epi32(x1), 0));
                        }
                    }
                }
                for (int r = 0; r < R; ++r) {
                    const __m256 dxr = _mm256_set1_ps(x->d[(row0 + r) * x->KB + b]);
                    const __m256 tt = _mm256_mul_ps(sc, dxr);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), tt, acc[r]);
                }
            }
            if (t->min) {
                const __m256 mv =
                    t->kq ? _mm256_mul_ps(m, cvt_scales(scales + (subs + g) * QCOLS, 0)) : m;
                for (int r = 0; r < R; ++r) {
                    const int64_t k = (row0 + r) * x->KB + b;
                    const __m256 dxs = _mm256_set1_ps(x->ds[k]);
                    if (t->min == 1) acc[r] = _mm256_fmadd_ps(mv, dxs, acc[r]);
                    else acc[r] = _mm256_fnmadd_ps(mv, dxs, acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        __m256 v = acc[r];
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * half));
        _mm256_storeu_ps(y + r * ldy + 8 * half, v);
    }
}

static void tile_avx2(const qtype *t, const uint8_t *panel, int64_t SB, int R, const qrows *x,
                      int64_t row0, float *y, int64_t ldy, const float *bias, int half) {
    DISPATCH(tile_avx2_body, t, R, panel, SB, x, row0, y, ldy, bias, half);
}
#endif

/* y[:, the segments' columns side by side] = x @ W_seg^T (+ bias): a fused layer's parts
 * (q, k, v; gate, up), each in its own type, x quantized once. types[i], weights[i] (the
 * packed bytes' address) and ns[i] per segment; bias [sum ns] or NULL; y [M, sum ns]. ref: the
 * scalar reference on every build (tests). 0; -1: a type, N or K this does not take; -2: no
 * memory for x's quantized copy. */
int cbgen_q_gemm(int64_t nseg, const int64_t *types, const int64_t *weights, const int64_t *ns,
                 const float *x, int64_t M, int64_t K, const float *bias, float *y, int64_t ref) {
    if (nseg <= 0 || nseg > 8 || K % QK || M < 0) return -1;
    qtype ts[8];
    int64_t first[9] = {0}, col0[9] = {0};
    for (int64_t i = 0; i < nseg; ++i) {
        if (cbgen_q_packed_bytes((int)types[i], ns[i], K) < 0 || !qtype_of((int)types[i], &ts[i]))
            return -1;
        first[i + 1] = first[i] + ns[i] / QCOLS;
        col0[i + 1] = col0[i] + ns[i];
    }
    if (M == 0) return 0;
    const int64_t KB = K / QK, N = col0[nseg];
    /* x quantized: q [M, K] int8, then d [M, KB] float, s and l [M, KB] int32, ds float */
    uint8_t *buf = thread_buffer(M * K + M * KB * 16 + 64);
    if (!buf) return -2;
    int8_t *qx = (int8_t *)buf;
    float *dx = (float *)(buf + (M * K + 63) / 64 * 64);
    int32_t *sx = (int32_t *)(dx + M * KB), *lx = sx + M * KB;
    float *dsx = (float *)(lx + M * KB);
    cbgen_q8_quantize(x, M, K, qx, dx, sx, lx);
    for (int64_t i = 0; i < M * KB; ++i) dsx[i] = dx[i] * (float)sx[i];
    const qrows xr = {qx, dx, sx, lx, dsx, K, KB};
    const int64_t tiles = (M + RMAX - 1) / RMAX, P = first[nseg];
    /* One tile of rows (decode) reads each weight byte once and does little with it: each thread
     * takes a contiguous run of panels, one stream the prefetchers follow. More rows: one panel
     * at a time, so that threads finish together. */
    const int nt = omp_get_max_threads();
    const int64_t chunk = tiles == 1 ? (P + nt - 1) / nt : 1;
#pragma omp parallel for schedule(dynamic, chunk)
    for (int64_t p = 0; p < P; ++p) {
        int64_t i = 0;
        while (p >= first[i + 1]) ++i;
        const qtype *t = &ts[i];
        const int64_t SB = K / t->super, local = p - first[i];
        const uint8_t *panel = (const uint8_t *)(intptr_t)weights[i] + local * SB * super_bytes(t);
        const int64_t c0 = col0[i] + local * QCOLS;
        const float *b = bias ? bias + c0 : 0;
        /* full tiles of RMAX rows (their own instances: the accumulators stay in registers),
         * then the rest; a row's arithmetic does not depend on its tile */
        for (int64_t m0 = 0; m0 < M; m0 += RMAX) {
            const int R = (int)(M - m0 < RMAX ? M - m0 : RMAX);
            float *out = y + m0 * N + c0;
            if (ref || QISA == 0) {
                for (int r = 0; r < R; ++r)
                    for (int j = 0; j < QCOLS; ++j) {
                        const float v = dot_ref(t, panel, SB, j, &xr, m0 + r);
                        out[r * N + j] = b ? v + b[j] : v;
                    }
            }
#if QISA == 2
            else
                tile_vnni(t, panel, SB, R, &xr, m0, out, N, b);
#elif QISA == 1
            else
                for (int h = 0; h < 2; ++h) tile_avx2(t, panel, SB, R, &xr, m0, out, N, b, h);
#endif
        }
    }
    return 0;
}

/* Rows `ids` (n of them) of a packed weight [N, K] dequantized into out [n, K]: an embedding
 * kept in its blocks, as the float path holds it (scale (q - offset), + m or - dmin m_j: the
 * gguf package's values, bit for bit). 0; -1: a type, shape or id this does not take. */
int cbgen_q_rows(int type, const uint8_t *wp, int64_t N, int64_t K, const int64_t *ids,
                 int64_t n, float *out) {
    qtype t;
    if (cbgen_q_packed_bytes(type, N, K) < 0 || !qtype_of(type, &t)) return -1;
    for (int64_t r = 0; r < n; ++r)
        if (ids[r] < 0 || ids[r] >= N) return -1;
    const int64_t SB = K / t.super, sbb = super_bytes(&t), hb = header_bytes(&t);
    const int64_t gb = group_bytes(&t);
    const int groups = t.super / QK, per = QK / t.sub;
#pragma omp parallel for schedule(static) if (n * K >= 65536)
    for (int64_t r = 0; r < n; ++r) {
        const int64_t p = ids[r] / QCOLS;
        const int j = (int)(ids[r] % QCOLS);
        float *o = out + r * K;
        for (int64_t s = 0; s < SB; ++s) {
            const uint8_t *hdr = wp + (p * SB + s) * sbb;
            for (int g = 0; g < groups; ++g) {
                const uint8_t *q = hdr + hb + g * gb;
                const float mv = t.min ? sub_min(&t, hdr, g, j) : 0.0f;
                for (int k = 0; k < QK; ++k) {
                    const float sc = sub_scale(&t, hdr, g * per + k / t.sub, j);
                    float v = sc * (float)(stored(&t, q, j, k) - t.off);
                    if (t.min == 1) v = v + mv;
                    else if (t.min == 2) v = v - mv;
                    o[(s * groups + g) * QK + k] = v;
                }
            }
        }
    }
    return 0;
}

/* Causal attention of a prompt chunk on the CPU, float32 (a flash-attention loop).
 *
 *   q      [Q, H, D]    query rows `q_stride` floats apart (heads contiguous in a row)
 *   k, v   [L, Hkv, D]  contiguous, L = ctx + Q: the chunk's cached context, then itself
 *   out    [Q, H, D]    rows `o_stride` floats apart
 *
 * Query row t sits at position ctx + t and sees keys 0 .. ctx + t; with a sliding window W > 0,
 * only keys ctx + t - W + 1 .. ctx + t. Scores s (after scale) become softcap * tanh(s / softcap)
 * where softcap > 0. Query head h reads KV head h / (H / Hkv). D is 64 or 128.
 *
 * K is first transposed per KV head ([Hkv][D][L], zero-padded to whole steps), so that the
 * scores of RB query rows against KT keys are a register tile of outer products: one
 * broadcast of a query element against two 16-key vectors per row and dimension. Each work item
 * (a query head, RB consecutive rows) walks the visible keys KC at a time (two tiles) with an
 * online softmax (running max and sum per row, earlier output rescaled when the max grows) and
 * adds P x V into its output rows, a few rows at a time held in registers. The softmax's
 * reductions and rescaling cost about as much per step as a tile's FMAs, hence two tiles a step
 * (32 keys a step measured ~10 % slower). Items are handed out longest first (the last rows see
 * the most keys) to even out the causal triangle.
 *
 * That is the AVX-512 layout (32 zmm registers). AVX2 builds (16 ymm registers) compile their own
 * tiles below: 6 rows x 16 keys for the scores, 6 rows x 16 dimensions for P x V, K transposed
 * in 16-key blocks, and work items that hold all query heads of one KV head.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cbgen.h"
#include "vexp.h" /* v8, v16 and their max and exp */
#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_D 128

#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2: 16 ymm registers of 8 floats. A work item is a KV head's group of query heads over a
 * few consecutive query rows: up to MAXR tile rows (row-major: tile row i is query row i / ng, head
 * i % ng), so each K and V vector loaded serves every query head that reads it. Scores are
 * TR tile rows x 16 keys (2 TR accumulators, two K vectors and a broadcast), P x V is TR rows x
 * 16 dimensions at a time (2 TR accumulators, two V vectors), with TR = 6: 15 registers. */
#define TR 6    /* tile rows per register tile */
#define MAXR 24 /* tile rows per work item, a multiple of TR */
#define KC 64   /* keys per softmax step: four 16-key score tiles */
#define KT 16   /* keys per score tile: two 8-float vectors */

/* The softmax in 8-float vectors (vexp.h's v8, vmax8, exp8), as in the tiles. */
static inline float hmax8(v8 a) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128((__m256)a), _mm256_extractf128_ps((__m256)a, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

static inline float hsum8(v8 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)a), _mm256_extractf128_ps((__m256)a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* tanh(x), 8 lanes: 1 - 2 / (exp(2 |x|) + 1) with the sign of x, from exp8 of -2 |x|; below
 * |x| = 0.1, where that would lose digits to cancellation, its odd series to x^7 (within
 * 2e-11). Within a few 1e-7 of tanhf; NaN stays NaN. */
static inline v8 tanh8(v8 x) {
    const i8v sign = (i8v)x & (int32_t)0x80000000;
    const v8 a = (v8)((i8v)x ^ sign);
    const v8 e = exp8(-2.0f * a);
    const v8 far = (1.0f - e) / (1.0f + e);
    const v8 a2 = a * a;
    const v8 near = a + a * a2 * (-1.0f / 3 + a2 * (2.0f / 15 + a2 * (-17.0f / 315)));
    const i8v small = (i8v)(a < 0.1f);
    return (v8)((((i8v)near & small) | ((i8v)far & ~small)) | sign);
}

/* p[i0 .. i0 + TR)[t0 .. t0 + KT) = scale x tile rows qb[i0 ..] . the KT keys of the
 * transposed K's block kc ([D][KT]). */
static inline void score_tile(const float (*qb)[MAX_D], int i0, const float *kc, int64_t D,
                              float scale, float (*p)[KC], int t0) {
    v8 a0[TR], a1[TR];
    for (int i = 0; i < TR; ++i) a0[i] = a1[i] = (v8){0};
    for (int64_t d = 0; d < D; ++d) {
        const v8 b0 = *(const v8 *)(kc + d * KT), b1 = *(const v8 *)(kc + d * KT + 8);
        for (int i = 0; i < TR; ++i) {
            const float x = qb[i0 + i][d];
            a0[i] += x * b0;
            a1[i] += x * b1;
        }
    }
    for (int i = 0; i < TR; ++i) {
        *(v8u *)(p[i0 + i] + t0) = a0[i] * scale;
        *(v8u *)(p[i0 + i] + t0 + 8) = a1[i] * scale;
    }
}

/* o[i0 .. i0 + TR) += p[..][j0 .. j1) x V rows j0 .. j1, 16 dimensions at a time. */
static inline void pv_tile(float (*o)[MAX_D], const float (*p)[KC], int i0, const float *v,
                           int64_t v_stride, int64_t j0, int64_t j1, int64_t D) {
    for (int64_t c = 0; c < D; c += 16) {
        v8 a0[TR], a1[TR];
        for (int i = 0; i < TR; ++i) {
            a0[i] = *(const v8 *)(o[i0 + i] + c);
            a1[i] = *(const v8 *)(o[i0 + i] + c + 8);
        }
        for (int64_t j = j0; j < j1; ++j) {
            const float *vr = v + j * v_stride + c;
            const v8 w0 = *(const v8u *)vr, w1 = *(const v8u *)(vr + 8);
            for (int i = 0; i < TR; ++i) {
                const float pj = p[i0 + i][j];
                a0[i] += pj * w0;
                a1[i] += pj * w1;
            }
        }
        for (int i = 0; i < TR; ++i) {
            *(v8 *)(o[i0 + i] + c) = a0[i];
            *(v8 *)(o[i0 + i] + c + 8) = a1[i];
        }
    }
}

/* K transposed per KV head in blocks of KT keys, [Hkv][lp / KT][D][KT] (keys zero-padded to lp,
 * a multiple of KC): a score tile's keys are one contiguous block. NULL when out of memory. */
static float *transpose_k(const float *k, int64_t L, int64_t lp, int64_t Hkv, int64_t D) {
    float *kt = aligned_alloc(64, (size_t)(Hkv * D * lp) * sizeof(float));
    if (!kt) return NULL;
    const int64_t nb = lp / KT;
#pragma omp parallel for schedule(static)
    for (int64_t hb = 0; hb < Hkv * nb; ++hb) {
        const int64_t h = hb / nb, j0 = hb % nb * KT;
        float *dst = kt + h * D * lp + j0 * D;
        for (int64_t j = 0; j < KT; ++j) {
            const float *src = k + ((j0 + j) * Hkv + h) * D;
            if (j0 + j < L)
                for (int64_t d = 0; d < D; ++d) dst[d * KT + j] = src[d];
            else
                for (int64_t d = 0; d < D; ++d) dst[d * KT + j] = 0.0f;
        }
    }
    return kt;
}

/* Query rows r0 .. r0 + nr of heads h0 .. h0 + ng (q, out: at head h0; kt, v: their KV head). */
static void item(const float *q, int64_t q_stride, const float *kt, const float *v,
                 int64_t v_stride, float *out, int64_t o_stride, int64_t D, int64_t ng, int64_t r0,
                 int64_t nr, int64_t ctx, float scale, int64_t window, float softcap) {
    float qb[MAXR][MAX_D] __attribute__((aligned(32)));
    float o[MAXR][MAX_D] __attribute__((aligned(32)));
    float p[MAXR][KC] __attribute__((aligned(32)));
    float m[MAXR], l[MAXR];
    int64_t pos[MAXR]; /* each tile row's position, -1 for padding */
    const int rows = (int)(nr * ng), tiles = (rows + TR - 1) / TR * TR;
    for (int i = 0; i < tiles; ++i) {
        const int64_t r = i / ng, g = i % ng;
        pos[i] = i < rows ? ctx + r0 + r : -1;
        if (i < rows)
            memcpy(qb[i], q + (r0 + r) * q_stride + g * D, (size_t)D * sizeof(float));
        else
            memset(qb[i], 0, (size_t)D * sizeof(float));
        for (int64_t d = 0; d < D; ++d) o[i][d] = 0.0f;
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    const int64_t nkeys = ctx + r0 + nr; /* keys the item's last row sees */
    const int64_t first = window > 0 && ctx + r0 >= window ? (ctx + r0 - window + 1) / KC * KC : 0;
    for (int64_t j0 = first; j0 < nkeys; j0 += KC) {
        /* each register tile's visible keys in this step: [lo, hi) over its rows */
        int64_t lo[MAXR / TR], hi[MAXR / TR];
        for (int i0 = 0; i0 < tiles; i0 += TR) {
            int64_t a = KC, b = 0;
            for (int i = i0; i < i0 + TR; ++i) {
                if (pos[i] < 0) continue;
                const int64_t last = pos[i] - j0, start = window > 0 ? pos[i] - window + 1 - j0 : 0;
                if (last < 0 || start >= KC) continue;
                a = start < a ? (start > 0 ? start : 0) : a;
                b = last + 1 > b ? (last + 1 < KC ? last + 1 : KC) : b;
            }
            lo[i0 / TR] = a;
            hi[i0 / TR] = b;
            for (int t0 = 0; t0 < KC; t0 += KT)
                if (t0 < b && t0 + KT > a)
                    score_tile((const float(*)[MAX_D])qb, i0, kt + (j0 + t0) * D, D, scale, p, t0);
        }
        if (softcap > 0.0f) {
            const float inv = 1.0f / softcap;
            for (int i = 0; i < tiles; ++i)
                for (int c = 0; c < KC / 8; ++c) {
                    v8 *pc = (v8 *)(p[i] + 8 * c);
                    *pc = softcap * tanh8(*pc * inv);
                }
        }
        for (int i = 0; i < tiles; ++i) {
            /* the row's visible keys in this step, [start, last] */
            const int64_t last = pos[i] >= 0 ? pos[i] - j0 : -1;
            const int64_t start = window > 0 ? pos[i] - window + 1 - j0 : 0;
            if (last < 0 || start >= KC) {
                for (int j = 0; j < KC; ++j) p[i][j] = 0.0f;
                continue;
            }
            /* keys outside [start, last] become -inf */
            const i8v from = (i8v){0} + (int32_t)(start > 0 ? start : 0);
            const i8v to = (i8v){0} + (int32_t)(last < KC ? last : KC);
            const v8 ninf = (v8){0} - INFINITY;
            v8 sv[KC / 8], mx = ninf;
            for (int c = 0; c < KC / 8; ++c) {
                const i8v j = (i8v){0, 1, 2, 3, 4, 5, 6, 7} + 8 * c, out = (j < from) | (j > to);
                sv[c] = (v8)(((i8v)*(const v8 *)(p[i] + 8 * c) & ~out) | ((i8v)ninf & out));
                mx = vmax8(sv[c], mx); /* a NaN score never becomes the max; its exp spreads NaN */
            }
            const float cm = hmax8(mx);
            const float mn = cm > m[i] ? cm : m[i];
            const float alpha = m[i] == -INFINITY ? 0.0f : exp8((v8){0} + (m[i] - mn))[0];
            v8 e = (v8){0};
            for (int c = 0; c < KC / 8; ++c) {
                const v8 ec = exp8(sv[c] - mn);
                *(v8 *)(p[i] + 8 * c) = ec;
                e += ec;
            }
            l[i] = l[i] * alpha + hsum8(e);
            m[i] = mn;
            if (alpha != 1.0f)
                for (int64_t d = 0; d < D; ++d) o[i][d] *= alpha;
        }
        for (int i0 = 0; i0 < tiles; i0 += TR)
            if (lo[i0 / TR] < hi[i0 / TR])
                pv_tile(o, (const float(*)[KC])p, i0, v + j0 * v_stride, v_stride, lo[i0 / TR],
                        hi[i0 / TR], D);
    }
    for (int i = 0; i < rows; ++i) {
        float *dst = out + (r0 + i / ng) * o_stride + (i % ng) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = o[i][d] / l[i];
    }
}

/* Returns 0, or -1 for a shape it does not take (D not 64 or 128, H not a multiple of Hkv). */
int cbgen_prefill_attention_f32(const float *q, int64_t q_stride, const float *k, const float *v,
                                float *out, int64_t o_stride, int64_t Q, int64_t ctx, int64_t H,
                                int64_t Hkv, int64_t D, float scale, int64_t window,
                                float softcap) {
    if ((D != 64 && D != 128) || Hkv <= 0 || H % Hkv || Q <= 0 || ctx < 0 || window < 0) return -1;
    const int64_t L = ctx + Q, lp = (L + KC - 1) / KC * KC, group = H / Hkv;
    float *kt = transpose_k(k, L, lp, Hkv, D);
    if (!kt) return -1;
    /* an item takes a group's heads (in parts of at most MAXR) over as many rows as fill MAXR */
    const int64_t ng = group < MAXR ? group : MAXR, parts = (group + ng - 1) / ng;
    const int64_t rb = MAXR / ng, blocks = (Q + rb - 1) / rb, per_block = Hkv * parts;
    const int64_t items = blocks * per_block;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t b = blocks - 1 - it / per_block; /* last rows first */
        const int64_t hk = it % per_block / parts, part = it % parts;
        const int64_t h0 = hk * group + part * ng, left = group - part * ng, n = left < ng ? left : ng;
        const int64_t r0 = b * rb, nr = Q - r0 < rb ? Q - r0 : rb;
        item(q + h0 * D, q_stride, kt + hk * D * lp, v + hk * D, Hkv * D, out + h0 * D, o_stride, D,
             n, r0, nr, ctx, scale, window, softcap);
    }
    free(kt);
    return 0;
}
#else
#define RB 8  /* query rows per work item */
#define KC 64 /* keys per softmax step: two 32-key score tiles */
#define KT 32 /* keys per score tile: two 16-float vectors */

/* P x V for one chunk: rows [r, r + RG) of o (D = 16 DV floats) += p[row][0..nj) x V rows. */
#define PV(DV, RG)                                                                            \
    static void pv_##DV##_##RG(float (*o)[MAX_D], const float (*p)[KC], int r, const float *v, \
                               int64_t v_stride, int64_t nj) {                                \
        v16 acc[RG][DV];                                                                      \
        for (int i = 0; i < RG; ++i)                                                          \
            for (int c = 0; c < DV; ++c) acc[i][c] = *(const v16 *)(o[r + i] + 16 * c);      \
        for (int64_t j = 0; j < nj; ++j) {                                                    \
            const float *vr = v + j * v_stride;                                               \
            v16 vv[DV];                                                                       \
            for (int c = 0; c < DV; ++c) vv[c] = *(const v16u *)(vr + 16 * c);                \
            for (int i = 0; i < RG; ++i) {                                                    \
                const float pj = p[r + i][j];                                                 \
                for (int c = 0; c < DV; ++c) acc[i][c] += pj * vv[c];                         \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < RG; ++i)                                                          \
            for (int c = 0; c < DV; ++c) *(v16 *)(o[r + i] + 16 * c) = acc[i][c];            \
    }
PV(4, 4)
PV(8, 2)

/* Lane permutations that swap halves of 16, 8, 4 and 2 lanes: four steps reduce 16 lanes. */
static const i16v SWAP8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
static const i16v SWAP4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
static const i16v SWAP2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
static const i16v SWAP1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};

static inline float hmax16(v16 a) {
    a = vmax16(a, __builtin_shuffle(a, SWAP8));
    a = vmax16(a, __builtin_shuffle(a, SWAP4));
    a = vmax16(a, __builtin_shuffle(a, SWAP2));
    a = vmax16(a, __builtin_shuffle(a, SWAP1));
    return a[0];
}

static inline float hsum16(v16 a) {
    a += __builtin_shuffle(a, SWAP8);
    a += __builtin_shuffle(a, SWAP4);
    a += __builtin_shuffle(a, SWAP2);
    a += __builtin_shuffle(a, SWAP1);
    return a[0];
}

/* One softmax step of an item's rows over the KC keys from j0 (p: their scaled scores): scores
 * soft-capped where softcap > 0, the keys a row does not see -inf, then p = exp(s - the row's
 * running max), the running max m and sum l updated and the row's output o rescaled. */
static inline void softmax_step(float (*p)[KC], float *m, float *l, float (*o)[MAX_D], int64_t D,
                                int64_t r0, int64_t nr, int64_t ctx, int64_t j0, int64_t window,
                                float softcap) {
    if (softcap > 0.0f) {
        const float inv = 1.0f / softcap;
        for (int r = 0; r < RB; ++r)
            for (int j = 0; j < KC; ++j) p[r][j] = softcap * tanhf(p[r][j] * inv);
    }
    for (int r = 0; r < RB; ++r) {
        /* the row's visible keys in this step, [lo, last] (rows past nr see none) */
        const int64_t last = r < nr ? ctx + r0 + r - j0 : -1;
        const int64_t lo = window > 0 ? ctx + r0 + r - window + 1 - j0 : 0;
        if (last < KC - 1)
            for (int64_t j = last + 1 > 0 ? last + 1 : 0; j < KC; ++j) p[r][j] = -INFINITY;
        for (int64_t j = 0; j < lo && j < KC; ++j) p[r][j] = -INFINITY;
        if (last < 0 || lo >= KC) {
            for (int j = 0; j < KC; ++j) p[r][j] = 0.0f;
            continue;
        }
        v16 s[KC / 16];
        for (int c = 0; c < KC / 16; ++c) s[c] = *(const v16 *)(p[r] + 16 * c);
        /* a NaN score never becomes the max; its exp is NaN and spreads to the row's output */
        float cm = hmax16(vmax16(vmax16(s[0], s[1]), vmax16(s[2], s[3])));
        if (cm != cm) cm = -INFINITY;
        const float mn = cm > m[r] ? cm : m[r];
        const float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - mn);
        v16 e = (v16){0};
        for (int c = 0; c < KC / 16; ++c) {
            const v16 ec = exp_nonpositive(s[c] - mn);
            *(v16 *)(p[r] + 16 * c) = ec;
            e += ec;
        }
        l[r] = l[r] * alpha + hsum16(e);
        m[r] = mn;
        if (alpha != 1.0f)
            for (int64_t d = 0; d < D; ++d) o[r][d] *= alpha;
    }
}

/* An item's first step: the one holding its first row's first key, rounded down to a step (the
 * steps before see nothing) */
static inline int64_t first_step(int64_t ctx, int64_t r0, int64_t window) {
    return window > 0 && ctx + r0 >= window ? (ctx + r0 - window + 1) / KC * KC : 0;
}

/* out rows r0 .. r0 + nr = o / l */
static inline void finish_rows(const float (*o)[MAX_D], const float *l, float *out,
                               int64_t o_stride, int64_t D, int64_t r0, int64_t nr) {
    for (int r = 0; r < nr; ++r) {
        float *dst = out + (r0 + r) * o_stride;
        for (int64_t d = 0; d < D; ++d) dst[d] = o[r][d] / l[r];
    }
}

static void item(const float *q, int64_t q_stride, const float *kt, int64_t lp, const float *v,
                 int64_t v_stride, float *out, int64_t o_stride, int64_t D, int64_t r0, int64_t nr,
                 int64_t ctx, float scale, int64_t window, float softcap) {
    float qb[RB][MAX_D] __attribute__((aligned(64)));
    float o[RB][MAX_D] __attribute__((aligned(64)));
    float p[RB][KC] __attribute__((aligned(64)));
    float m[RB], l[RB];
    for (int r = 0; r < RB; ++r) {
        for (int64_t d = 0; d < D; ++d) qb[r][d] = r < nr ? q[(r0 + r) * q_stride + d] : 0.0f;
        for (int64_t d = 0; d < D; ++d) o[r][d] = 0.0f;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int64_t nkeys = ctx + r0 + nr; /* keys the block's last row sees */
    for (int64_t j0 = first_step(ctx, r0, window); j0 < nkeys; j0 += KC) {
        for (int64_t t0 = 0; t0 < KC && j0 + t0 < nkeys; t0 += KT) {
            v16 a0[RB], a1[RB];
            for (int r = 0; r < RB; ++r) a0[r] = a1[r] = (v16){0};
            const float *kc = kt + j0 + t0;
            for (int64_t d = 0; d < D; ++d) {
                const v16 b0 = *(const v16u *)(kc + d * lp), b1 = *(const v16u *)(kc + d * lp + 16);
                for (int r = 0; r < RB; ++r) {
                    const float x = qb[r][d];
                    a0[r] += x * b0;
                    a1[r] += x * b1;
                }
            }
            for (int r = 0; r < RB; ++r) {
                *(v16 *)(p[r] + t0) = a0[r] * scale;
                *(v16 *)(p[r] + t0 + 16) = a1[r] * scale;
            }
        }
        softmax_step(p, m, l, o, D, r0, nr, ctx, j0, window, softcap);
        const int64_t nj = nkeys - j0 < KC ? nkeys - j0 : KC;
        const float *vc = v + j0 * v_stride;
        if (D == 64)
            for (int r = 0; r < RB; r += 4) pv_4_4(o, (const float(*)[KC])p, r, vc, v_stride, nj);
        else
            for (int r = 0; r < RB; r += 2) pv_8_2(o, (const float(*)[KC])p, r, vc, v_stride, nj);
    }
    finish_rows((const float(*)[MAX_D])o, l, out, o_stride, D, r0, nr);
}

/* Returns 0, or -1 for a shape it does not take (D not 64 or 128, H not a multiple of Hkv). */
int cbgen_prefill_attention_f32(const float *q, int64_t q_stride, const float *k, const float *v,
                                float *out, int64_t o_stride, int64_t Q, int64_t ctx, int64_t H,
                                int64_t Hkv, int64_t D, float scale, int64_t window,
                                float softcap) {
    if ((D != 64 && D != 128) || Hkv <= 0 || H % Hkv || Q <= 0 || ctx < 0 || window < 0) return -1;
    const int64_t L = ctx + Q, lp = (L + KC - 1) / KC * KC, group = H / Hkv;
    float *kt = aligned_alloc(64, (size_t)(Hkv * D * lp) * sizeof(float));
    if (!kt) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t hd = 0; hd < Hkv * D; ++hd) {
        const int64_t h = hd / D, d = hd % D;
        float *dst = kt + hd * lp;
        for (int64_t j = 0; j < L; ++j) dst[j] = k[(j * Hkv + h) * D + d];
        for (int64_t j = L; j < lp; ++j) dst[j] = 0.0f;
    }
    const int64_t blocks = (Q + RB - 1) / RB, items = blocks * H;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t b = blocks - 1 - it / H, h = it % H, hk = h / group; /* last rows first */
        const int64_t r0 = b * RB, nr = Q - r0 < RB ? Q - r0 : RB;
        item(q + h * D, q_stride, kt + hk * D * lp, lp, v + hk * D, Hkv * D, out + h * D, o_stride, D,
             r0, nr, ctx, scale, window, softcap);
    }
    free(kt);
    return 0;
}

#if defined(__AVX512BF16__)
/* The same attention over a bf16 K/V (a bf16 cache's rows, not widened) with bf16 dot products
 * (vdpbf16ps: two bf16 products added to a float32 lane), as a bf16 flash attention computes:
 * Q rounded to bf16 for Q.K^T, the softmax's probabilities rounded to bf16 for P x V, every sum,
 * the softmax and the output in float32. Half the instructions of the float32 tiles: the
 * scores' tile takes a pair of dimensions a step (K transposed in pairs, [Hkv][D / 2][lp], two
 * dimensions of a key in a 32-bit lane), P x V a pair of keys (V in pairs, [Hkv][lp / 2][D]). */
#include <immintrin.h>

#include "bf16_round.h" /* round_pairs */

/* P x V for one step: rows [r, r + RG) of o (D = 16 DV floats) += their probability pairs
 * pp[row][0 .. nj2) x V's key pairs vp [nj2][D]. */
#define PVB(DV, RG)                                                                            \
    static void pvb_##DV##_##RG(float (*o)[MAX_D], const uint32_t (*pp)[KC / 2], int r,         \
                                const uint32_t *vp, int64_t D, int64_t nj2) {                   \
        __m512 acc[RG][DV];                                                                    \
        for (int i = 0; i < RG; ++i)                                                           \
            for (int c = 0; c < DV; ++c) acc[i][c] = _mm512_load_ps(o[r + i] + 16 * c);       \
        for (int64_t j = 0; j < nj2; ++j) {                                                    \
            __m512bh vv[DV];                                                                   \
            for (int c = 0; c < DV; ++c)                                                       \
                vv[c] = (__m512bh)_mm512_loadu_si512(vp + j * D + 16 * c);                     \
            for (int i = 0; i < RG; ++i) {                                                     \
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp[r + i][j]);            \
                for (int c = 0; c < DV; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pb, vv[c]); \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < RG; ++i)                                                           \
            for (int c = 0; c < DV; ++c) _mm512_store_ps(o[r + i] + 16 * c, acc[i][c]);       \
    }
PVB(4, 4)
PVB(8, 2)

static void item_bf16(const float *q, int64_t q_stride, const uint32_t *ktp, int64_t lp,
                      const uint32_t *vp, float *out, int64_t o_stride, int64_t D, int64_t r0,
                      int64_t nr, int64_t ctx, float scale, int64_t window, float softcap) {
    const int64_t D2 = D / 2;
    uint32_t qb[RB][MAX_D / 2];
    uint32_t pp[RB][KC / 2] __attribute__((aligned(64)));
    float o[RB][MAX_D] __attribute__((aligned(64)));
    float p[RB][KC] __attribute__((aligned(64)));
    float m[RB], l[RB];
    for (int r = 0; r < RB; ++r) {
        if (r < nr)
            round_pairs(q + (r0 + r) * q_stride, D, D2, qb[r]);
        else
            memset(qb[r], 0, sizeof qb[r]);
        for (int64_t d = 0; d < D; ++d) o[r][d] = 0.0f;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int64_t nkeys = ctx + r0 + nr;
    for (int64_t j0 = first_step(ctx, r0, window); j0 < nkeys; j0 += KC) {
        for (int64_t t0 = 0; t0 < KC && j0 + t0 < nkeys; t0 += KT) {
            __m512 a0[RB], a1[RB];
            for (int r = 0; r < RB; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
            const uint32_t *kc = ktp + j0 + t0;
            for (int64_t d2 = 0; d2 < D2; ++d2) {
                const __m512bh b0 = (__m512bh)_mm512_loadu_si512(kc + d2 * lp);
                const __m512bh b1 = (__m512bh)_mm512_loadu_si512(kc + d2 * lp + 16);
                for (int r = 0; r < RB; ++r) {
                    const __m512bh x = (__m512bh)_mm512_set1_epi32((int)qb[r][d2]);
                    a0[r] = _mm512_dpbf16_ps(a0[r], x, b0);
                    a1[r] = _mm512_dpbf16_ps(a1[r], x, b1);
                }
            }
            const __m512 sc = _mm512_set1_ps(scale);
            for (int r = 0; r < RB; ++r) {
                _mm512_store_ps(p[r] + t0, _mm512_mul_ps(a0[r], sc));
                _mm512_store_ps(p[r] + t0 + 16, _mm512_mul_ps(a1[r], sc));
            }
        }
        softmax_step(p, m, l, o, D, r0, nr, ctx, j0, window, softcap);
        /* the step's keys in pairs; an odd last key's partner has probability 0 (past every
         * row's last key) and a zero V row (the padding) */
        const int64_t nj = nkeys - j0 < KC ? nkeys - j0 : KC, nj2 = (nj + 1) / 2;
        for (int r = 0; r < RB; ++r) /* vcvtne2ps2bf16: bf16 in order, to nearest even */
            for (int c = 0; c < KC; c += 32)
                _mm512_store_si512(pp[r] + c / 2,
                                   (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(p[r] + c + 16),
                                                                _mm512_load_ps(p[r] + c)));
        const uint32_t *vc = vp + j0 / 2 * D;
        if (D == 64)
            for (int r = 0; r < RB; r += 4) pvb_4_4(o, (const uint32_t(*)[KC / 2])pp, r, vc, D, nj2);
        else
            for (int r = 0; r < RB; r += 2) pvb_8_2(o, (const uint32_t(*)[KC / 2])pp, r, vc, D, nj2);
    }
    finish_rows((const float(*)[MAX_D])o, l, out, o_stride, D, r0, nr);
}

/* k, v [L, Hkv, D] bfloat16 (contiguous), the rest as cbgen_prefill_attention_f32. Returns 0,
 * -1 for a shape it does not take or no memory for the transposed K/V, -2 in a build without
 * bf16 dot products. */
int cbgen_prefill_attention_bf16(const float *q, int64_t q_stride, const uint16_t *k,
                                 const uint16_t *v, float *out, int64_t o_stride, int64_t Q,
                                 int64_t ctx, int64_t H, int64_t Hkv, int64_t D, float scale,
                                 int64_t window, float softcap) {
    if ((D != 64 && D != 128) || Hkv <= 0 || H % Hkv || Q <= 0 || ctx < 0 || window < 0) return -1;
    const int64_t L = ctx + Q, lp = (L + KC - 1) / KC * KC, group = H / Hkv, D2 = D / 2;
    uint32_t *ktp = aligned_alloc(64, (size_t)(Hkv * D2 * lp) * sizeof(uint32_t));
    uint32_t *vp = aligned_alloc(64, (size_t)(Hkv * lp / 2 * D) * sizeof(uint32_t));
    if (!ktp || !vp) {
        free(ktp);
        free(vp);
        return -1;
    }
#pragma omp parallel
    {
        /* K in dimension pairs: ktp[h][d2][j] = (k[j][h][2 d2], k[j][h][2 d2 + 1]) */
#pragma omp for schedule(static) nowait
        for (int64_t hd = 0; hd < Hkv * D2; ++hd) {
            const int64_t h = hd / D2, d2 = hd % D2;
            uint32_t *dst = ktp + hd * lp;
            for (int64_t j = 0; j < L; ++j) {
                const uint16_t *src = k + (j * Hkv + h) * D + 2 * d2;
                dst[j] = src[0] | (uint32_t)src[1] << 16;
            }
            for (int64_t j = L; j < lp; ++j) dst[j] = 0;
        }
        /* V in key pairs: vp[h][j2][d] = (v[2 j2][h][d], v[2 j2 + 1][h][d]), 0 past L */
#pragma omp for schedule(static)
        for (int64_t hj = 0; hj < Hkv * lp / 2; ++hj) {
            const int64_t h = hj / (lp / 2), j = hj % (lp / 2) * 2;
            uint32_t *dst = vp + hj * D;
            if (j + 1 < L) {
                const uint16_t *a = v + (j * Hkv + h) * D, *b = a + Hkv * D;
                for (int64_t d = 0; d < D; ++d) dst[d] = a[d] | (uint32_t)b[d] << 16;
            } else if (j < L) {
                const uint16_t *a = v + (j * Hkv + h) * D;
                for (int64_t d = 0; d < D; ++d) dst[d] = a[d];
            } else {
                memset(dst, 0, (size_t)D * sizeof(uint32_t));
            }
        }
    }
    const int64_t blocks = (Q + RB - 1) / RB, items = blocks * H;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t b = blocks - 1 - it / H, h = it % H, hk = h / group; /* last rows first */
        const int64_t r0 = b * RB, nr = Q - r0 < RB ? Q - r0 : RB;
        item_bf16(q + h * D, q_stride, ktp + hk * D2 * lp, lp, vp + hk * (lp / 2) * D,
                  out + h * D, o_stride, D, r0, nr, ctx, scale, window, softcap);
    }
    free(ktp);
    free(vp);
    return 0;
}
#endif

#endif

/* How the cpu attention backend splits prompt chunks with this build (measured in
 * docs/PERFORMANCE.md): a chunk whose query tokens read at most cbgen_native_prefill_rows() K/V rows
 * in all goes to the decode kernel, one token at a time (a call of this kernel, with the gather of
 * the chunk's K/V before it, costs about as much as 8k such rows); a larger one to this kernel
 * where cbgen_prefill_kernel_preferred(), else to torch's SDPA. Both the AVX-512 and the AVX2
 * tiles beat SDPA on every chunk past that (SmolLM2's attention shape, one thread). */
int64_t cbgen_native_prefill_rows(void) { return 8192; }
int cbgen_prefill_kernel_preferred(void) { return 1; }

#if !defined(__AVX512BF16__)
/* Builds without bf16 dot products: the caller keeps the float32 kernel. */
int cbgen_prefill_attention_bf16(const float *q, int64_t q_stride, const uint16_t *k,
                                 const uint16_t *v, float *out, int64_t o_stride, int64_t Q,
                                 int64_t ctx, int64_t H, int64_t Hkv, int64_t D, float scale,
                                 int64_t window, float softcap) {
    (void)q, (void)q_stride, (void)k, (void)v, (void)out, (void)o_stride, (void)Q, (void)ctx;
    (void)H, (void)Hkv, (void)D, (void)scale, (void)window, (void)softcap;
    return -2;
}
#endif

/* Paged decode attention for the CPU, float32: one query token per sequence, read straight
 * from the block table (no gathered copy of K/V).
 *
 *   q, out       [B, H, D]                  contiguous
 *   k_cache      [num_blocks, bs, Hkv, D]   contiguous (kv_cache[0] of one layer)
 *   v_cache      [num_blocks, bs, Hkv, D]   contiguous (kv_cache[1] of one layer)
 *   block_table  [B, bt_stride] int32; token t of sequence b is at
 *                block block_table[b][t / bs], offset t % bs
 *   seq_lens     [B] int32; sequence b attends to tokens [0, seq_lens[b])
 *
 * Work item = (sequence, a range of KV heads): a whole batch of decodes is one item per
 * sequence, so each block is read as one contiguous run of bs * Hkv * D floats (memory
 * streams at full speed; cold caches are the normal case, as a step touches every layer's
 * KV once). The KV heads are split into ranges only when there are too few sequences to keep
 * every thread busy. The G = H / Hkv query heads of a group share every K/V row they read.
 * Softmax is exact (max-subtracted, normalised at the end).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

/* Eight floats: GCC vector extensions, so the same code builds for AVX2 and AVX-512. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));

static inline float hsum8(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* Scores of nt tokens (rows `tok_stride` apart) against one query head, four tokens at a
 * time so that four independent FMA chains are in flight; C = D / 8 is a constant. */
#define QK_ROWS(C)                                                                        \
    static void qk_rows_##C(const float *qh, const float *k0, int64_t tok_stride,         \
                            int64_t nt, float scale, float *dst, float *mx) {             \
        v8 qv[C];                                                                         \
        for (int c = 0; c < C; ++c) qv[c] = *(const v8u *)(qh + 8 * c);                   \
        float m = *mx;                                                                    \
        int64_t t = 0;                                                                    \
        for (; t + 4 <= nt; t += 4) {                                                     \
            const float *r0 = k0 + t * tok_stride, *r1 = r0 + tok_stride;                 \
            const float *r2 = r1 + tok_stride, *r3 = r2 + tok_stride;                     \
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                    \
            for (int c = 0; c < C; ++c) {                                                 \
                a0 += qv[c] * *(const v8u *)(r0 + 8 * c);                                 \
                a1 += qv[c] * *(const v8u *)(r1 + 8 * c);                                 \
                a2 += qv[c] * *(const v8u *)(r2 + 8 * c);                                 \
                a3 += qv[c] * *(const v8u *)(r3 + 8 * c);                                 \
            }                                                                             \
            const float s0 = hsum8(a0) * scale, s1 = hsum8(a1) * scale;                   \
            const float s2 = hsum8(a2) * scale, s3 = hsum8(a3) * scale;                   \
            dst[t] = s0; dst[t + 1] = s1; dst[t + 2] = s2; dst[t + 3] = s3;               \
            m = fmaxf(m, fmaxf(fmaxf(s0, s1), fmaxf(s2, s3)));                            \
        }                                                                                 \
        for (; t < nt; ++t) {                                                             \
            const float *r = k0 + t * tok_stride;                                         \
            v8 a = {0};                                                                   \
            for (int c = 0; c < C; ++c) a += qv[c] * *(const v8u *)(r + 8 * c);           \
            dst[t] = hsum8(a) * scale;                                                    \
            m = fmaxf(m, dst[t]);                                                         \
        }                                                                                 \
        *mx = m;                                                                          \
    }                                                                                     \
    /* acc_h += sum_t p[t] * v_t over nt rows, the accumulator held in registers */       \
    static void pv_rows_##C(const float *p, const float *v0, int64_t tok_stride,          \
                            int64_t nt, float *acc) {                                     \
        v8 a[C];                                                                          \
        for (int c = 0; c < C; ++c) a[c] = *(const v8u *)(acc + 8 * c);                   \
        for (int64_t t = 0; t < nt; ++t) {                                                \
            const float *r = v0 + t * tok_stride;                                         \
            const float pt = p[t];                                                        \
            for (int c = 0; c < C; ++c) a[c] += pt * *(const v8u *)(r + 8 * c);           \
        }                                                                                 \
        for (int c = 0; c < C; ++c) *(v8u *)(acc + 8 * c) = a[c];                         \
    }

QK_ROWS(8)
QK_ROWS(16)

static void qk_rows_any(const float *qh, const float *k0, int64_t tok_stride, int64_t nt,
                        int64_t D, float scale, float *dst, float *mx) {
    for (int64_t t = 0; t < nt; ++t) {
        dst[t] = dot(qh, k0 + t * tok_stride, D) * scale;
        if (dst[t] > *mx) *mx = dst[t];
    }
}

static void pv_rows_any(const float *p, const float *v0, int64_t tok_stride, int64_t nt,
                        int64_t D, float *acc) {
    for (int64_t t = 0; t < nt; ++t)
        for (int64_t d = 0; d < D; ++d) acc[d] += p[t] * v0[t * tok_stride + d];
}

static inline void prefetch_block(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 1);
}

int cbgen_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                           const int32_t *block_table, int64_t bt_stride,
                           const int32_t *seq_lens, int64_t B, int64_t H, int64_t Hkv,
                           int64_t D, int64_t bs, float scale, float *out) {
    const int64_t G = H / Hkv;
    if (G > MAX_GROUP || D > MAX_HEAD_DIM || G * Hkv != H) return -1;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; ++b)
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    const int64_t tok_stride = Hkv * D;
    const int64_t blk_stride = bs * Hkv * D;
    const int64_t threads = omp_get_max_threads();
    int64_t splits = 1;
    while (splits < Hkv && B * splits < 4 * threads) ++splits;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(H * (max_len > 0 ? max_len : 1)));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(H * D));
        if (!scores || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < B * splits; ++w) {
            if (!scores || !acc) continue;
            const int64_t b = w / splits, s = w % splits;
            const int64_t h0 = s * Hkv / splits, h1 = (s + 1) * Hkv / splits;
            const int64_t nh = (h1 - h0) * G; /* query heads of this item */
            const int64_t L = seq_lens[b];
            const int64_t nblk = (L + bs - 1) / bs;
            const int32_t *bt = block_table + b * bt_stride;
            const float *qb = q + (b * H + h0 * G) * D;
            float mx[MAX_GROUP * 64];
            float *m = nh <= MAX_GROUP * 64 ? mx : NULL;
            if (!m) continue; /* H > 1024 query heads: not a model we know */
            for (int64_t h = 0; h < nh; ++h) m[h] = -INFINITY;
            /* scores[h * L + t] = q_h . k_t * scale, block by block */
            for (int64_t j = 0; j < nblk; ++j) {
                const float *blk = k_cache + (int64_t)bt[j] * blk_stride;
                if (j + 2 < nblk) prefetch_block(k_cache + (int64_t)bt[j + 2] * blk_stride, blk_stride);
                const int64_t t0 = j * bs, nt = L - t0 < bs ? L - t0 : bs;
                for (int64_t hk = h0; hk < h1; ++hk)
                    for (int64_t g = 0; g < G; ++g) {
                        const int64_t h = (hk - h0) * G + g;
                        const float *qh = qb + h * D, *k0 = blk + hk * D;
                        float *dst = scores + h * L + t0;
                        if (D == 64) qk_rows_8(qh, k0, tok_stride, nt, scale, dst, m + h);
                        else if (D == 128) qk_rows_16(qh, k0, tok_stride, nt, scale, dst, m + h);
                        else qk_rows_any(qh, k0, tok_stride, nt, D, scale, dst, m + h);
                    }
            }
            float sum[MAX_GROUP * 64];
            for (int64_t h = 0; h < nh; ++h) {
                float a = 0.0f;
                float *sh = scores + h * L;
                for (int64_t t = 0; t < L; ++t) {
                    sh[t] = expf(sh[t] - m[h]);
                    a += sh[t];
                }
                sum[h] = a;
            }
            memset(acc, 0, sizeof(float) * (size_t)(nh * D));
            for (int64_t j = 0; j < nblk; ++j) {
                const float *blk = v_cache + (int64_t)bt[j] * blk_stride;
                if (j + 2 < nblk) prefetch_block(v_cache + (int64_t)bt[j + 2] * blk_stride, blk_stride);
                const int64_t t0 = j * bs, nt = L - t0 < bs ? L - t0 : bs;
                for (int64_t hk = h0; hk < h1; ++hk)
                    for (int64_t g = 0; g < G; ++g) {
                        const int64_t h = (hk - h0) * G + g;
                        const float *p = scores + h * L + t0, *v0 = blk + hk * D;
                        if (D == 64) pv_rows_8(p, v0, tok_stride, nt, acc + h * D);
                        else if (D == 128) pv_rows_16(p, v0, tok_stride, nt, acc + h * D);
                        else pv_rows_any(p, v0, tok_stride, nt, D, acc + h * D);
                    }
            }
            float *ob = out + (b * H + h0 * G) * D;
            for (int64_t h = 0; h < nh; ++h) {
                const float inv = 1.0f / sum[h];
                for (int64_t d = 0; d < D; ++d) ob[h * D + d] = acc[h * D + d] * inv;
            }
        }
        free(scores);
        free(acc);
    }
    return failed ? -2 : 0;
}

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
 * Work item = (sequence, KV head): the G = H / Hkv query heads of a group share every K/V
 * row they read. Softmax is exact (max-subtracted, normalised at the end).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
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
    int failed = 0;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * (max_len > 0 ? max_len : 1)));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < B * Hkv; ++w) {
            if (!scores) continue;
            const int64_t b = w / Hkv, hk = w % Hkv;
            const int64_t L = seq_lens[b];
            const int32_t *bt = block_table + b * bt_stride;
            const float *qg = q + (b * H + hk * G) * D;
            float mx[MAX_GROUP];
            for (int64_t g = 0; g < G; ++g) mx[g] = -INFINITY;
            for (int64_t t = 0; t < L; ++t) {
                const float *kp = k_cache + (int64_t)bt[t / bs] * blk_stride + (t % bs) * tok_stride + hk * D;
                for (int64_t g = 0; g < G; ++g) {
                    const float s = dot(qg + g * D, kp, D) * scale;
                    scores[g * L + t] = s;
                    if (s > mx[g]) mx[g] = s;
                }
            }
            float sum[MAX_GROUP];
            for (int64_t g = 0; g < G; ++g) {
                float acc = 0.0f;
                float *sg = scores + g * L;
                for (int64_t t = 0; t < L; ++t) {
                    sg[t] = expf(sg[t] - mx[g]);
                    acc += sg[t];
                }
                sum[g] = acc;
            }
            float acc[MAX_GROUP * MAX_HEAD_DIM];
            for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.0f;
            for (int64_t t = 0; t < L; ++t) {
                const float *vp = v_cache + (int64_t)bt[t / bs] * blk_stride + (t % bs) * tok_stride + hk * D;
                for (int64_t g = 0; g < G; ++g) {
                    const float p = scores[g * L + t];
                    float *a = acc + g * D;
                    for (int64_t d = 0; d < D; ++d) a[d] += p * vp[d];
                }
            }
            float *og = out + (b * H + hk * G) * D;
            for (int64_t g = 0; g < G; ++g) {
                const float inv = 1.0f / sum[g];
                for (int64_t d = 0; d < D; ++d) og[g * D + d] = acc[g * D + d] * inv;
            }
        }
        free(scores);
    }
    return failed ? -2 : 0;
}

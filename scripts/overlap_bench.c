/* Can a decode step hide its memory-bound attention under its compute-bound matmuls?
 *
 *   gcc -O3 -march=native -fopenmp scripts/overlap_bench.c -o /tmp/overlap_bench
 *   /tmp/overlap_bench [kv_blocks]      (default 64000: ~0.79 GB of K/V, 64 sequences of ~260
 *                                        tokens over 30 layers of SmolLM2; 96000: ~400 tokens)
 *
 * A stand-in for one 64-sequence decode step of SmolLM2-135M on every core, with no engine:
 *   - matmuls: 30 layers x 192 panels of 32 output columns x 576 (425 MB of float32 weights,
 *     packed as cbgen's small_gemm packs them), each panel once per step through a register tile
 *     of up to 12 rows, the next panel prefetched into L2 (small_gemm's scheme);
 *   - attention: 12 KB K or V blocks (16 tokens x 3 KV heads x 64) read in a random order, each
 *     against 9 query heads, the block two ahead prefetched a row at a time (the decode kernel's
 *     scheme).
 * Three schedules, times in ms (best of the printed repeats is the fair figure):
 *   serial       all matmuls with 64 rows, then all attention: what the engine does today;
 *   two groups   the batch cut into two groups of 32 rows, each layer's panels passed twice (once
 *                per group) back to back, no attention: what splitting the batch costs the
 *                matmuls;
 *   interleaved  the same two passes per layer, and after each panel a thread computes its next
 *                slice of attention blocks, whose lines it prefetched (spread over the k loop of
 *                the panel's second and third row tiles) during the previous panel. This is the
 *                schedule in which one group's attention runs under the other group's matmuls.
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));

#define NR 32
#define K 576
#define LAYERS 30
#define PANELS_PER_LAYER 192
#define BLK (16 * 3 * 64)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* y[MR, 32] = x[MR, K] @ panel; prefetches the next panel (pf) and lines[0, nl) spread over k */
#define KERNEL(MR)                                                                             \
    static void kern_##MR(const float *x, const float *panel, float *y, const float *pf,       \
                          const char *const *lines, int nl) {                                  \
        v16 a0[MR], a1[MR];                                                                    \
        for (int r = 0; r < MR; ++r) a0[r] = a1[r] = (v16){0};                                 \
        int li = 0;                                                                            \
        for (int64_t k = 0; k < K; ++k) {                                                      \
            const v16 b0 = *(const v16u *)(panel + k * NR), b1 = *(const v16u *)(panel + k * NR + 16); \
            if (pf) {                                                                          \
                __builtin_prefetch(pf + k * NR, 0, 2);                                         \
                __builtin_prefetch(pf + k * NR + 16, 0, 2);                                    \
            }                                                                                  \
            if (nl && (k & 1) == 0) {                                                          \
                const int want = (int)(((k + 2) * (int64_t)nl) / K);                          \
                while (li < want && li < nl) __builtin_prefetch(lines[li++], 0, 2);            \
            }                                                                                  \
            for (int r = 0; r < MR; ++r) {                                                     \
                const float xv = x[r * K + k];                                                 \
                a0[r] += xv * b0;                                                              \
                a1[r] += xv * b1;                                                              \
            }                                                                                  \
        }                                                                                      \
        while (li < nl) __builtin_prefetch(lines[li++], 0, 2);                                 \
        for (int r = 0; r < MR; ++r) {                                                         \
            *(v16u *)(y + r * NR) = a0[r];                                                     \
            *(v16u *)(y + r * NR + 16) = a1[r];                                                \
        }                                                                                      \
    }
KERNEL(11)
KERNEL(10)

/* one block against 9 query heads (3 per KV head); prefetches `next` a row at a time */
static float attn_block(const float *b, const float *q, const float *next) {
    v16 acc = {0};
    for (int t = 0; t < 16; ++t) {
        if (next)
            for (int l = 0; l < 12; ++l) __builtin_prefetch((const char *)(next + t * 192) + l * 64, 0, 2);
        for (int h = 0; h < 3; ++h) {
            const float *row = b + (t * 3 + h) * 64;
            for (int g = 0; g < 3; ++g) {
                const float *qq = q + (h * 3 + g) * 64;
                acc += *(const v16u *)row * *(const v16u *)qq +
                       *(const v16u *)(row + 16) * *(const v16u *)(qq + 16) +
                       *(const v16u *)(row + 32) * *(const v16u *)(qq + 32) +
                       *(const v16u *)(row + 48) * *(const v16u *)(qq + 48);
            }
        }
    }
    float r = 0;
    for (int i = 0; i < 16; ++i) r += acc[i];
    return r;
}

int main(int argc, char **argv) {
    const int64_t P = (int64_t)LAYERS * PANELS_PER_LAYER;
    const int64_t NB = argc > 1 ? atol(argv[1]) : 64000;
    float *W = aligned_alloc(64, P * K * NR * 4);
    float *KV = aligned_alloc(64, NB * (int64_t)BLK * 4);
    if (!W || !KV) return 1;
#pragma omp parallel for
    for (int64_t i = 0; i < P * K * NR; ++i) W[i] = (float)(i % 7) * 0.01f;
#pragma omp parallel for
    for (int64_t i = 0; i < NB * (int64_t)BLK; ++i) KV[i] = (float)(i % 5) * 0.01f;
    int64_t *perm = malloc(NB * sizeof *perm);
    for (int64_t i = 0; i < NB; ++i) perm[i] = i;
    uint64_t s = 88172645463325252ull; /* xorshift: a fixed shuffle */
    for (int64_t i = NB - 1; i > 0; --i) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        const int64_t j = (int64_t)(s % (uint64_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    float *x = aligned_alloc(64, 64 * K * 4);
    for (int i = 0; i < 64 * K; ++i) x[i] = 0.001f * (i % 13);
    float q[9 * 64];
    for (int i = 0; i < 9 * 64; ++i) q[i] = 0.01f * (i % 3);
    const int T = omp_get_max_threads();
    float *ys = aligned_alloc(64, (int64_t)T * 64 * NR * 4);
    volatile float sink = 0;
    printf("%d threads, %.0f MB of weights, %.0f MB of K/V\n", T, P * K * NR * 4 / 1e6, NB * BLK * 4 / 1e6);
    for (int rep = 0; rep < 5; ++rep) {
        float sum = 0;
        const double t0 = now();
#pragma omp parallel
        {
            float *y = ys + omp_get_thread_num() * 64 * NR;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < P; ++p) {
                const float *pn = W + p * K * NR, *nx = p + 1 < P ? pn + K * NR : 0;
                kern_11(x, pn, y, nx, 0, 0);
                kern_11(x + 11 * K, pn, y, 0, 0, 0);
                kern_11(x + 22 * K, pn, y, 0, 0, 0);
                kern_11(x + 33 * K, pn, y, 0, 0, 0);
                kern_10(x + 44 * K, pn, y, 0, 0, 0);
                kern_10(x + 54 * K, pn, y, 0, 0, 0);
            }
        }
        const double t1 = now();
#pragma omp parallel for schedule(static) reduction(+ : sum)
        for (int64_t i = 0; i < NB; ++i) sum += attn_block(KV + perm[i] * BLK, q, KV + perm[i + 2 < NB ? i + 2 : i] * BLK);
        const double t2 = now();
#pragma omp parallel
        {
            float *y = ys + omp_get_thread_num() * 64 * NR;
            for (int64_t L = 0; L < LAYERS; ++L)
                for (int g = 0; g < 2; ++g) {
#pragma omp for schedule(static)
                    for (int64_t p = L * PANELS_PER_LAYER; p < (L + 1) * PANELS_PER_LAYER; ++p) {
                        const float *pn = W + p * K * NR, *nx = p + 1 < P ? pn + K * NR : 0;
                        kern_11(x, pn, y, nx, 0, 0);
                        kern_11(x + 11 * K, pn, y, 0, 0, 0);
                        kern_10(x + 22 * K, pn, y, 0, 0, 0);
                    }
                }
        }
        const double t3 = now();
#pragma omp parallel reduction(+ : sum)
        {
            const int tid = omp_get_thread_num();
            float *y = ys + tid * 64 * NR;
            const int64_t per = PANELS_PER_LAYER / T, calls = LAYERS * 2 * per;
            const int64_t b0 = NB * tid / T, b1 = NB * (tid + 1) / T, nbt = b1 - b0;
            const char **lines = malloc(sizeof(char *) * 192 * (nbt / calls + 4) * 2);
            int64_t next_pf = b0, bi = b0, c = 0;
            for (int64_t L = 0; L < LAYERS; ++L)
                for (int g = 0; g < 2; ++g)
                    for (int64_t p = L * PANELS_PER_LAYER + tid * per; p < L * PANELS_PER_LAYER + (tid + 1) * per; ++p, ++c) {
                        const float *pn = W + p * K * NR, *nx = p + 1 < P ? pn + K * NR : 0;
                        int64_t pf_end = b0 + nbt * (c + 2) / calls; /* the slice after this one */
                        if (pf_end > b1) pf_end = b1;
                        int nl = 0;
                        for (; next_pf < pf_end; ++next_pf)
                            for (int l = 0; l < 192; ++l) lines[nl++] = (const char *)(KV + perm[next_pf] * BLK) + l * 64;
                        kern_11(x, pn, y, nx, 0, 0);
                        kern_11(x + 11 * K, pn, y, 0, lines, nl / 2);
                        kern_10(x + 22 * K, pn, y, 0, lines + nl / 2, nl - nl / 2);
                        for (const int64_t end = b0 + nbt * (c + 1) / calls; bi < end; ++bi)
                            sum += attn_block(KV + perm[bi] * BLK, q, 0);
                    }
            for (; bi < b1; ++bi) sum += attn_block(KV + perm[bi] * BLK, q, 0);
            free(lines);
        }
        const double t4 = now();
        sink += sum;
        printf("serial %.1f ms (matmuls %.1f + attention %.1f, %.1f GB/s) | two groups, matmuls only %.1f ms | "
               "interleaved %.1f ms\n",
               (t2 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3, NB * BLK * 4 / (t2 - t1) / 1e9, (t3 - t2) * 1e3,
               (t4 - t3) * 1e3);
    }
    return sink == 12345.0f;
}

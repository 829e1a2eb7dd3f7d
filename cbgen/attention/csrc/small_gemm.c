/* Matmul for decode-sized batches on the CPU, float32: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * At decode sizes (M up to ~128 rows) a step's matmuls are bound by streaming every weight from
 * memory once, more than by arithmetic. The weight is packed once into panels of 32 output
 * columns, k-major (wp[p][k][j] = W[32 p + j][k]), so a panel is one contiguous run that the
 * hardware prefetcher streams, and the next panel is prefetched into L2 while the first rows of
 * this one are computed. Each panel then stays in L2 while every row block passes over it: a
 * 12 x 32 register tile (24 accumulators of 16 floats) takes one broadcast per row and two
 * panel loads per k. Threads split the panels.
 *
 * Each output is one sum over k in order, whatever M is: a row's result does not depend on the
 * other rows in the batch.
 */
#include <stdint.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));

#define NR 32

void cbgen_pack_panels_f32(const float *w, int64_t N, int64_t K, float *wp) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < N / NR; ++p)
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < NR; ++j) wp[(p * K + k) * NR + j] = w[(p * NR + j) * K + k];
}

#define KERNEL(MR)                                                                           \
    static void kern_##MR(const float *x, int64_t K, const float *panel, const float *bias,  \
                          float *y, int64_t ldy, const float *pf) {                           \
        v16 a0[MR], a1[MR];                                                                   \
        for (int r = 0; r < MR; ++r) {                                                        \
            a0[r] = (v16){0};                                                                 \
            a1[r] = (v16){0};                                                                 \
        }                                                                                     \
        for (int64_t k = 0; k < K; ++k) {                                                     \
            const v16 b0 = *(const v16u *)(panel + k * NR);                                   \
            const v16 b1 = *(const v16u *)(panel + k * NR + 16);                              \
            if (pf) {                                                                         \
                __builtin_prefetch(pf + k * NR, 0, 2);                                        \
                __builtin_prefetch(pf + k * NR + 16, 0, 2);                                   \
            }                                                                                 \
            for (int r = 0; r < MR; ++r) {                                                    \
                const float xv = x[r * K + k];                                                \
                a0[r] += xv * b0;                                                             \
                a1[r] += xv * b1;                                                             \
            }                                                                                 \
        }                                                                                     \
        if (bias) {                                                                           \
            const v16 c0 = *(const v16u *)bias, c1 = *(const v16u *)(bias + 16);              \
            for (int r = 0; r < MR; ++r) {                                                    \
                a0[r] += c0;                                                                  \
                a1[r] += c1;                                                                  \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < MR; ++r) {                                                        \
            *(v16u *)(y + r * ldy) = a0[r];                                                   \
            *(v16u *)(y + r * ldy + 16) = a1[r];                                              \
        }                                                                                     \
    }

KERNEL(12)
KERNEL(8)
KERNEL(4)
KERNEL(2)
KERNEL(1)

/* x [M, K] and y [M, N] contiguous, N a multiple of 32, bias [N] or NULL. */
void cbgen_small_gemm_f32(const float *x, int64_t M, int64_t K, const float *wp, int64_t N,
                          const float *bias, float *y) {
    const int64_t P = N / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; ++p) {
        const float *panel = wp + p * K * NR;
        const float *next = p + 1 < P ? panel + K * NR : 0;
        const float *b = bias ? bias + p * NR : 0;
        for (int64_t m = 0; m < M;) {
            const int64_t left = M - m;
            const float *pf = m == 0 ? next : 0;
            const float *xo = x + m * K;
            float *yo = y + m * N + p * NR;
            if (left >= 12) kern_12(xo, K, panel, b, yo, N, pf), m += 12;
            else if (left >= 8) kern_8(xo, K, panel, b, yo, N, pf), m += 8;
            else if (left >= 4) kern_4(xo, K, panel, b, yo, N, pf), m += 4;
            else if (left >= 2) kern_2(xo, K, panel, b, yo, N, pf), m += 2;
            else kern_1(xo, K, panel, b, yo, N, pf), m += 1;
        }
    }
}

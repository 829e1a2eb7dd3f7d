/* Matmul for decode-sized batches on the CPU, float32: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * For decode batches and the mixed steps of chunked prefill (M up to a few hundred rows): with few
 * rows a step's matmuls are bound by streaming every weight from memory once, with more by the
 * arithmetic, and oneDNN's packed matmul does neither as well. The weight is packed once into
 * panels of 32 output columns, k-major (wp[p][k][j] = W[32 p + j][k]), so a panel is one contiguous
 * run that the hardware prefetcher streams, and the next panel is prefetched into L2 while the
 * first rows of this one are computed. Each panel then stays in L2 while every row block passes
 * over it: a register tile of up to 16 rows x 32 (two accumulators of 16 floats a row) takes one
 * broadcast per row and two panel loads per k. Every tile streams the whole panel from L2 again, so
 * fewer, taller tiles are faster even though 16 rows' 32 accumulators and the two panel vectors
 * overflow the 32 vector registers: GCC 12 keeps three accumulators in L1 (a load and a store per k
 * beside 32 FMAs). Measured against tiles of at most 12 (docs/PERFORMANCE.md): 48 rows in 3 tiles
 * instead of 4, 64 in 4 instead of 6, the matmuls alone 3-7 % faster, a decode step of 40-64
 * sequences 0.6-2.7 %; with 20 rows a tile the spills cost far more. The rows are cut into as few
 * tiles as possible, of equal height (41 rows: 13 + 14 + 14, not 16 + 16 + 9): a short leftover
 * tile has too few independent accumulators to hide the FMA latency and costs nearly a full one.
 * Threads split the panels.
 *
 * Without AVX-512 (AVX2 + FMA: 16 registers of 8 floats) that tile would need 64 accumulators, and
 * GCC spills nearly every FMA to the stack (1.6 GFLOP/s on an AVX2-only EPYC, 30-40x slower than
 * oneDNN). There a register tile is up to 6 rows x 16 columns, half a panel: twelve accumulators,
 * two panel vectors and a broadcast fill 15 of the 16 registers (the shape of the AVX2 kernels of
 * BLIS and oneDNN). A row tile runs over both halves of a panel while its rows are in L1. Measured
 * in docs/PERFORMANCE.md, "AVX2 (Zen 3)". The vector width and the tile are chosen by the ISA
 * macros at compile time; the panels are the same on every ISA, and the AVX-512 kernels' main
 * loops compile to the same machine code as before the AVX2 tile existed. The zeroing, bias and
 * store loops are unrolled like the main loop: otherwise GCC zeroes the accumulator arrays on the
 * stack with memset and loads them, per call.
 *
 * Each output is one sum over k in order, whatever M is: a row's result does not depend on the
 * other rows in the batch, nor on the ISA (the panels and the order of the FMAs are the same).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cbgen.h"
#include "gated.h" /* silu_mul_vn, gelu_tanh_mul_vn */

#if defined(__AVX2__) && !defined(__AVX512F__)
#define VW 8 /* floats a vector register holds */
#define MR_MAX 6
#define MAX_ROWS 2048 /* with the blocked path below, on par with oneDNN or ahead to 2,048 */
#define PREFETCH_REST(p) /* a tile's 16 columns are one cache line */
#else
#define VW 16
#define MR_MAX 16
#define MAX_ROWS 512
#define PREFETCH_REST(p) __builtin_prefetch((p) + 16, 0, 2) /* the tile's second cache line */
#endif
typedef float vec __attribute__((vector_size(VW * 4)));
typedef float vecu __attribute__((vector_size(VW * 4), aligned(4), may_alias));

#define NR 32      /* columns of a packed panel, the same on every ISA */
#define TN (2 * VW) /* columns of a register tile: NR / TN tiles side by side cover a panel */

void cbgen_pack_panels_f32(const float *w, int64_t N, int64_t K, float *wp) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < N / NR; ++p)
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < NR; ++j) wp[(p * K + k) * NR + j] = w[(p * NR + j) * K + k];
}

#define KERNEL(MR)                                                                           \
    static void kern_##MR(const float *x, int64_t K, const float *panel, const float *bias,  \
                          float *y, int64_t ldy, const float *pf) {                           \
        vec a0[MR], a1[MR];                                                                   \
        _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {                               \
            a0[r] = (vec){0};                                                                 \
            a1[r] = (vec){0};                                                                 \
        }                                                                                     \
        for (int64_t k = 0; k < K; ++k) {                                                     \
            const vec b0 = *(const vecu *)(panel + k * NR);                                   \
            const vec b1 = *(const vecu *)(panel + k * NR + VW);                              \
            if (pf) {                                                                         \
                __builtin_prefetch(pf + k * NR, 0, 2);                                        \
                PREFETCH_REST(pf + k * NR);                                                   \
            }                                                                                 \
            _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {                           \
                const float xv = x[r * K + k];                                                \
                a0[r] += xv * b0;                                                             \
                a1[r] += xv * b1;                                                             \
            }                                                                                 \
        }                                                                                     \
        if (bias) {                                                                           \
            const vec c0 = *(const vecu *)bias, c1 = *(const vecu *)(bias + VW);              \
            _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {                           \
                a0[r] += c0;                                                                  \
                a1[r] += c1;                                                                  \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {                               \
            *(vecu *)(y + r * ldy) = a0[r];                                                   \
            *(vecu *)(y + r * ldy + VW) = a1[r];                                              \
        }                                                                                     \
    }

#if MR_MAX == 16
KERNEL(16)
KERNEL(15)
KERNEL(14)
KERNEL(13)
KERNEL(12)
KERNEL(11)
KERNEL(10)
KERNEL(9)
KERNEL(8)
KERNEL(7)
#endif
KERNEL(6)
KERNEL(5)
KERNEL(4)
KERNEL(3)
KERNEL(2)
KERNEL(1)

typedef void (*kern_fn)(const float *, int64_t, const float *, const float *, float *, int64_t, const float *);
static const kern_fn KERNS[MR_MAX + 1] = {0, kern_1, kern_2, kern_3, kern_4, kern_5, kern_6,
#if MR_MAX == 16
                                          kern_7,  kern_8,  kern_9,  kern_10, kern_11,
                                          kern_12, kern_13, kern_14, kern_15, kern_16
#endif
};

/* Tall batches (prompt chunks, BLOCKED_ROWS rows or more). Above, every panel is loaded from L2
 * once per row tile while the rows stream from wherever x is; with a few hundred rows or more,
 * x no longer fits in L2 and each panel pass reads all of it again, strided, from L3. So here
 * the rows go in blocks (block_rows): each thread copies a block into its own buffer, tile by tile with
 * the MR_MAX rows of a k side by side (ap[t][k][r], zeros past the last row), so the kernel's
 * broadcasts walk one contiguous run that stays in L1 for both halves of a panel, and the block
 * (up to BLOCK_FLOATS) in L2 for every panel of the thread. The weights, not x, then stream from L3,
 * once per block. Each output is the same in-order sum over k as above, the same FMAs on the
 * same values: both paths give the same bits, whatever the batch's size. */
#define BLOCKED_ROWS (16 * MR_MAX) /* the build's default: blocks from 96 (AVX2) or 256 rows */
#define BLOCK_FLOATS (128 * 1024)  /* a block's size, 512 KiB: half an L2 of 1 MiB */
#define MC_MAX (24 * MR_MAX)       /* rows per block at most */

/* Rows per block for K: as many whole tiles as BLOCK_FLOATS holds, one at least. */
static int64_t block_rows(int64_t K) {
    const int64_t mc = BLOCK_FLOATS / K / MR_MAX * MR_MAX;
    return mc < MR_MAX ? MR_MAX : mc > MC_MAX ? MC_MAX : mc;
}

#define PACKED_STEP(r)                                                                       \
    {                                                                                        \
        const float xv = ap[k * MR_MAX + (r)];                                               \
        a0[r] += xv * b0;                                                                    \
        a1[r] += xv * b1;                                                                    \
    }

static void kern_packed(const float *ap, int64_t K, const float *panel, const float *bias,
                        float *y, int64_t ldy, int64_t rows) {
    vec a0[MR_MAX], a1[MR_MAX];
    _Pragma("GCC unroll 16") for (int r = 0; r < MR_MAX; ++r) {
        a0[r] = (vec){0};
        a1[r] = (vec){0};
    }
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < K; ++k) {
        const vec b0 = *(const vecu *)(panel + k * NR);
        const vec b1 = *(const vecu *)(panel + k * NR + VW);
        _Pragma("GCC unroll 16") for (int r = 0; r < MR_MAX; ++r) PACKED_STEP(r)
    }
    if (bias) {
        const vec c0 = *(const vecu *)bias, c1 = *(const vecu *)(bias + VW);
        _Pragma("GCC unroll 16") for (int r = 0; r < MR_MAX; ++r) {
            a0[r] += c0;
            a1[r] += c1;
        }
    }
    _Pragma("GCC unroll 16") for (int r = 0; r < MR_MAX; ++r) {
        if (r < rows) {
            *(vecu *)(y + r * ldy) = a0[r];
            *(vecu *)(y + r * ldy + VW) = a1[r];
        }
    }
}

/* The calling thread's block buffers (`floats` of them), grown as needed and kept for its next
 * call; NULL when memory runs out (the rows then take the path above). */
static float *block_buffers(int64_t floats) {
    static __thread float *buf;
    static __thread int64_t cap;
    if (cap < floats) {
        void *p;
        if (posix_memalign(&p, 64, (size_t)floats * sizeof(float))) return 0;
        free(buf);
        buf = p;
        cap = floats;
    }
    return buf;
}

/* Rows [0, rows) of x packed tile by tile: ap[t][k][r] = x[t * MR_MAX + r][k], 0 past `rows`. */
static void pack_block(const float *x, int64_t rows, int64_t K, float *ap) {
    for (int64_t t = 0; t * MR_MAX < rows; ++t) {
        float *d = ap + t * K * MR_MAX;
        const float *s = x + t * MR_MAX * K;
        if (rows - t * MR_MAX >= MR_MAX) {
            for (int64_t k = 0; k < K; ++k)
                _Pragma("GCC unroll 16") for (int r = 0; r < MR_MAX; ++r) d[k * MR_MAX + r] =
                    s[r * K + k];
        } else {
            for (int64_t k = 0; k < K; ++k)
                for (int r = 0; r < MR_MAX; ++r)
                    d[k * MR_MAX + r] = t * MR_MAX + r < rows ? s[r * K + k] : 0.0f;
        }
    }
}

#define PLAIN (-1) /* small_gemm_blocked's act for a plain matmul */

/* bfloat16 panels (small_gemm_bf16.c's: wp16[p][k2][j][e], k in pairs, K rounded up to even)
 * widened into float32 panel p of this file's layout (out[k][j]): a bf16 is the top half of a
 * float32. Each tall-batch call widens a panel once per row block, into L1, and the kernel
 * above then runs on it: the same FMAs on the same values as small_gemm_bf16.c's widening
 * kernels, so the same bits, at float32's speed where those kernels are slower (AVX2: their
 * even and odd weight vectors do not fit the 16 registers beside a 6 x 16 tile). */
static void widen_panel(const uint16_t *wp16, int64_t p, int64_t K, float *out) {
    const int64_t K2 = (K + 1) / 2;
    const uint32_t *pairs = (const uint32_t *)(const void *)(wp16 + p * K2 * 2 * NR);
    for (int64_t k2 = 0; k2 < K2; ++k2)
        for (int64_t j = 0; j < NR; ++j) {
            const uint32_t w = pairs[k2 * NR + j];
            const uint32_t lo = w << 16, hi = w & 0xffff0000u;
            memcpy(out + 2 * k2 * NR + j, &lo, 4);
            if (2 * k2 + 1 < K) memcpy(out + (2 * k2 + 1) * NR + j, &hi, 4);
        }
}

/* The blocked path: y[M, N] = x W^T (+ bias) for act PLAIN; with act 0 (SiLU) or 1 (GELU's tanh
 * form), y[M, N] = act(x W_gate^T) * (x W_up^T) for a gate-up weight [2N, K] packed as one (its
 * gate panels, then its up panels). Then each thread takes the gate panel and the up panel of
 * the same 32 columns: a row tile's two products go to a scratch tile in L1 and the activation
 * to y, so the gate-up product (T x 2I floats: 25 MB for a 2,048-token chunk of SmolLM2) is never
 * written and read back; the activation is activation.c's (gated.h): the same bits as the two
 * passes. Returns 0, or -1 when a block buffer could not be allocated (y not written). */
static int small_gemm_blocked(const float *x, int64_t M, int64_t K, const float *wp,
                              const uint16_t *wp16, int64_t N, const float *bias, int act,
                              float *y) {
    const int threads = omp_get_max_threads();
    const int64_t mc = block_rows(K), P = N / NR;
    /* per thread: its row block, then with bf16 panels (wp16) two widened float32 panels */
    const int64_t each = mc * K + (wp16 ? 2 * K * NR : 0);
    float *bufs = block_buffers(threads * each);
    if (!bufs) return -1;
#pragma omp parallel num_threads(threads)
    {
        float *ap = bufs + omp_get_thread_num() * each;
        float *wide = ap + mc * K;
        float tg[MR_MAX][TN] __attribute__((aligned(64)));
        float tu[MR_MAX][TN] __attribute__((aligned(64)));
        for (int64_t i0 = 0; i0 < M; i0 += mc) {
            const int64_t rows = M - i0 < mc ? M - i0 : mc;
            pack_block(x + i0 * K, rows, K, ap);
            /* every thread packs the block for itself, so none waits for another between
             * blocks; panels are handed out one at a time, so a core slowed by a neighbour
             * takes fewer of them (2-3 % faster decode-sized calls than an even split, on a
             * 2-vCPU VM) */
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t p = 0; p < P; ++p) {
                const float *panel, *up;
                if (wp16) {
                    widen_panel(wp16, p, K, wide);
                    if (act != PLAIN) widen_panel(wp16, P + p, K, wide + K * NR);
                    panel = wide;
                    up = act == PLAIN ? 0 : wide + K * NR;
                } else {
                    panel = wp + p * K * NR;
                    up = act == PLAIN ? 0 : wp + (P + p) * K * NR;
                }
                const float *b = bias ? bias + p * NR : 0;
                for (int64_t t = 0; t * MR_MAX < rows; ++t) {
                    const int64_t left = rows - t * MR_MAX, n = left < MR_MAX ? left : MR_MAX;
                    const float *a = ap + t * K * MR_MAX;
                    float *out = y + (i0 + t * MR_MAX) * N + p * NR;
                    for (int64_t c = 0; c < NR; c += TN) {
                        if (act == PLAIN) {
                            kern_packed(a, K, panel + c, b ? b + c : 0, out + c, N, n);
                            continue;
                        }
                        kern_packed(a, K, panel + c, 0, tg[0], TN, n);
                        kern_packed(a, K, up + c, 0, tu[0], TN, n);
                        for (int64_t r = 0; r < n; ++r)
                            for (int v = 0; v < TN; v += VN) {
                                const vn g = *(const vn *)(tg[r] + v), u = *(const vn *)(tu[r] + v);
                                *(vnu *)(out + r * N + c + v) =
                                    act ? gelu_tanh_mul_vn(g, u) : silu_mul_vn(g, u);
                            }
                    }
                }
            }
        }
    }
    return 0;
}

/* y[M, I] = act(x W_gate^T) * (x W_up^T) for a gate-up weight [2I, K] packed as one (I a
 * multiple of 32), act 0: SiLU, 1: GELU's tanh form, through the blocked path whatever M is.
 * Returns 0, or -1 when a block buffer could not be allocated (y not written). */
int cbgen_small_gemm_gated_f32(const float *x, int64_t M, int64_t K, const float *wp, int64_t I,
                               int act, float *y) {
    return small_gemm_blocked(x, M, K, wp, 0, I, 0, act ? 1 : 0, y);
}

/* The two blocked calls above on bfloat16 panels packed by cbgen_pack_panels_bf16 (the same
 * bits as small_gemm_bf16.c's widening kernels): y[M, N] = x W^T (+ bias), and the gated form
 * over a gate-up weight [2I, K] packed as one. Returns 0, or -1 when a buffer could not be
 * allocated (y not written). */
int cbgen_small_gemm_blocked_bf16w(const float *x, int64_t M, int64_t K, const uint16_t *wp,
                                   int64_t N, const float *bias, float *y) {
    return small_gemm_blocked(x, M, K, 0, wp, N, bias, PLAIN, y);
}

int cbgen_small_gemm_gated_bf16w(const float *x, int64_t M, int64_t K, const uint16_t *wp,
                                 int64_t I, int act, float *y) {
    return small_gemm_blocked(x, M, K, 0, wp, I, 0, act ? 1 : 0, y);
}

/* From how many rows on the blocked path serves, by this build's default (the caller passes
 * its own: where the crossover falls depends on the caches and the memory, which the tuning
 * pass measures). */
int64_t cbgen_small_gemm_blocked_rows(void) { return BLOCKED_ROWS; }

/* x [M, K] and y [M, N] contiguous, N a multiple of 32, bias [N] or NULL; from blocked_from rows
 * on (<= 0: the build's default) through the row blocks, the same bits either way. */
void cbgen_small_gemm_f32(const float *x, int64_t M, int64_t K, const float *wp, int64_t N,
                          const float *bias, int64_t blocked_from, float *y) {
    if (blocked_from <= 0) blocked_from = BLOCKED_ROWS;
    if (M >= blocked_from && small_gemm_blocked(x, M, K, wp, 0, N, bias, PLAIN, y) == 0) return;
    const int64_t P = N / NR;
    /* tile t takes rows [m, m + rows): the rows left shared evenly by the tiles left */
    const int64_t tiles = (M + MR_MAX - 1) / MR_MAX;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; ++p) {
        const float *panel = wp + p * K * NR;
        const float *next = p + 1 < P ? panel + K * NR : 0;
        const float *b = bias ? bias + p * NR : 0;
        int64_t m = 0;
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t rows = (M - m) / (tiles - t);
#if TN == NR
            KERNS[rows](x + m * K, K, panel, b, y + m * N + p * NR, N, t == 0 ? next : 0);
#else /* the tile's rows over each part of the panel in turn, while they are in L1 */
            for (int64_t c = 0; c < NR; c += TN)
                KERNS[rows](x + m * K, K, panel + c, b ? b + c : 0, y + m * N + p * NR + c, N,
                            t == 0 && next ? next + c : 0);
#endif
            m += rows;
        }
    }
}

/* Up to how many rows small_gemm is faster than oneDNN's packed matmul with this build's tiles
 * (measured: docs/PERFORMANCE.md); more rows go to oneDNN. */
int64_t cbgen_small_gemm_max_rows(void) { return MAX_ROWS; }

/* Matmul over bfloat16 weights on the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x, y and the
 * bias float32, W bfloat16 (as most checkpoints store it), every sum in float32.
 *
 * The weight is packed once into panels of 32 output columns, k in pairs:
 * wp[p][k2][j][e] = W[32 p + j][2 k2 + e] (0 past K). A 32-bit lane of a panel row then holds
 * one column's two weights of a k pair, and serves two ways:
 *
 *   widen   the low half shifted up and the high half masked are the two weights as float32 (a
 *           bf16 is the top half of a float32): multiplied with x in float32, k then k + 1, as
 *           small_gemm.c does. The sums are small_gemm's on the weight upcast, bit for bit,
 *           from half the bytes and without an upcast copy. Every ISA.
 *   dot     (AVX512_BF16 builds) x rounded to bfloat16 (to nearest even) and its pairs
 *           broadcast; vdpbf16ps adds a pair's two exact products to a float32 lane, the odd
 *           one first: two multiply-adds a lane and instruction. Not float32's bits: x loses
 *           its low mantissa bits, as in any bf16 matmul.
 *
 * Either way each output is one in-order sum over k, whatever M is, so a row's result does not
 * depend on the other rows of the batch. Register tiles of up to MR_MAX rows by 32 columns (16
 * with AVX2), rows cut into tiles of equal height, threads split the panels; the next panel is
 * prefetched while the first tile runs (small_gemm.c explains these choices).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_round.h" /* to_bf16, round_pairs */
#include "cbgen.h"
#include "gated.h" /* cbgen_gated_tile */
#include "thread_buffer.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define DOT 1
#else
#define DOT 0
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
#define VW 8
#define MR_MAX 6
#else
#define VW 16
#define MR_MAX 16
#endif
typedef float vec __attribute__((vector_size(VW * 4)));
typedef float vecu __attribute__((vector_size(VW * 4), aligned(4), may_alias));
typedef uint32_t wvec __attribute__((vector_size(VW * 4)));
typedef uint32_t wvecu __attribute__((vector_size(VW * 4), aligned(4), may_alias));

#define NR 32 /* columns of a packed panel */

int64_t cbgen_bf16_native(void) { return DOT; }

/* Length of k in the packed panels: K rounded up to even. */
int64_t cbgen_panel_k_bf16(int64_t K) { return (K + 1) / 2 * 2; }

void cbgen_pack_panels_bf16(const uint16_t *w, int64_t N, int64_t K, uint16_t *wp) {
    const int64_t Kp = cbgen_panel_k_bf16(K);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < N / NR; ++p) {
        uint16_t *panel = wp + p * Kp * NR;
        for (int64_t k = 0; k < Kp; ++k)
            for (int64_t j = 0; j < NR; ++j) {
                panel[((k / 2) * NR + j) * 2 + (k % 2)] = k < K ? w[(p * NR + j) * K + k] : 0;
            }
    }
}

/* widen: a tile of MR rows x 2 VW columns (a whole panel with AVX-512, half of one with AVX2);
 * panel points at its first column's pair, x at float32 rows of K (K even here: odd K's last
 * pair multiplies x's padding zero, which the caller supplies). */
#define WIDEN(MR)                                                                            \
    static void widen_##MR(const float *x, int64_t K, const uint16_t *panel,                 \
                           const float *bias, float *y, int64_t ldy, const uint16_t *pf) {   \
        vec a0[MR], a1[MR];                                                                   \
        _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {                               \
            a0[r] = (vec){0};                                                                 \
            a1[r] = (vec){0};                                                                 \
        }                                                                                     \
        const wvec hi_mask = (wvec){0} + 0xffff0000u;                                          \
        for (int64_t k2 = 0; k2 < K / 2; ++k2) {                                              \
            const wvec p0 = *(const wvecu *)(panel + k2 * 2 * NR);                            \
            const wvec p1 = *(const wvecu *)(panel + k2 * 2 * NR + 2 * VW);                   \
            if (pf) __builtin_prefetch(pf + k2 * 2 * NR, 0, 2);                               \
            const wvec e0 = p0 << 16, o0 = p0 & hi_mask, e1 = p1 << 16, o1 = p1 & hi_mask;     \
            vec b0e, b0o, b1e, b1o;                                                           \
            memcpy(&b0e, &e0, sizeof b0e);                                                    \
            memcpy(&b0o, &o0, sizeof b0o);                                                    \
            memcpy(&b1e, &e1, sizeof b1e);                                                    \
            memcpy(&b1o, &o1, sizeof b1o);                                                    \
            _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {                           \
                const float xe = x[r * K + 2 * k2], xo = x[r * K + 2 * k2 + 1];               \
                a0[r] += xe * b0e;                                                            \
                a1[r] += xe * b1e;                                                            \
                a0[r] += xo * b0o;                                                            \
                a1[r] += xo * b1o;                                                            \
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

#if DOT
/* dot: a tile of MR rows x 32 columns over a whole panel; xp: the rows' bf16 pairs [MR][K2]. */
#define DOTK(MR)                                                                             \
    static void dot_##MR(const uint32_t *xp, int64_t K2, const uint16_t *panel,              \
                         const float *bias, float *y, int64_t ldy, const uint16_t *pf) {     \
        __m512 a0[MR], a1[MR];                                                                \
        _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {                               \
            a0[r] = _mm512_setzero_ps();                                                      \
            a1[r] = _mm512_setzero_ps();                                                      \
        }                                                                                     \
        for (int64_t k2 = 0; k2 < K2; ++k2) {                                                 \
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + k2 * 2 * NR);            \
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + k2 * 2 * NR + NR);       \
            if (pf) {                                                                         \
                __builtin_prefetch(pf + k2 * 2 * NR, 0, 2);                                   \
                __builtin_prefetch(pf + k2 * 2 * NR + NR, 0, 2);                              \
            }                                                                                 \
            _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {                           \
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[r * K2 + k2]);        \
                a0[r] = _mm512_dpbf16_ps(a0[r], xv, b0);                                      \
                a1[r] = _mm512_dpbf16_ps(a1[r], xv, b1);                                      \
            }                                                                                 \
        }                                                                                     \
        if (bias) {                                                                           \
            const __m512 c0 = _mm512_loadu_ps(bias), c1 = _mm512_loadu_ps(bias + 16);         \
            _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {                           \
                a0[r] = _mm512_add_ps(a0[r], c0);                                             \
                a1[r] = _mm512_add_ps(a1[r], c1);                                             \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {                               \
            _mm512_storeu_ps(y + r * ldy, a0[r]);                                             \
            _mm512_storeu_ps(y + r * ldy + 16, a1[r]);                                        \
        }                                                                                     \
    }
#define KERNEL(MR) WIDEN(MR) DOTK(MR)
#else
#define KERNEL(MR) WIDEN(MR)
#endif

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

typedef void (*widen_fn)(const float *, int64_t, const uint16_t *, const float *, float *,
                         int64_t, const uint16_t *);
static const widen_fn WIDENS[MR_MAX + 1] = {0, widen_1, widen_2, widen_3, widen_4, widen_5, widen_6,
#if MR_MAX == 16
                                            widen_7,  widen_8,  widen_9,  widen_10, widen_11,
                                            widen_12, widen_13, widen_14, widen_15, widen_16
#endif
};
#if DOT
typedef void (*dot_fn)(const uint32_t *, int64_t, const uint16_t *, const float *, float *, int64_t,
                       const uint16_t *);
static const dot_fn DOTS[MR_MAX + 1] = {0,      dot_1,  dot_2,  dot_3,  dot_4,  dot_5,
                                        dot_6,  dot_7,  dot_8,  dot_9,  dot_10, dot_11,
                                        dot_12, dot_13, dot_14, dot_15, dot_16};
#endif


/* x [M, K] and y [M, N] contiguous float32, N a multiple of 32, bias [N] or NULL, wp packed by
 * cbgen_pack_panels_bf16; dot 1: bf16 dot products (AVX512_BF16 builds), 0: widen, from
 * blocked_from rows on (<= 0: small_gemm.c's default) through small_gemm.c's row blocks, each
 * panel widened into float32 once per block (the same bits). 0, -1 when a buffer for x could
 * not be allocated, -2 for dot in a build without it. */
int cbgen_small_gemm_bf16(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                          const float *bias, int dot, int64_t blocked_from, float *y) {
    const int64_t P = N / NR, Kp = cbgen_panel_k_bf16(K), K2 = Kp / 2;
    const int64_t tiles = (M + MR_MAX - 1) / MR_MAX;
    if (dot && !DOT) return -2;
    if (blocked_from <= 0) blocked_from = cbgen_small_gemm_blocked_rows();
    if (!dot && M >= blocked_from && cbgen_small_gemm_blocked_bf16w(x, M, K, wp, N, bias, y) == 0)
        return 0;
    const void *rows = x;
    int64_t ldx = K;
#if DOT
    uint32_t *xp = 0;
    if (dot) {
        xp = thread_buffer(M * K2 * (int64_t)sizeof(uint32_t));
        if (!xp) return -1;
        rows = xp;
        ldx = K2;
    }
#endif
    if (!dot && K % 2) { /* widen reads k in pairs: x gets a zero column */
        float *xe = thread_buffer(M * Kp * (int64_t)sizeof(float));
        if (!xe) return -1;
        for (int64_t m = 0; m < M; ++m) {
            memcpy(xe + m * Kp, x + m * K, (size_t)K * sizeof(float));
            xe[m * Kp + K] = 0.0f;
        }
        rows = xe;
        ldx = Kp;
    }
#pragma omp parallel
    {
#if DOT
        if (dot) { /* x's bf16 pairs, in the same parallel region as the matmul (one barrier) */
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; ++m) round_pairs(x + m * K, K, K2, xp + m * K2);
        }
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t p = 0; p < P; ++p) {
        const uint16_t *panel = wp + p * Kp * NR;
        const uint16_t *next = p + 1 < P ? panel + Kp * NR : 0;
        const float *b = bias ? bias + p * NR : 0;
        int64_t m = 0;
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t n = (M - m) / (tiles - t);
            float *out = y + m * N + p * NR;
#if DOT
            if (dot) {
                DOTS[n]((const uint32_t *)rows + m * ldx, K2, panel, b, out, N, t == 0 ? next : 0);
                m += n;
                continue;
            }
#endif
            /* the tile's rows over each part of the panel in turn, while they are in L1 */
            for (int64_t c = 0; c < NR; c += 2 * VW)
                WIDENS[n]((const float *)rows + m * ldx, Kp, panel + 2 * c, b ? b + c : 0, out + c,
                          N, t == 0 && next ? next + 2 * c : 0);
            m += n;
        }
    }
    }
    return 0;
}

/* y[M, I] = act(x W_gate^T) * (x W_up^T) under dot products, for a gate-up weight [2I, K]
 * packed as one (its gate panels, then its up panels), act 0: SiLU, 1: GELU's tanh form. Each
 * thread takes a gate panel and the up panel of the same 32 columns: a row tile's two products
 * go to scratch tiles in L1 and the activation (activation.c's, compiled there) to y, so the
 * gate-up product is never written and read back: the same bits as the product, then the
 * activation pass. Returns 0, -1 when x's buffer could not be allocated, -2 in a build without dot
 * products. */
int cbgen_small_gemm_gated_bf16_dot(const float *x, int64_t M, int64_t K, const uint16_t *wp,
                                    int64_t I, int act, float *y) {
#if DOT
    const int64_t P = I / NR, Kp = cbgen_panel_k_bf16(K), K2 = Kp / 2;
    const int64_t tiles = (M + MR_MAX - 1) / MR_MAX;
    uint32_t *xp = thread_buffer(M * K2 * (int64_t)sizeof(uint32_t));
    if (!xp) return -1;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) round_pairs(x + m * K, K, K2, xp + m * K2);
        float tg[MR_MAX][NR] __attribute__((aligned(64)));
        float tu[MR_MAX][NR] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < P; ++p) {
            const uint16_t *gate = wp + p * Kp * NR, *up = wp + (P + p) * Kp * NR;
            int64_t m = 0;
            for (int64_t t = 0; t < tiles; ++t) {
                const int64_t n = (M - m) / (tiles - t);
                DOTS[n](xp + m * K2, K2, gate, 0, tg[0], NR, 0);
                DOTS[n](xp + m * K2, K2, up, 0, tu[0], NR, 0);
                cbgen_gated_tile(tg[0], tu[0], n, act, y + m * I + p * NR, I);
                m += n;
            }
        }
    }
    return 0;
#else
    (void)x, (void)M, (void)K, (void)wp, (void)I, (void)act, (void)y;
    return -2;
#endif
}

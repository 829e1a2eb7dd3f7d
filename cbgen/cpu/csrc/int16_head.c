/* The LM head from int16 logits, exactly (CPU, AVX2): a greedy row gets the argmax of the
 * float32 logits, a sampled row a draw from the float32 softmax(logits / T), as from the bf16
 * head (head_select.h has the bound and the selection both share), on CPUs without bf16 dot
 * products.
 *
 * There the float32 head runs at the FMA rate, 8 multiply-adds per instruction. vpmaddwd
 * multiplies 16 pairs of int16 and adds them pairwise into 8 int32, at the same two per cycle
 * (plus an integer add), and the head's int16 copy is half the float32 one to stream from
 * memory: on an AVX2 EPYC the head with its selection measured 1.2-1.5x faster than the float32
 * head and its argmax at 8-64 rows (docs/PERFORMANCE.md).
 *
 * Each row of the head is scaled to integers of at most W in magnitude (W from the hidden size,
 * cbgen_head_i16_levels), w^_v = s_v q_v, and each hidden state likewise, h^ = s_h p, with s_h
 * chosen per row so that no int32 sum can overflow: every partial sum of p . q_v is at most
 * |p|_1 W < 2^31, and |p_k| <= 32767 keeps vpmaddwd's pair sums exact. So p . q_v is exact,
 * x_v = float(p . q_v) * (s_h s_v) rounds three times (b in the bound: 4 units of float32,
 * with slack), and h^ . w^_v = s_h s_v (p . q_v) exactly. The bound's r_v = |w^_v - w_v| and
 * |h^ - h| are computed in double.
 *
 * The head is packed once: panels of 16 vocabulary rows, k-pair-major, q[p][k / 2][j][k % 2]
 * = q_{16 p + j, k} (zeros past V and past an odd K), so one k-pair of a panel is one 64-byte
 * line; a register tile of 4 hidden rows x 16 tokens takes 4 broadcasts of a row's k-pair, 8
 * vpmaddwd and 8 vpaddd per k-pair. The tile's loop is written in inline assembly: GCC 12
 * otherwise copies every accumulator once per step (vmovdqa), measured ~25 % slower.
 * Threads split the panels; then each row's token is picked (pick_row).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cbgen.h"
#include "head_select.h"

#if defined(__AVX2__) && defined(__x86_64__)
#include <immintrin.h>
#define HEAD_I16 1
#else
#define HEAD_I16 0
#endif

#define PW 16 /* vocabulary rows per packed panel */
#define TR 4  /* hidden rows per register tile */
#define INT32_SUM_MAX 2147483647.0

int64_t cbgen_head_i16_available(void) { return HEAD_I16; }

/* The build's default before the tuning pass has measured (cbgen.cpu.tuning). With AVX-512 the
 * float32 head's FMAs take 16 floats, as many multiply-adds an instruction as this 8-lane
 * kernel's vpmaddwd, so the build does not presume (not measured: the tuning pass decides);
 * without it the int16 head measured 1.2-1.5x faster at 8-64 rows (docs/PERFORMANCE.md). */
int64_t cbgen_head_i16_preferred(void) {
#if HEAD_I16 && !defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* The head's integer range W (2^b - 1) for hidden size K: |p|_1 W < 2^31 leaves the hidden state
 * about (2^31 / W) / K levels per element on average; W near sqrt(2.5 x 2^31 / K) balances the
 * two roundings for hidden states whose largest element is a few times their mean magnitude
 * (511 to 8191 for K from 64 to 20000). */
int64_t cbgen_head_i16_levels(int64_t K) {
    const double target = sqrt(2.5 * INT32_SUM_MAX / (double)(K > 0 ? K : 1));
    int64_t w = 127;
    while (w < 32767 && (double)(2 * w + 1) <= target) w = 2 * w + 1;
    return w;
}

/* w [V, K] float32 -> q (ceil(V / 16) panels of ceil(K / 2) k-pairs x 16 x 2 int16), scale
 * [ceil(V / 16) * 16] (s_v, 0 past V) and wres [V] (r_v = |s_v q_v - w_v|, rounded up).
 * Returns 0, or -1 when a weight is not finite. */
int cbgen_head_i16_pack(const float *w, int64_t V, int64_t K, int64_t W, int16_t *q, float *scale,
                        float *wres) {
    const int64_t P = (V + PW - 1) / PW, K2 = (K + 1) / 2;
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int64_t p = 0; p < P; ++p) {
        int16_t *panel = q + p * K2 * PW * 2;
        memset(panel, 0, (size_t)(K2 * PW * 2) * sizeof(int16_t));
        for (int64_t j = 0; j < PW; ++j) {
            const int64_t v = p * PW + j;
            if (v >= V) {
                scale[v] = 0.0f;
                continue;
            }
            const float *row = w + v * K;
            float amax = 0.0f;
            for (int64_t k = 0; k < K; ++k) {
                bad |= bits_nonfinite(row[k]);
                amax = fabsf(row[k]) > amax ? fabsf(row[k]) : amax;
            }
            const float s = amax > 0.0f ? amax / (float)W : 1.0f;
            double rr = 0.0;
            for (int64_t k = 0; k < K; ++k) {
                double t = nearbyint((double)row[k] / (double)s);
                t = t > (double)W ? (double)W : t < -(double)W ? -(double)W : t;
                panel[((k / 2) * PW + j) * 2 + (k & 1)] = (int16_t)t;
                const double d = t * (double)s - (double)row[k];
                rr += d * d;
            }
            scale[v] = s;
            wres[v] = (float)(sqrt(rr) * (1.0 + 1e-6));
        }
    }
    return bad ? -1 : 0;
}

/* A hidden row h [K] -> p [2 ceil(K / 2)] int16 (0-padded) with |p|_1 W < 2^31 and |p_k| <=
 * 32767, its scale s_h, |h^| and |h^ - h| (rounded up); -1 when h is not finite. */
static int quantize_row(const float *h, int64_t K, int64_t W, int16_t *p, float *s_out, double *nh,
                        double *nd) {
    double amax = 0.0, l1 = 0.0;
    int bad = 0;
    for (int64_t k = 0; k < K; ++k) {
        bad |= bits_nonfinite(h[k]);
        const double a = fabs((double)h[k]);
        amax = a > amax ? a : amax;
        l1 += a;
    }
    if (bad) return -1;
    /* |p_k| <= |h_k| / s + 1/2, so |p|_1 W <= (l1 / s + K / 2) W < 2^31 when s is at least: */
    const double by_sum = l1 * (double)W / (INT32_SUM_MAX - 0.5 * (double)K * (double)W);
    double s = amax / 32767.0 > by_sum ? amax / 32767.0 : by_sum;
    s = s > 0.0 ? s * (1.0 + 0x1p-20) : 1.0; /* slack for the divisions' rounding */
    const float sf = (float)s > 0.0f ? (float)s : 1.0f;
    double hh = 0.0, dd = 0.0;
    for (int64_t k = 0; k < K; ++k) {
        double t = nearbyint((double)h[k] / (double)sf);
        t = t > 32767.0 ? 32767.0 : t < -32767.0 ? -32767.0 : t;
        p[k] = (int16_t)t;
        const double x = t * (double)sf, d = x - (double)h[k];
        hh += x * x;
        dd += d * d;
    }
    if (K & 1) p[K] = 0;
    *s_out = sf;
    *nh = sqrt(hh) * (1.0 + 1e-6);
    *nd = sqrt(dd) * (1.0 + 1e-6);
    return 0;
}

#if HEAD_I16
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* acc0 += madd(x, w0), acc1 += madd(x, w1): written out so that each accumulator stays in its
 * register (see the top) */
#define MADD2(acc0, acc1, xb)                                                         \
    __asm__("vpmaddwd %[w0], %[x], %[t]\n\t"                                          \
            "vpaddd %[t], %[a0], %[a0]\n\t"                                           \
            "vpmaddwd %[w1], %[x], %[t]\n\t"                                          \
            "vpaddd %[t], %[a1], %[a1]"                                               \
            : [a0] "+x"(acc0), [a1] "+x"(acc1), [t] "=&x"(tmp)                        \
            : [w0] "x"(w0), [w1] "x"(w1), [x] "x"(xb))

/* The per-row constants of a tile's epilogue: s_h and the bound's A and B */
typedef struct {
    float sh, A, B;
} row_t;

/* Upper bounds U_v = x_v + E_v of hidden rows [0, rows <= 4) (k-pairs x of 4 rows, ld K2) against
 * one panel (16 tokens from v0, `valid` of them real): x_v = float(sum) * (s_h * s_v), U_v into
 * up[r][j] (-FLT_MAX past the real tokens), and the panel's max U_v and max (x_v - E_v) per row
 * into pmax[r * ldp] and plo[r * ldp]. */
static void tile(const int32_t *x, int64_t K2, int rows, const int32_t *panel, const row_t *rt,
                 const float *scale, const float *wres, const float *wnorm, int valid, float b, float c,
                 float *up, int64_t ldu, float *pmax, float *plo, int64_t ldp) {
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
            a30 = a00, a31 = a00, tmp;
    const int32_t *x0 = x, *x1 = x + K2, *x2 = x + 2 * K2, *x3 = x + 3 * K2;
    for (int64_t k = 0; k < K2; ++k) {
        const __m256i w0 = _mm256_load_si256((const __m256i *)(panel + k * PW));
        const __m256i w1 = _mm256_load_si256((const __m256i *)(panel + k * PW + 8));
        const __m256i b0 = _mm256_set1_epi32(x0[k]);
        MADD2(a00, a01, b0);
        const __m256i b1 = _mm256_set1_epi32(x1[k]);
        MADD2(a10, a11, b1);
        const __m256i b2 = _mm256_set1_epi32(x2[k]);
        MADD2(a20, a21, b2);
        const __m256i b3 = _mm256_set1_epi32(x3[k]);
        MADD2(a30, a31, b3);
    }
    const __m256i acc[TR][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 vb = _mm256_set1_ps(b), vc = _mm256_set1_ps(c), lowest = _mm256_set1_ps(-FLT_MAX);
    __m256 keep[2]; /* all ones in the lanes of real tokens */
    for (int half = 0; half < 2; ++half) {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        keep[half] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid - 8 * half), lane));
    }
    for (int r = 0; r < rows; ++r) {
        const __m256 sh = _mm256_set1_ps(rt[r].sh), A = _mm256_set1_ps(rt[r].A), B = _mm256_set1_ps(rt[r].B);
        __m256 hi = lowest, lo = lowest;
        for (int half = 0; half < 2; ++half) {
            const __m256 xv = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][half]),
                                            _mm256_mul_ps(sh, _mm256_loadu_ps(scale + 8 * half)));
            const __m256 e = _mm256_add_ps(
                _mm256_add_ps(_mm256_mul_ps(A, _mm256_loadu_ps(wres + 8 * half)),
                              _mm256_mul_ps(B, _mm256_loadu_ps(wnorm + 8 * half))),
                _mm256_add_ps(_mm256_mul_ps(vb, _mm256_and_ps(xv, abs_mask)), vc));
            const __m256 u = _mm256_blendv_ps(lowest, _mm256_add_ps(xv, e), keep[half]);
            const __m256 d = _mm256_blendv_ps(lowest, _mm256_sub_ps(xv, e), keep[half]);
            _mm256_storeu_ps(up + r * ldu + 8 * half, u);
            hi = _mm256_max_ps(hi, u);
            lo = _mm256_max_ps(lo, d);
        }
        pmax[r * ldp] = hmax8(hi);
        plo[r * ldp] = hmax8(lo);
    }
}
#endif

/* Tokens of the float32 head weight [V, K] for hidden [M, K], from its int16 copy (q, scale by
 * cbgen_head_i16_pack with levels W; wres and wnorm padded with zeros to the panels' ceil(V / 16)
 * * 16): scratch holds M x (ceil(V / 16) * 18) floats (the upper bounds and each panel's two
 * maxima); temperature, seed, out [M] and the bound's g, margin, b, c as for the bf16 head. out[r]
 * is -1 for a row that cannot be answered here. Returns the most candidates a greedy row needed,
 * or -1 when this build has no int16 head or memory ran out. */
int64_t cbgen_head_i16(const float *hidden, int64_t M, int64_t K, const int16_t *q, const float *scale,
                       int64_t V, int64_t W, const float *weight, const float *wres, const float *wnorm,
                       float g, float margin, float b, float c, const float *temperature,
                       const uint64_t *seed, int64_t max_attempts, float *scratch, int64_t *out) {
#if HEAD_I16
    const int64_t P = (V + PW - 1) / PW, K2 = (K + 1) / 2, ldu = P * PW, Mp = (M + TR - 1) / TR * TR;
    float *up = scratch, *pmax = scratch + M * ldu, *plo = pmax + M * P;
    int32_t *x = calloc((size_t)(Mp * K2), sizeof(int32_t));
    row_t *rt = calloc((size_t)Mp, sizeof(row_t));
    int *bad = malloc((size_t)M * sizeof(int));
    const head_t H = {weight, wres, wnorm, V, K, g, margin, b, c};
    float smax = 0.0f;
    for (int64_t v = 0; v < V; ++v) smax = scale[v] > smax ? scale[v] : smax;
    int64_t most = 0;
    if (x == NULL || rt == NULL || bad == NULL) {
        most = -1;
        goto done;
    }
#pragma omp parallel reduction(max : most)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; ++r) {
            double nh = 0.0, nd = 0.0;
            bad[r] = quantize_row(hidden + r * K, K, W, (int16_t *)(x + r * K2), &rt[r].sh, &nh, &nd);
            /* x_v is at most 2^31 s_h s_v: finite, with room for the bound, or the row is not
             * answered here */
            bad[r] |= (double)rt[r].sh * (double)smax * 0x1p31 > 0x1p100;
            const bound_t e = row_bound(&H, nh, nd);
            rt[r].A = e.A;
            rt[r].B = e.B;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; ++p) {
            const int32_t *panel = (const int32_t *)(q + p * K2 * PW * 2);
            const int valid = V - p * PW < PW ? (int)(V - p * PW) : PW;
            for (int64_t m = 0; m < M; m += TR) {
                const int rows = M - m < TR ? (int)(M - m) : TR;
                tile(x + m * K2, K2, rows, panel, rt + m, scale + p * PW, wres + p * PW, wnorm + p * PW,
                     valid, b, c, up + m * ldu + p * PW, ldu, pmax + m * P + p, plo + m * P + p, P);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < M; ++r) {
            out[r] = -1;
            if (bad[r]) continue;
            float hi = -FLT_MAX, lo = -FLT_MAX;
            for (int64_t p = 0; p < P; ++p) {
                hi = pmax[r * P + p] > hi ? pmax[r * P + p] : hi;
                lo = plo[r * P + p] > lo ? plo[r * P + p] : lo;
            }
            int64_t n;
            out[r] = pick_row(&H, up + r * ldu, hi, lo, pmax + r * P, hidden + r * K, temperature[r], seed[r],
                              max_attempts, &n);
            most = n > most ? n : most;
        }
    }
done:
    free(x);
    free(rt);
    free(bad);
    return most;
#else
    (void)hidden, (void)M, (void)K, (void)q, (void)scale, (void)V, (void)W, (void)weight, (void)wres;
    (void)wnorm, (void)g, (void)margin, (void)b, (void)c, (void)temperature, (void)seed;
    (void)max_attempts, (void)scratch, (void)out;
    return -1;
#endif
}

/* Tokens of the float32 LM head from cheaper logits with a proven error bound, shared by the
 * bf16 head (bf16_head.c: bfloat16 logits from oneDNN) and the int16 head (int16_head.c: int16
 * logits from its own kernel). A greedy row gets the argmax of the float32 logits, a sampled row
 * a draw from the float32 softmax(logits / T).
 *
 * With h^ and w^_v the approximations of the hidden state h and of the head's row w_v that the
 * cheap logits x_v are computed from, l_v = h . w_v (real) and l~_v its float32 recompute here
 * (dot_f32):
 *
 *   h^.w^_v - h.w_v = h^.(w^_v - w_v) + (h^ - h).w_v, at most |h^| r_v + |h^ - h| n_v
 *   (Cauchy-Schwarz; r_v = |w^_v - w_v| and n_v = |w_v| are the head's, fixed at load);
 *   the cheap matmul's float32 accumulation adds at most g |h^| |w^_v| (0 where it is exact,
 *   as int16's), the recompute is within g |h| n_v of l_v, and the result's rounding to its
 *   type b |x_v|, so
 *
 *   |x_v - l~_v| <= E_v = A r_v + B n_v + b |x_v| + c,
 *   A = m |h^| (1 + g),   B = m (|h^ - h| + g |h^| + g (|h^| + |h^ - h|))
 *
 * (g: float32 accumulation over K terms, m: margin for the float arithmetic of the bound, both
 * from the caller with b and c). Per row:
 *
 * - greedy (temperature 0): the argmax of l~ is among the candidates
 *   { v : x_v + E_v >= max_u (x_u - E_u) } (any other u has l~_u <= x_u + E_u below the l~ of
 *   the token that attains the max), which are recomputed; the first of the largest wins, as
 *   torch.argmax picks it.
 * - sampled (temperature T > 0), by rejection: with U_v = x_v + E_v >= l~_v, propose v with
 *   probability proportional to exp(U_v / T) (inverse CDF, like sample.c) and accept it with
 *   probability exp((l~_v - U_v) / T) <= 1. A proposal is accepted with probability
 *   proportional to exp(U_v / T) exp((l~_v - U_v) / T) = exp(l~_v / T): the accepted draw
 *   follows softmax(l~ / T), only the proposal's float rounding apart. Each attempt takes two
 *   uniforms from a splitmix64 stream started at the row's seed, so the draw depends only on
 *   the row and its seed, never on the batch; an attempt costs one token's recompute.
 *
 * The file including this one computes |h^| and |h^ - h| (row_bound turns them into A and B)
 * and each row's upper bounds U_v with their maximum and max (x_v - E_v); pick_row does the
 * rest. It is built with finite math (the bound's max reductions vectorise), so every inf/NaN
 * check looks at exponent bits.
 */
#ifndef CBGEN_HEAD_SELECT_H
#define CBGEN_HEAD_SELECT_H
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "cdf.h"
#include "vexp.h"

static float dot_f32(const float *a, const float *b, int64_t n) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += a[i] * b[i];
        s1 += a[i + 1] * b[i + 1];
        s2 += a[i + 2] * b[i + 2];
        s3 += a[i + 3] * b[i + 3];
    }
    for (; i < n; ++i) s0 += a[i] * b[i];
    return (s0 + s1) + (s2 + s3);
}

typedef struct {
    const float *wres, *wnorm;
    float A, B, b, c;
} bound_t;

static inline int bits_nonfinite(float x) {
    union {
        float f;
        uint32_t u;
    } c = {.f = x};
    return (c.u & 0x7F800000u) == 0x7F800000u;
}

typedef struct {
    const float *up;
    float m, inv_t;
} weights_ctx;

/* proposal weights exp((U_v - max) / T) of 16 tokens from i on, 0 past end */
static inline void weights16(const void *ctx, int64_t i, int64_t end, float *out) {
    const float *up = ((const weights_ctx *)ctx)->up;
    const float m = ((const weights_ctx *)ctx)->m, inv_t = ((const weights_ctx *)ctx)->inv_t;
    const int64_t n = end - i < 16 ? end - i : 16;
    v16 u = (v16){0} + m;
    if (n == 16) {
        u = *(const v16u *)(up + i);
    } else {
        for (int64_t k = 0; k < n; ++k) u[k] = up[i + k];
    }
    v16 w = exp_nonpositive(vmax16((u - m) * inv_t, (v16){0} - 100.0f));
    for (int64_t k = n; k < 16; ++k) w[k] = 0.0f;
    *(v16u *)out = w;
}

static inline uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline double uniform(uint64_t *state) { return (double)(splitmix64(state) >> 11) * 0x1.0p-53; }

static int64_t sample_row(const float *up, int64_t V, float m, float temperature, const float *h,
                          const float *weight, int64_t K, uint64_t seed, int64_t max_attempts) {
    const weights_ctx ctx = {up, m, 1.0f / temperature};
    cdf_t cdf;
    cdf_sums(&cdf, V, weights16, &ctx);
    uint64_t state = seed;
    for (int64_t attempt = 0; attempt < max_attempts; ++attempt) {
        const double target = uniform(&state) * cdf.total;
        const double accept = uniform(&state);
        const int64_t v = cdf_pick(&cdf, target, weights16, &ctx);
        if (v < 0) continue;
        const double lv = (double)dot_f32(h, weight + v * K, K);
        if (accept < exp((lv - (double)up[v]) / (double)temperature)) return v;
    }
    return -1;
}

/* The argmax of l~ over the candidates { v : up[v] >= lo }, the first of the largest; with
 * panel_max (the largest up[] of each 16 tokens, or NULL) whole panels below lo are skipped. */
static int64_t greedy_row(const float *up, int64_t V, float lo, const float *panel_max, const float *h,
                          const float *weight, int64_t K, int64_t *candidates) {
    int64_t best = -1, n = 0;
    float best_val = -FLT_MAX;
    for (int64_t p = 0; p * 16 < V; ++p) {
        if (panel_max != NULL && panel_max[p] < lo) continue;
        const int64_t end = (p + 1) * 16 < V ? (p + 1) * 16 : V;
        for (int64_t v = p * 16; v < end; ++v) {
            if (up[v] < lo) continue;
            ++n;
            const float y = dot_f32(h, weight + v * K, K);
            if (best < 0 || y > best_val) {
                best = v;
                best_val = y;
            }
        }
    }
    *candidates = n;
    return best;
}

typedef struct {
    const float *weight, *wres, *wnorm; /* [V, K], [V], [V] */
    int64_t V, K;
    float g, margin, b, c;
} head_t;

/* The bound's coefficients for a row with nh = |h^| and nd = |h^ - h| (rounded up). */
static inline bound_t row_bound(const head_t *H, double nh, double nd) {
    const double g = H->g;
    const bound_t e = {H->wres, H->wnorm, (float)(H->margin * nh * (1.0 + g)),
                       (float)(H->margin * (nd + g * nh + g * (nh + nd))), H->b, H->c};
    return e;
}

/* One row's token from its upper bounds up[V], their maximum m and lo = max (x_v - E_v);
 * panel_max as for greedy_row. -1 where it cannot be answered here (see the top). */
static int64_t pick_row(const head_t *H, const float *up, float m, float lo, const float *panel_max,
                        const float *h, float temperature, uint64_t seed, int64_t max_attempts,
                        int64_t *candidates) {
    *candidates = 0;
    if (bits_nonfinite(m) || bits_nonfinite(lo)) return -1;
    if (temperature > 0.0f) return sample_row(up, H->V, m, temperature, h, H->weight, H->K, seed, max_attempts);
    return greedy_row(up, H->V, lo, panel_max, h, H->weight, H->K, candidates);
}

#endif

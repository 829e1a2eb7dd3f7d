/* The LM head from bfloat16 logits, exactly (CPU): a greedy row gets the argmax of the float32
 * logits, a sampled row a draw from the float32 softmax(logits / T).
 *
 * The LM head is the largest matmul of a decode step. Its logits are first computed from
 * bfloat16 copies of the hidden state and the head (twice the matmul rate where the CPU has
 * bf16 dot products), each with a proven error bound, and only a few tokens are recomputed in
 * float32. With h^ = bf16(h), w^_v = bf16(w_v), l_v = h . w_v (real) and l~_v its float32
 * recompute here (dot_f32):
 *
 *   h^.w^_v - h.w_v = h^.(w^_v - w_v) + (h^ - h).w_v, at most |h^| r_v + |h^ - h| n_v
 *   (Cauchy-Schwarz; r_v = |w^_v - w_v| and n_v = |w_v| are the head's, fixed at load);
 *   the matmul's float32 accumulation of the exact bf16 products adds at most g |h^| |w^_v|,
 *   the recompute is within g |h| n_v of l_v, and the result's rounding to bf16 b |x_v|, so
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
 *   logits [M, V] bfloat16 (uint16 bits), hidden [M, K] float32 and its bf16 copy hidden16
 *   (the matmul's input), weight [V, K] float32, wres [V] (r_v) and wnorm [V] (n_v), rounded
 *   up; temperature [M] (0: greedy), seed [M], out [M] int64.
 * out[r] is -1 for a row that cannot be answered here (a logit or the hidden state not finite,
 * or max_attempts proposals rejected): the caller takes the float32 path for it. Returns the
 * most candidates a greedy row needed.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cdf.h"
#include "vexp.h"

typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2), may_alias));

static inline float bf16_to_f32(uint16_t x) {
    union {
        uint32_t u;
        float f;
    } c = {.u = (uint32_t)x << 16};
    return c.f;
}

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

static inline float bound(const bound_t *e, int64_t v, float x) {
    return e->A * e->wres[v] + e->B * e->wnorm[v] + e->b * fabsf(x) + e->c;
}

/* upper bounds U_v = x_v + E_v of a row into up[V] and their maximum; -1 when a logit or a
 * bound is not finite (exponent bits all set: the checks look at bits, as this file is built
 * with finite math) */
static int upper_bounds(const uint16_t *l, int64_t V, const bound_t *e, float *up, float *max_out) {
    v16 vm = (v16){0} - FLT_MAX;
    i16v bad = (i16v){0};
    const v16 A = (v16){0} + e->A, B = (v16){0} + e->B, b = (v16){0} + e->b, c = (v16){0} + e->c;
    int64_t v = 0;
    for (; v + 16 <= V; v += 16) {
        const i16v bits = __builtin_convertvector(*(const u16x16 *)(l + v), i16v);
        bad |= (bits & 0x7F80) == 0x7F80;
        const v16 x = (v16)(bits << 16);
        const v16 ax = (v16)((i16v)x & 0x7FFFFFFF);
        const v16 u = x + (A * *(const v16u *)(e->wres + v) + B * *(const v16u *)(e->wnorm + v) + b * ax + c);
        *(v16u *)(up + v) = u;
        vm = vmax16(u, vm);
    }
    float m = -FLT_MAX;
    int nonfinite = 0;
    for (int k = 0; k < 16; ++k) {
        m = vm[k] > m ? vm[k] : m;
        nonfinite |= bad[k] != 0;
    }
    for (; v < V; ++v) {
        nonfinite |= (l[v] & 0x7F80) == 0x7F80;
        const float x = bf16_to_f32(l[v]);
        up[v] = x + bound(e, v, x);
        m = up[v] > m ? up[v] : m;
    }
    /* every U_v is finite if the largest is (x_v is finite and E_v >= 0) */
    union {
        float f;
        uint32_t u;
    } mb = {.f = m};
    *max_out = m;
    return nonfinite || (mb.u & 0x7F800000u) == 0x7F800000u ? -1 : 0;
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

static int64_t greedy_row(const uint16_t *l, const float *up, int64_t V, const float *h,
                          const float *weight, int64_t K, int64_t *candidates) {
    /* lo = max_v (x_v - E_v) = max_v (2 x_v - U_v) */
    float lo = -FLT_MAX;
    for (int64_t v = 0; v < V; ++v) {
        const float d = 2.0f * bf16_to_f32(l[v]) - up[v];
        lo = d > lo ? d : lo;
    }
    int64_t best = -1, n = 0;
    float best_val = -FLT_MAX;
    for (int64_t v = 0; v < V; ++v) {
        if (up[v] < lo) continue;
        ++n;
        const float y = dot_f32(h, weight + v * K, K);
        if (best < 0 || y > best_val) {
            best = v;
            best_val = y;
        }
    }
    *candidates = n;
    return best;
}

int64_t cbgen_head_bf16(const uint16_t *logits, int64_t M, int64_t V, const float *hidden,
                        const uint16_t *hidden16, int64_t K, const float *weight, const float *wres,
                        const float *wnorm, float g, float margin, float b, float c, const float *temperature,
                        const uint64_t *seed, int64_t max_attempts, int64_t *out) {
    int64_t most = 0;
#pragma omp parallel reduction(max : most)
    {
        float *up = malloc((size_t)V * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < M; ++r) {
            out[r] = -1;
            if (up == NULL) continue;
            const float *h = hidden + r * K;
            const uint16_t *h16 = hidden16 + r * K;
            double hh = 0.0, dd = 0.0;
            int nonfinite = 0;
            for (int64_t i = 0; i < K; ++i) {
                nonfinite |= (h16[i] & 0x7F80) == 0x7F80; /* bf16(h) is finite only where h is */
                const double x = (double)bf16_to_f32(h16[i]), d = x - (double)h[i];
                hh += x * x;
                dd += d * d;
            }
            if (nonfinite) continue;
            const double nh = sqrt(hh) * (1.0 + 1e-6), nd = sqrt(dd) * (1.0 + 1e-6);
            const bound_t e = {wres, wnorm, (float)(margin * nh * (1.0 + g)),
                               (float)(margin * (nd + g * nh + g * (nh + nd))), b, c};
            const uint16_t *l = logits + r * V;
            float m;
            if (upper_bounds(l, V, &e, up, &m) != 0) continue;
            if (temperature[r] > 0.0f) {
                out[r] = sample_row(up, V, m, temperature[r], h, weight, K, seed[r], max_attempts);
            } else {
                int64_t n;
                out[r] = greedy_row(l, up, V, h, weight, K, &n);
                most = n > most ? n : most;
            }
        }
        free(up);
    }
    return most;
}

/* The LM head from bfloat16 logits, exactly (CPU): a greedy row gets the argmax of the float32
 * logits, a sampled row a draw from the float32 softmax(logits / T).
 *
 * The LM head is the largest matmul of a decode step. Its logits are first computed from
 * bfloat16 copies of the hidden state and the head (twice the matmul rate where the CPU has
 * bf16 dot products): h^ = bf16(h), w^_v = bf16(w_v), and the bf16 result x_v rounded to bf16
 * (b in head_select.h's bound, whose derivation and selection this file shares with the int16
 * head). Only a few tokens are recomputed in float32.
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

#include "cbgen.h"
#include "head_select.h"

typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2), may_alias));

static inline float bf16_to_f32(uint16_t x) {
    union {
        uint32_t u;
        float f;
    } c = {.u = (uint32_t)x << 16};
    return c.f;
}

static inline float bound(const bound_t *e, int64_t v, float x) {
    return e->A * e->wres[v] + e->B * e->wnorm[v] + e->b * fabsf(x) + e->c;
}

/* A row's upper bounds U_v = x_v + E_v into up[V], their maximum and lo = max_v (x_v - E_v);
 * -1 when a logit or a bound is not finite (every U_v is finite if the largest is: x_v is finite
 * and E_v >= 0). */
static int upper_bounds(const uint16_t *l, int64_t V, const bound_t *e, float *up, float *max_out,
                        float *lo_out) {
    v16 vm = (v16){0} - FLT_MAX, vlo = vm;
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
        vlo = vmax16(2.0f * x - u, vlo);
    }
    float m = -FLT_MAX, lo = -FLT_MAX;
    int nonfinite = 0;
    for (; v < V; ++v) {
        nonfinite |= (l[v] & 0x7F80) == 0x7F80;
        const float x = bf16_to_f32(l[v]);
        up[v] = x + bound(e, v, x);
        m = up[v] > m ? up[v] : m;
        lo = 2.0f * x - up[v] > lo ? 2.0f * x - up[v] : lo;
    }
    for (int k = 0; k < 16; ++k) {
        m = vm[k] > m ? vm[k] : m;
        lo = vlo[k] > lo ? vlo[k] : lo;
        nonfinite |= bad[k] != 0;
    }
    *max_out = m;
    *lo_out = lo;
    return nonfinite || bits_nonfinite(m) ? -1 : 0;
}

int64_t cbgen_head_bf16(const uint16_t *logits, int64_t M, int64_t V, const float *hidden,
                        const uint16_t *hidden16, int64_t K, const float *weight, const float *wres,
                        const float *wnorm, float g, float margin, float b, float c, const float *temperature,
                        const uint64_t *seed, int64_t max_attempts, int64_t *out) {
    const head_t H = {weight, wres, wnorm, V, K, g, margin, b, c};
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
            const bound_t e = row_bound(&H, nh, nd);
            float m, lo;
            if (upper_bounds(logits + r * V, V, &e, up, &m, &lo) != 0) continue;
            int64_t n;
            out[r] = pick_row(&H, up, m, lo, NULL, h, temperature[r], seed[r], max_attempts, &n);
            most = n > most ? n : most;
        }
        free(up);
    }
    return most;
}

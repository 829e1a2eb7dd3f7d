/* Exact greedy decoding over a bfloat16 LM head (CPU).
 *
 * The LM head is the largest matmul of a decode step, and a greedy step needs only its
 * argmax. So the logits are first computed from bfloat16 copies of the hidden state and the
 * head (twice the matmul rate where the CPU has bf16 dot products), each with a proven error
 * bound, and only the tokens that could still be the argmax are recomputed in float32:
 *
 *   |approx_v - exact_v| <= E_v = a * |h| * |w_v| + b * |approx_v| + c
 *
 * (bf16 rounding of each input, fp32 accumulation, bf16 rounding of the result, and
 * Cauchy-Schwarz: sum_i |h_i w_vi| <= |h| |w_v|). The exact argmax v* satisfies
 * approx_v* + E_v* >= exact_v* >= exact_u >= approx_u - E_u for every u, so it is among the
 * candidates { v : approx_v + E_v >= max_u (approx_u - E_u) }, which are recomputed from the
 * float32 weights; the first of the largest wins, as torch.argmax picks it.
 *
 *   logits [M, V] bfloat16 (uint16 bits), hidden [M, K] float32, weight [V, K] float32,
 *   wnorm [V] float32 (|w_v|, rounded up), out [M] int64.
 * Returns the largest candidate count of any row, or -1 when a logit is not finite (the
 * caller then takes the plain float32 path).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

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

#define CHUNK 64

int64_t cbgen_greedy_bf16(const uint16_t *logits, int64_t M, int64_t V, const float *hidden,
                          int64_t K, const float *weight, const float *wnorm, float a, float b,
                          float c, int64_t *out) {
    int64_t most = 0;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(max : most) reduction(| : bad)
    for (int64_t r = 0; r < M; ++r) {
        const uint16_t *l = logits + r * V;
        const float *h = hidden + r * K;
        double ss = 0.0;
        for (int64_t i = 0; i < K; ++i) ss += (double)h[i] * (double)h[i];
        const float ah = (float)(sqrt(ss) * (1.0 + 1e-6)) * a;
        /* lo = max_v (approx_v - E_v); exponent bits all set = inf or NaN */
        float lo = -FLT_MAX;
        uint16_t nonfinite = 0;
        for (int64_t v = 0; v < V; ++v) {
            const uint16_t bits = l[v];
            nonfinite |= (uint16_t)((bits & 0x7F80) == 0x7F80);
            const float x = bf16_to_f32(bits);
            const float d = x - (ah * wnorm[v] + b * fabsf(x) + c);
            lo = d > lo ? d : lo;
        }
        if (nonfinite) {
            bad = 1;
            continue;
        }
        /* candidates: approx_v + E_v >= lo, found chunk by chunk (a chunk whose largest
         * upper bound is below lo holds none) */
        int64_t best = -1, n = 0;
        float best_val = -FLT_MAX;
        float up[CHUNK];
        for (int64_t v0 = 0; v0 < V; v0 += CHUNK) {
            const int64_t len = V - v0 < CHUNK ? V - v0 : CHUNK;
            float top = -FLT_MAX;
            for (int64_t i = 0; i < len; ++i) {
                const float x = bf16_to_f32(l[v0 + i]);
                up[i] = x + (ah * wnorm[v0 + i] + b * fabsf(x) + c);
                top = up[i] > top ? up[i] : top;
            }
            if (top < lo) continue;
            for (int64_t i = 0; i < len; ++i) {
                if (up[i] < lo) continue;
                ++n;
                const float y = dot_f32(h, weight + (v0 + i) * K, K);
                if (best < 0 || y > best_val) {
                    best = v0 + i;
                    best_val = y;
                }
            }
        }
        out[r] = best;
        most = n > most ? n : most;
    }
    return bad ? -1 : most;
}

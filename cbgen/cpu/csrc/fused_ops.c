/* Fused element-wise ops for the CPU float32 path. Each replaces 3-6 torch ops whose
 * per-call overhead (and thread hand-off) dominates at decode sizes. The float operations
 * are those of the reference formulation, in the same order, with no FMA contraction
 * (-ffp-contract=off), except the RMS reduction, accumulated in double.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_round.h" /* to_bf16 */
#include "cbgen.h"

#define PAR_MIN_ELEMS (1 << 18)

/* o[i] = w[i] * (r[i] * rsqrt(ss / n + eps)) for the row r of n floats whose sum of squares
 * (in double) is ss; o may be r. */
static inline void norm_row(const float *r, double ss, int64_t n, const float *w, float eps,
                            float *o) {
    const float var = (float)(ss / (double)n);
    const float inv = 1.0f / sqrtf(var + eps);
    for (int64_t i = 0; i < n; ++i) {
        const float v = r[i] * inv;
        o[i] = w[i] * v;
    }
}

/* residual (in/out) [T, H], x [T, H] or NULL, w [H], out [T, H]:
 *   if x: residual = residual + x;   out = w * (residual * rsqrt(mean(residual^2) + eps)) */
void cbgen_add_rmsnorm_f32(float *residual, const float *x, const float *w, float eps,
                           int64_t T, int64_t H, float *out) {
#pragma omp parallel for if (T * H >= PAR_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        float *r = residual + t * H;
        double ss = 0.0;
        if (x) {
            const float *xr = x + t * H;
            for (int64_t i = 0; i < H; ++i) {
                const float h = r[i] + xr[i];
                r[i] = h;
                ss += (double)h * (double)h;
            }
        } else {
            for (int64_t i = 0; i < H; ++i) ss += (double)r[i] * (double)r[i];
        }
        norm_row(r, ss, H, w, eps, out + t * H);
    }
}

/* The same RMSNorm, in place, over each of the first `heads` heads of D floats of every row of
 * x [T, >= heads * D] (rows row_stride floats apart), with one weight w [D] for all heads:
 * Qwen3's and Gemma 3's q and k norms, straight in the rows of the QKV projection. */
void cbgen_rmsnorm_heads_f32(float *x, int64_t row_stride, int64_t T, int64_t heads, int64_t D,
                             const float *w, float eps) {
#pragma omp parallel for if (T * heads * D >= PAR_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < heads; ++h) {
            float *r = x + t * row_stride + h * D;
            double ss = 0.0;
            for (int64_t i = 0; i < D; ++i) ss += (double)r[i] * (double)r[i];
            norm_row(r, ss, D, w, eps, r);
        }
}

/* In-place RoPE (rotate-half form) on x [T, heads, D] with row stride row_stride (floats);
 * cos/sin tables [max_pos, D/2]; positions [T].
 *   [x1, x2] -> [x1 c - x2 s, x2 c + x1 s] */
void cbgen_rope_f32(float *x, int64_t row_stride, int64_t T, int64_t heads, int64_t D,
                    const int64_t *positions, const float *cos_t, const float *sin_t) {
    const int64_t half = D / 2;
#pragma omp parallel for if (T * heads * D >= PAR_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const float *c = cos_t + positions[t] * half;
        const float *s = sin_t + positions[t] * half;
        for (int64_t h = 0; h < heads; ++h) {
            float *v = x + t * row_stride + h * D;
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = v[i], x2 = v[i + half];
                const float a = x1 * c[i], b = x2 * s[i];
                const float e = x2 * c[i], f = x1 * s[i];
                v[i] = a - b;
                v[i + half] = e + f;
            }
        }
    }
}

/* Paged KV write: row t of key and value (row strides k_stride / v_stride floats, each row
 * `row` contiguous floats = Hkv * D) goes to flat slot slots[t] of k_cache / v_cache
 * ([num_slots, row] each); a negative slot is skipped. One call per layer replaces two
 * index_copy_ calls (and their dtype/contiguity checks) at decode sizes. Returns -1, writing
 * nothing, when a slot is past the cache. */
int cbgen_write_kv_f32(const float *key, int64_t k_stride, const float *value, int64_t v_stride,
                       float *k_cache, float *v_cache, int64_t num_slots, const int64_t *slots,
                       int64_t T, int64_t row) {
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= num_slots) return -1;
#pragma omp parallel for if (T * row >= PAR_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        memcpy(k_cache + s * row, key + t * k_stride, sizeof(float) * (size_t)row);
        memcpy(v_cache + s * row, value + t * v_stride, sizeof(float) * (size_t)row);
    }
    return 0;
}

/* cbgen_write_kv_f32 into a bfloat16 cache: each value rounded as torch's .to(bfloat16). */
int cbgen_write_kv_bf16(const float *key, int64_t k_stride, const float *value, int64_t v_stride,
                        uint16_t *k_cache, uint16_t *v_cache, int64_t num_slots,
                        const int64_t *slots, int64_t T, int64_t row) {
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= num_slots) return -1;
#pragma omp parallel for if (T * row >= PAR_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        for (int64_t i = 0; i < row; ++i) {
            k_cache[s * row + i] = to_bf16(key[t * k_stride + i]);
            v_cache[s * row + i] = to_bf16(value[t * v_stride + i]);
        }
    }
    return 0;
}

/* Temperature sampling by inverse CDF, one row per thread, each row read twice while it sits
 * in the core's cache (the torch path makes six passes over the whole [B, V] block: divide,
 * max, subtract, exp, cumsum, search).
 *
 *   x_v = logits_v / temperature,   w_v = exp(x_v - max_u x_u),
 *   token = the first v whose running sum w_0 + ... + w_v exceeds u * sum_v w_v.
 *
 * Running sums are kept in double: the pick depends only on the row, its temperature and u,
 * never on the batch. A zero-weight token (a logit of -inf) is never picked: adding zero
 * cannot carry the running sum past the target. Pass 1 takes the maximum; pass 2 sums the
 * weights a chunk at a time; the chunk where the target falls is then scanned token by token.
 *
 *   logits [B, V] float32 (row stride ld), temperature [B] float32 (> 0), u [B] float32 in
 *   [0, 1), out [B] int64.
 * Returns 0, or -1 when some row has a NaN or +inf logit or no positive weight (the caller
 * then takes the torch path for the whole call).
 */
#include <math.h>
#include <stdint.h>

#include "cdf.h"
#include "vexp.h"

/* Sixteen tokens from i on (fewer at the row's end, the rest -inf: weight 0), divided by the
 * temperature unless it is 1. */
static inline v16 load16(const float *l, int64_t i, int64_t end, float temperature) {
    v16 x;
    if (i + 16 <= end) {
        x = *(const v16u *)(l + i);
    } else {
        x = (v16){0} - INFINITY;
        for (int64_t k = 0; i + k < end; ++k) x[k] = l[i + k];
    }
    return temperature == 1.0f ? x : x / temperature;
}

typedef struct {
    const float *l;
    float temperature, m;
} weights_ctx;

/* exp(x_v / T - max) of sixteen tokens from i on, 0 past end */
static inline v16 weights16(const void *ctx, int64_t i, int64_t end) {
    const weights_ctx *c = ctx;
    return exp_nonpositive(load16(c->l, i, end, c->temperature) - c->m);
}

static int sample_row(const float *l, int64_t V, float temperature, float u, int64_t *out) {
    /* pass 1: the largest logit (division by T > 0 keeps the order, also once rounded, so the
     * largest quotient is the largest logit's); NaN and +inf are refused: the torch path
     * decides what they mean */
    v16 vm = (v16){0} - INFINITY;
    i16v vbad = (i16v){0};
    for (int64_t v = 0; v < V; v += 16) {
        const v16 x = load16(l, v, V, 1.0f);
        vm = vmax16(x, vm);
        vbad |= nan_or_inf16(x);
    }
    float m = -INFINITY;
    int bad = 0;
    for (int k = 0; k < 16; ++k) {
        m = vm[k] > m ? vm[k] : m;
        bad |= vbad[k] != 0;
    }
    if (bad || m == -INFINITY) return -1;
    if (temperature != 1.0f) m /= temperature;
    if (m == INFINITY) return -1; /* a quotient overflowed (T < 1): the largest one did */
    /* pass 2: the weights' sum by chunk; then the chunk where u x total falls, and the token */
    const weights_ctx ctx = {l, temperature, m};
    cdf_t cdf;
    cdf_sums(&cdf, V, weights16, &ctx);
    *out = cdf_pick(&cdf, (double)u * cdf.total, weights16, &ctx);
    return *out < 0 ? -1 : 0;
}

int cbgen_sample_f32(const float *logits, int64_t B, int64_t V, int64_t ld, const float *temperature,
                     const float *u, int64_t *out) {
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : bad)
    for (int64_t r = 0; r < B; ++r) bad |= sample_row(logits + r * ld, V, temperature[r], u[r], out + r) != 0;
    return bad ? -1 : 0;
}

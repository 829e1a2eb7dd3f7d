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

#include "cbgen.h"
#include "cdf.h"
#include "vexp.h"

typedef struct {
    const float *l;
    float temperature, m;
} weights_ctx;

/* exp(x_v / T - max) of sixteen tokens from i on (the division skipped when T is 1), 0 past end */
static inline void weights16(const void *ctx, int64_t i, int64_t end, float *out) {
    const weights_ctx *c = ctx;
    const float *x = c->l + i;
    float tail[16];
    if (i + 16 > end) { /* past the row's end: -inf, weight 0 */
        for (int64_t k = 0; k < 16; ++k) tail[k] = i + k < end ? x[k] : -INFINITY;
        x = tail;
    }
#ifdef CBGEN_V16_HALVES
    for (int h = 0; h < 16; h += 8) {
        v8 v = *(const v8u *)(x + h);
        if (c->temperature != 1.0f) v = v / c->temperature;
        *(v8u *)(out + h) = exp8(v - c->m);
    }
#else
    v16 v = *(const v16u *)x;
    if (c->temperature != 1.0f) v = v / c->temperature;
    *(v16u *)out = exp_nonpositive(v - c->m);
#endif
}

static int sample_row(const float *l, int64_t V, float temperature, float u, int64_t *out) {
    /* pass 1: the largest logit (division by T > 0 keeps the order, also once rounded, so the
     * largest quotient is the largest logit's); NaN and +inf are refused: the torch path
     * decides what they mean */
    vn vm = (vn){0} - INFINITY;
    ivn vbad = (ivn){0};
    int64_t v = 0;
    for (; v + VN <= V; v += VN) { /* in the register's width: a maximum and an or, exact either way */
        const vn x = *(const vnu *)(l + v);
        vm = vmax_vn(x, vm);
        vbad |= (x != x) | (x == INFINITY);
    }
    float lanes[VN];
    int32_t bad_lanes[VN];
    *(vnu *)lanes = vm;
    *(ivn *)bad_lanes = vbad;
    float m = -INFINITY;
    int bad = 0;
    for (int k = 0; k < VN; ++k) {
        m = lanes[k] > m ? lanes[k] : m;
        bad |= bad_lanes[k] != 0;
    }
    for (; v < V; ++v) {
        m = l[v] > m ? l[v] : m;
        bad |= l[v] != l[v] || l[v] == INFINITY;
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

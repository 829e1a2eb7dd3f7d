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

static int sample_row(const float *l, int64_t V, float temperature, float u, int64_t *out) {
    /* pass 1: the largest logit (division by T > 0 keeps the order, also once rounded, so the
     * largest quotient is the largest logit's); NaN and +inf are refused: the torch path
     * decides what they mean */
    v16 vm = (v16){0} - INFINITY;
    i16v vbad = (i16v){0};
    for (int64_t v = 0; v < V; v += 16) {
        const v16 x = load16(l, v, V, 1.0f);
        vm = vmax16(x, vm);
        vbad |= (x != x) | (x == INFINITY);
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
    /* pass 2: the weights' sum by chunk, at most 256 chunks of a multiple of 16 tokens */
    const int64_t chunk = ((V + 255) / 256 + 15) / 16 * 16;
    const int64_t nchunks = (V + chunk - 1) / chunk;
    double sums[256];
    double total = 0.0;
    for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t hi = (c + 1) * chunk < V ? (c + 1) * chunk : V;
        v16 acc = (v16){0};
        for (int64_t i = c * chunk; i < hi; i += 16) acc += exp_nonpositive(load16(l, i, hi, temperature) - m);
        double s = 0.0;
        for (int k = 0; k < 16; ++k) s += (double)acc[k];
        sums[c] = s;
        total += s;
    }
    /* the chunk where the target falls, then the token inside it */
    const double target = (double)u * total;
    double run = 0.0;
    int64_t c = 0;
    while (c < nchunks - 1 && run + sums[c] <= target) run += sums[c++];
    const int64_t hi = (c + 1) * chunk < V ? (c + 1) * chunk : V;
    int64_t last = -1;
    for (int64_t i = c * chunk; i < hi; i += 16) {
        const v16 w = exp_nonpositive(load16(l, i, hi, temperature) - m);
        for (int k = 0; k < 16 && i + k < hi; ++k) {
            if (w[k] > 0.0f) {
                last = i + k;
                run += (double)w[k];
                if (run > target) {
                    *out = last;
                    return 0;
                }
            }
        }
    }
    /* the chunk sum was taken lane by lane, the scan in order: if rounding leaves the target
     * just past the scan, the chunk's last weighted token is where the sum crossed it */
    *out = last;
    return last < 0 ? -1 : 0;
}

int cbgen_sample_f32(const float *logits, int64_t B, int64_t V, int64_t ld, const float *temperature,
                     const float *u, int64_t *out) {
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : bad)
    for (int64_t r = 0; r < B; ++r) bad |= sample_row(logits + r * ld, V, temperature[r], u[r], out + r) != 0;
    return bad ? -1 : 0;
}

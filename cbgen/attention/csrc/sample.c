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
 * weights CHUNK at a time; the chunk where the target falls is then scanned token by token.
 *
 *   logits [B, V] float32 (row stride ld), temperature [B] float32 (> 0), u [B] float32 in
 *   [0, 1), out [B] int64.
 * Returns 0, or -1 when some row has a NaN or +inf logit or no positive weight (the caller
 * then takes the torch path for the whole call).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vexp.h"

#define CHUNK 256

static int sample_row(const float *l, int64_t V, float temperature, float u, int64_t *out) {
    const int scale = temperature != 1.0f;
    /* pass 1: max of x (NaN and +inf are refused: the torch path decides what they mean) */
    v16 vm = (v16){0} - INFINITY;
    int64_t v = 0;
    i16v vbad = (i16v){0};
    for (; v + 16 <= V; v += 16) {
        v16 x = *(const v16u *)(l + v);
        if (scale) x = x / temperature;
        const i16v gt = x > vm;
        vm = (v16)(((i16v)x & gt) | ((i16v)vm & ~gt));
        vbad |= (x != x) | (x == INFINITY); /* NaN or +inf */
    }
    float m = -INFINITY;
    int bad = 0;
    for (int i = 0; i < 16; ++i) {
        m = vm[i] > m ? vm[i] : m;
        bad |= vbad[i] != 0;
    }
    for (; v < V; ++v) {
        const float x = scale ? l[v] / temperature : l[v];
        bad |= x != x || x == INFINITY;
        m = x > m ? x : m;
    }
    if (bad || m == -INFINITY) return -1;
    /* pass 2: the weights' sum by chunk */
    const int64_t nchunks = (V + CHUNK - 1) / CHUNK;
    double stack_sums[256];
    double *sums = nchunks <= 256 ? stack_sums : malloc(sizeof(double) * nchunks);
    if (sums == NULL) return -1;
    double total = 0.0;
    for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t lo = c * CHUNK, hi = lo + CHUNK < V ? lo + CHUNK : V;
        int64_t i = lo;
        v16 acc = (v16){0};
        for (; i + 16 <= hi; i += 16) {
            v16 x = *(const v16u *)(l + i);
            if (scale) x = x / temperature;
            acc += exp_nonpositive(x - m);
        }
        double s = 0.0;
        for (int k = 0; k < 16; ++k) s += (double)acc[k];
        for (; i < hi; ++i) {
            const float x = scale ? l[i] / temperature : l[i];
            v16 t = (v16){0};
            t[0] = x - m;
            s += (double)exp_nonpositive(t)[0];
        }
        sums[c] = s;
        total += s;
    }
    /* the chunk where the target falls, then the token inside it */
    const double target = (double)u * total;
    double run = 0.0;
    int64_t c = 0;
    while (c < nchunks - 1 && run + sums[c] <= target) run += sums[c++];
    if (sums != stack_sums) free(sums);
    const int64_t lo = c * CHUNK, hi = lo + CHUNK < V ? lo + CHUNK : V;
    int64_t pick = -1, last = -1;
    for (int64_t i = lo; i < hi && pick < 0; i += 16) {
        v16 t = (v16){0} - INFINITY;
        const int64_t n = hi - i < 16 ? hi - i : 16;
        for (int64_t k = 0; k < n; ++k) t[k] = scale ? l[i + k] / temperature : l[i + k];
        const v16 w = exp_nonpositive(t - m);
        for (int64_t k = 0; k < n; ++k) {
            if (w[k] > 0.0f) {
                last = i + k;
                run += (double)w[k];
                if (run > target) {
                    pick = i + k;
                    break;
                }
            }
        }
    }
    /* the chunk sum was taken lane by lane, the scan in order: if rounding leaves the target
     * just past the scan, the chunk's last weighted token is where the sum crossed it */
    if (pick < 0) pick = last;
    if (pick < 0) return -1;
    *out = pick;
    return 0;
}

int cbgen_sample_f32(const float *logits, int64_t B, int64_t V, int64_t ld, const float *temperature,
                     const float *u, int64_t *out) {
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : bad)
    for (int64_t r = 0; r < B; ++r) bad |= sample_row(logits + r * ld, V, temperature[r], u[r], out + r) != 0;
    return bad ? -1 : 0;
}

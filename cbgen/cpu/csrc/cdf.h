/* Inverse-CDF draws over one row of V token weights, shared by the temperature sampler
 * (sample.c) and the bf16 head's proposals (bf16_head.c). The weights are summed by chunk (at
 * most CDF_CHUNKS chunks of a multiple of 16 tokens, each sum in double); a draw finds the
 * chunk where target = u x total falls, then scans it token by token. A weight function
 * w(ctx, i, end, out) writes the weights of tokens [i, i + 16) to out, 0 at and past end; the
 * callers' functions are static inline and passed as constants, so the calls inline. The
 * weights go through a 16-float buffer rather than a 16-float vector value: on AVX2, GCC moves
 * such a value between functions through the stack 8 bytes at a time. */
#ifndef CBGEN_CDF_H
#define CBGEN_CDF_H
#include <stdint.h>

#include "vexp.h"

#define CDF_CHUNKS 256

typedef void (*cdf_weights_fn)(const void *ctx, int64_t i, int64_t end, float *out);

typedef struct {
    int64_t V, chunk, nchunks;
    double total;
    double sums[CDF_CHUNKS];
} cdf_t;

static inline __attribute__((always_inline)) void cdf_sums(cdf_t *cdf, int64_t V, cdf_weights_fn w, const void *ctx) {
    cdf->V = V;
    cdf->chunk = ((V + CDF_CHUNKS - 1) / CDF_CHUNKS + 15) / 16 * 16;
    cdf->nchunks = (V + cdf->chunk - 1) / cdf->chunk;
    cdf->total = 0.0;
    for (int64_t c = 0; c < cdf->nchunks; ++c) {
        const int64_t hi = (c + 1) * cdf->chunk < V ? (c + 1) * cdf->chunk : V;
        float wv[16] __attribute__((aligned(64))), lanes[16] __attribute__((aligned(64)));
#ifdef CBGEN_V16_HALVES /* the same 16 lane sums, in AVX2's two registers */
        v8 lo = (v8){0}, up = (v8){0};
        for (int64_t i = c * cdf->chunk; i < hi; i += 16) {
            w(ctx, i, hi, wv);
            lo += *(const v8 *)wv;
            up += *(const v8 *)(wv + 8);
        }
        *(v8 *)lanes = lo;
        *(v8 *)(lanes + 8) = up;
#else
        v16 acc = (v16){0};
        for (int64_t i = c * cdf->chunk; i < hi; i += 16) {
            w(ctx, i, hi, wv);
            acc += *(const v16 *)wv;
        }
        *(v16 *)lanes = acc;
#endif
        double s = 0.0;
        for (int k = 0; k < 16; ++k) s += (double)lanes[k];
        cdf->sums[c] = s;
        cdf->total += s;
    }
}

/* The first token whose running weight passes target, or -1 if no token has weight. The chunk
 * sums were taken lane by lane, the scan goes in order: if rounding leaves the target just past
 * the scan, the chunk's last weighted token is where the sum crossed it. */
static inline __attribute__((always_inline)) int64_t cdf_pick(const cdf_t *cdf, double target, cdf_weights_fn w,
                                                               const void *ctx) {
    double run = 0.0;
    int64_t c = 0;
    while (c < cdf->nchunks - 1 && run + cdf->sums[c] <= target) run += cdf->sums[c++];
    const int64_t hi = (c + 1) * cdf->chunk < cdf->V ? (c + 1) * cdf->chunk : cdf->V;
    int64_t last = -1;
    for (int64_t i = c * cdf->chunk; i < hi; i += 16) {
        float wv[16] __attribute__((aligned(64)));
        w(ctx, i, hi, wv);
        for (int k = 0; k < 16 && i + k < hi; ++k) {
            if (wv[k] > 0.0f) {
                last = i + k;
                run += (double)wv[k];
                if (run > target) return last;
            }
        }
    }
    return last;
}

#endif

/* The MLP's activation for the CPU float32 path, one pass over the gate-up projection:
 *
 *   out[t, i] = silu(gu[t, i]) * gu[t, I + i],   silu(g) = g / (1 + exp(-g))
 *
 * for gu [T, 2I] (gate, then up, in each row) and out [T, I], both contiguous. torch would
 * take three passes (split views, silu, mul) and a temporary of T x I floats; at prefill
 * sizes each pass streams megabytes. The exp is vexp.h's (within 3 ulp of expf), so results
 * agree with torch's to a few ulp, not bit for bit: with e = exp(-|g|) <= 1,
 *   g >= 0:  g / (1 + e)        g < 0:  g e / (1 + e)
 * which never overflows. Below g = -87.33 the exp flushes to 0, and so does the result (under
 * 1e-36 in size there). silu(+inf) = +inf; silu(-inf) and silu(NaN) are NaN, as in torch.
 * GeGLU (Gemma) takes the same pass with GELU's tanh form in place of SiLU: below.
 */
#include <stdint.h>

#include "cbgen.h"
#include "gated.h" /* silu_mul_vn, gelu_tanh_mul_vn */

/* Every core from 32 Ki outputs (SmolLM2's 1536-wide MLP: 22 rows): measured on 2 cores, 32
 * rows 20.1 -> 11.1 us, 64 rows 40.1 -> 22.8 us; at 16 rows (10.9 us) a second core would
 * save less than it costs to start. */
#define PAR_MIN_ELEMS (1 << 15)

/* out[t, i] = act(gu[t, i]) * gu[t, I + i], one vector of i at a time (a tail padded) */
#define GATED(NAME, ACT)                                                                          \
    void NAME(const float *gu, int64_t T, int64_t I, float *out) {                                \
        _Pragma("omp parallel for if (T * I >= PAR_MIN_ELEMS) schedule(static)")                  \
        for (int64_t t = 0; t < T; ++t) {                                                         \
            const float *g = gu + t * 2 * I, *u = g + I;                                          \
            float *o = out + t * I;                                                               \
            int64_t i = 0;                                                                        \
            for (; i + VN <= I; i += VN)                                                          \
                *(vnu *)(o + i) = ACT(*(const vnu *)(g + i), *(const vnu *)(u + i));              \
            if (i < I) {                                                                          \
                vn gv = {0}, uv = {0};                                                            \
                for (int j = 0; i + j < I; ++j) {                                                 \
                    gv[j] = g[i + j];                                                             \
                    uv[j] = u[i + j];                                                             \
                }                                                                                 \
                const vn r = ACT(gv, uv);                                                         \
                for (int j = 0; i + j < I; ++j) o[i + j] = r[j];                                  \
            }                                                                                     \
        }                                                                                         \
    }

GATED(cbgen_silu_mul_f32, silu_mul_vn)
GATED(cbgen_gelu_tanh_mul_f32, gelu_tanh_mul_vn)

/* y[r, :NR] = act(g[r, :NR]) * u[r, :NR] for the rows of a tile of 32 columns (g and u with rows
 * of 32, y with rows of ldy), act 0: SiLU, 1: GELU's tanh form: for a gate-up matmul that applies
 * the activation to its tiles in a file built with other flags (small_gemm_bf16.c), compiled here
 * so that its bits are this file's. */
void cbgen_gated_tile(const float *g, const float *u, int64_t rows, int act, float *y,
                      int64_t ldy) {
    for (int64_t r = 0; r < rows; ++r)
        for (int v = 0; v < 32; v += VN) {
            const vn gv = *(const vnu *)(g + r * 32 + v), uv = *(const vnu *)(u + r * 32 + v);
            *(vnu *)(y + r * ldy + v) = act ? gelu_tanh_mul_vn(gv, uv) : silu_mul_vn(gv, uv);
        }
}

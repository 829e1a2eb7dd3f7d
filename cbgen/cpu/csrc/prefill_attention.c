/* Causal attention of a prompt chunk on the CPU, float32 (a flash-attention loop).
 *
 *   q      [Q, H, D]    query rows `q_stride` floats apart (heads contiguous in a row)
 *   k, v   [L, Hkv, D]  contiguous, L = ctx + Q: the chunk's cached context, then itself
 *   out    [Q, H, D]    rows `o_stride` floats apart
 *
 * Query row t sits at position ctx + t and sees keys 0 .. ctx + t; with a sliding window W > 0,
 * only keys ctx + t - W + 1 .. ctx + t. Scores s (after scale) become softcap * tanh(s / softcap)
 * where softcap > 0. Query head h reads KV head h / (H / Hkv). D is 64 or 128.
 *
 * K is first transposed per KV head ([Hkv][D][L], zero-padded to whole steps), so that the
 * scores of RB query rows against KT keys are a register tile of outer products: one
 * broadcast of a query element against two 16-key vectors per row and dimension. Each work item
 * (a query head, RB consecutive rows) walks the visible keys KC at a time (two tiles) with an
 * online softmax (running max and sum per row, earlier output rescaled when the max grows) and
 * adds P x V into its output rows, a few rows at a time held in registers. The softmax's
 * reductions and rescaling cost about as much per step as a tile's FMAs, hence two tiles a step
 * (32 keys a step measured ~10 % slower). Items are handed out longest first (the last rows see
 * the most keys) to even out the causal triangle.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vexp.h" /* v16, v16u, i16v, vmax16, exp_nonpositive */

#define RB 8  /* query rows per work item */
#define KC 64 /* keys per softmax step: two 32-key score tiles */
#define KT 32 /* keys per score tile: two 16-float vectors */
#define MAX_D 128

/* P x V for one chunk: rows [r, r + RG) of o (D = 16 DV floats) += p[row][0..nj) x V rows. */
#define PV(DV, RG)                                                                            \
    static void pv_##DV##_##RG(float (*o)[MAX_D], const float (*p)[KC], int r, const float *v, \
                               int64_t v_stride, int64_t nj) {                                \
        v16 acc[RG][DV];                                                                      \
        for (int i = 0; i < RG; ++i)                                                          \
            for (int c = 0; c < DV; ++c) acc[i][c] = *(const v16 *)(o[r + i] + 16 * c);      \
        for (int64_t j = 0; j < nj; ++j) {                                                    \
            const float *vr = v + j * v_stride;                                               \
            v16 vv[DV];                                                                       \
            for (int c = 0; c < DV; ++c) vv[c] = *(const v16u *)(vr + 16 * c);                \
            for (int i = 0; i < RG; ++i) {                                                    \
                const float pj = p[r + i][j];                                                 \
                for (int c = 0; c < DV; ++c) acc[i][c] += pj * vv[c];                         \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < RG; ++i)                                                          \
            for (int c = 0; c < DV; ++c) *(v16 *)(o[r + i] + 16 * c) = acc[i][c];            \
    }
PV(4, 4)
PV(8, 2)

/* Lane permutations that swap halves of 16, 8, 4 and 2 lanes: four steps reduce 16 lanes. */
static const i16v SWAP8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
static const i16v SWAP4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
static const i16v SWAP2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
static const i16v SWAP1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};

static inline float hmax16(v16 a) {
    a = vmax16(a, __builtin_shuffle(a, SWAP8));
    a = vmax16(a, __builtin_shuffle(a, SWAP4));
    a = vmax16(a, __builtin_shuffle(a, SWAP2));
    a = vmax16(a, __builtin_shuffle(a, SWAP1));
    return a[0];
}

static inline float hsum16(v16 a) {
    a += __builtin_shuffle(a, SWAP8);
    a += __builtin_shuffle(a, SWAP4);
    a += __builtin_shuffle(a, SWAP2);
    a += __builtin_shuffle(a, SWAP1);
    return a[0];
}

static void item(const float *q, int64_t q_stride, const float *kt, int64_t lp, const float *v,
                 int64_t v_stride, float *out, int64_t o_stride, int64_t D, int64_t r0, int64_t nr,
                 int64_t ctx, float scale, int64_t window, float softcap) {
    float qb[RB][MAX_D] __attribute__((aligned(64)));
    float o[RB][MAX_D] __attribute__((aligned(64)));
    float p[RB][KC] __attribute__((aligned(64)));
    float m[RB], l[RB];
    for (int r = 0; r < RB; ++r) {
        for (int64_t d = 0; d < D; ++d) qb[r][d] = r < nr ? q[(r0 + r) * q_stride + d] : 0.0f;
        for (int64_t d = 0; d < D; ++d) o[r][d] = 0.0f;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int64_t nkeys = ctx + r0 + nr; /* keys the block's last row sees */
    /* the first row's first key, rounded down to a step: the steps before see nothing */
    const int64_t first = window > 0 && ctx + r0 >= window ? (ctx + r0 - window + 1) / KC * KC : 0;
    for (int64_t j0 = first; j0 < nkeys; j0 += KC) {
        for (int64_t t0 = 0; t0 < KC && j0 + t0 < nkeys; t0 += KT) {
            v16 a0[RB], a1[RB];
            for (int r = 0; r < RB; ++r) a0[r] = a1[r] = (v16){0};
            const float *kc = kt + j0 + t0;
            for (int64_t d = 0; d < D; ++d) {
                const v16 b0 = *(const v16u *)(kc + d * lp), b1 = *(const v16u *)(kc + d * lp + 16);
                for (int r = 0; r < RB; ++r) {
                    const float x = qb[r][d];
                    a0[r] += x * b0;
                    a1[r] += x * b1;
                }
            }
            for (int r = 0; r < RB; ++r) {
                *(v16 *)(p[r] + t0) = a0[r] * scale;
                *(v16 *)(p[r] + t0 + 16) = a1[r] * scale;
            }
        }
        if (softcap > 0.0f) {
            const float inv = 1.0f / softcap;
            for (int r = 0; r < RB; ++r)
                for (int j = 0; j < KC; ++j) p[r][j] = softcap * tanhf(p[r][j] * inv);
        }
        for (int r = 0; r < RB; ++r) {
            /* the row's visible keys in this step, [lo, last] (rows past nr see none) */
            const int64_t last = r < nr ? ctx + r0 + r - j0 : -1;
            const int64_t lo = window > 0 ? ctx + r0 + r - window + 1 - j0 : 0;
            if (last < KC - 1)
                for (int64_t j = last + 1 > 0 ? last + 1 : 0; j < KC; ++j) p[r][j] = -INFINITY;
            for (int64_t j = 0; j < lo && j < KC; ++j) p[r][j] = -INFINITY;
            if (last < 0 || lo >= KC) {
                for (int j = 0; j < KC; ++j) p[r][j] = 0.0f;
                continue;
            }
            v16 s[KC / 16];
            for (int c = 0; c < KC / 16; ++c) s[c] = *(const v16 *)(p[r] + 16 * c);
            /* a NaN score never becomes the max; its exp is NaN and spreads to the row's output */
            float cm = hmax16(vmax16(vmax16(s[0], s[1]), vmax16(s[2], s[3])));
            if (cm != cm) cm = -INFINITY;
            const float mn = cm > m[r] ? cm : m[r];
            const float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - mn);
            v16 e = (v16){0};
            for (int c = 0; c < KC / 16; ++c) {
                const v16 ec = exp_nonpositive(s[c] - mn);
                *(v16 *)(p[r] + 16 * c) = ec;
                e += ec;
            }
            l[r] = l[r] * alpha + hsum16(e);
            m[r] = mn;
            if (alpha != 1.0f)
                for (int64_t d = 0; d < D; ++d) o[r][d] *= alpha;
        }
        const int64_t nj = nkeys - j0 < KC ? nkeys - j0 : KC;
        const float *vc = v + j0 * v_stride;
        if (D == 64)
            for (int r = 0; r < RB; r += 4) pv_4_4(o, (const float(*)[KC])p, r, vc, v_stride, nj);
        else
            for (int r = 0; r < RB; r += 2) pv_8_2(o, (const float(*)[KC])p, r, vc, v_stride, nj);
    }
    for (int r = 0; r < nr; ++r) {
        float *dst = out + (r0 + r) * o_stride;
        for (int64_t d = 0; d < D; ++d) dst[d] = o[r][d] / l[r];
    }
}

/* Returns 0, or -1 for a shape it does not take (D not 64 or 128, H not a multiple of Hkv). */
int cbgen_prefill_attention_f32(const float *q, int64_t q_stride, const float *k, const float *v,
                                float *out, int64_t o_stride, int64_t Q, int64_t ctx, int64_t H,
                                int64_t Hkv, int64_t D, float scale, int64_t window,
                                float softcap) {
    if ((D != 64 && D != 128) || Hkv <= 0 || H % Hkv || Q <= 0 || ctx < 0 || window < 0) return -1;
    const int64_t L = ctx + Q, lp = (L + KC - 1) / KC * KC, group = H / Hkv;
    float *kt = aligned_alloc(64, (size_t)(Hkv * D * lp) * sizeof(float));
    if (!kt) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t hd = 0; hd < Hkv * D; ++hd) {
        const int64_t h = hd / D, d = hd % D;
        float *dst = kt + hd * lp;
        for (int64_t j = 0; j < L; ++j) dst[j] = k[(j * Hkv + h) * D + d];
        for (int64_t j = L; j < lp; ++j) dst[j] = 0.0f;
    }
    const int64_t blocks = (Q + RB - 1) / RB, items = blocks * H;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t b = blocks - 1 - it / H, h = it % H, hk = h / group; /* last rows first */
        const int64_t r0 = b * RB, nr = Q - r0 < RB ? Q - r0 : RB;
        item(q + h * D, q_stride, kt + hk * D * lp, lp, v + hk * D, Hkv * D, out + h * D, o_stride, D,
             r0, nr, ctx, scale, window, softcap);
    }
    free(kt);
    return 0;
}

/* How the cpu attention backend splits prompt chunks with this build (measured in
 * docs/PERFORMANCE.md): a chunk whose query tokens read at most cbgen_native_prefill_rows() K/V rows
 * in all goes to the decode kernel, one token at a time (a call of this kernel costs about as much
 * as 8k such rows with AVX-512); a larger one to this kernel where cbgen_prefill_kernel_preferred(),
 * else to torch's SDPA. Without AVX-512 the 8-row x 32-key score tile and the P x V tiles need twice
 * the 16 vector registers of AVX2 and spill: on an AVX2-only EPYC this kernel measured 5-25x slower than the
 * decode kernel and up to 17x slower than SDPA, which the decode kernel crosses near 24k rows. */
#if defined(__AVX2__) && !defined(__AVX512F__)
int64_t cbgen_native_prefill_rows(void) { return 24576; }
int cbgen_prefill_kernel_preferred(void) { return 0; }
#else
int64_t cbgen_native_prefill_rows(void) { return 8192; }
int cbgen_prefill_kernel_preferred(void) { return 1; }
#endif

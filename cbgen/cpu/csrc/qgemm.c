/* Matmuls over GGUF-quantized weights, executed in their own blocks: y[M, N] = x[M, K] @ W^T
 * (+ bias), x, y and the bias float32, W in one of the block types below, as llama.cpp runs them:
 * x is quantized per row to 8-bit blocks of 32 (scale dx = max|x| / 127, q = x / dx rounded to
 * nearest even, and the block's sum sx), and each weight block's integer dot product with x's
 * block is scaled in float32:
 *
 *   type   block of 32 weights              weight value           per block, per column
 *   Q8_0   d (fp16), 32 int8                d q                    d dx (isum)
 *   Q4_0   d (fp16), 16 bytes of nibbles    d (q - 8)              d dx (isum - 8 sx)
 *   Q4_1   d, m (fp16), 16 bytes            d q + m                d dx isum + m dx sx
 *
 * with isum = sum_k qw_k qx_k, exact in int32. Every type is stored, as llama.cpp's kernels use
 * it, with its weights as unsigned 8-bit values (Q8_0's q + 128: isum then drops 128 sx), so
 * one integer dot product of unsigned weights and signed activations serves them all.
 *
 * The weight is repacked once into panels of 16 output columns, block by block:
 *
 *   panel p, block b:  d[16] fp16 | (Q4_1) m[16] fp16 | quants
 *   quants, 4-bit:     4 runs of 64 bytes: run r, byte 4 j + t = column j's weights k = 8 r + t
 *                      (low nibble) and k = 8 r + 4 + t (high nibble)
 *   quants, 8-bit:     8 runs of 64 bytes: run r, byte 4 j + t = column j's weight k = 4 r + t
 *
 * so a 64-byte load holds four consecutive k of each of the 16 columns, the operand of one
 * AVX512-VNNI vpdpbusd (4 multiply-adds a lane) against four of x's values broadcast: the panel
 * takes exactly the bytes of the file's blocks (fp16 scales kept, nibbles kept packed). AVX2
 * builds take the same layout 8 columns at a time with vpmaddubsw + vpmaddwd; others a scalar
 * loop. Every path computes the same integers and the same float32 operations in the same
 * order (per block: t = d dx; acc += float(isum) t; Q4_1: acc += m (dx sx); no fused
 * multiply-add: the file is built with -ffp-contract=off), so the scalar reference
 * (cbgen_q_gemm_ref, and tests/ NumPy) gives their bits exactly.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cbgen.h"
#include "thread_buffer.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QISA 2
#elif defined(__AVX2__)
#include <immintrin.h>
#define QISA 1
#else
#define QISA 0
#endif

#define QK 32   /* weights per block */
#define QCOLS 16 /* output columns per packed panel */
#define RMAX 8  /* rows of a register tile */

enum { Q8_0 = 8, Q4_0 = 2, Q4_1 = 3 }; /* ggml type ids */

int64_t cbgen_q_isa(void) { return QISA; }

static int bits_of(int type) { return type == Q8_0 ? 8 : (type == Q4_0 || type == Q4_1) ? 4 : 0; }

static int offset_of(int type) { return type == Q8_0 ? 128 : type == Q4_0 ? 8 : 0; }

/* Bytes of one packed block of 16 columns: fp16 d (and m), then the quants. */
static int64_t block_bytes(int type) {
    const int64_t scales = QCOLS * 2 * (type == Q4_1 ? 2 : 1);
    return scales + QCOLS * QK * bits_of(type) / 8;
}

/* Bytes of a file block of 32 weights of a type. */
static int64_t file_block_bytes(int type) {
    return type == Q8_0 ? 34 : type == Q4_0 ? 18 : type == Q4_1 ? 20 : 0;
}

int64_t cbgen_q_packed_bytes(int type, int64_t N, int64_t K) {
    if (!bits_of(type) || N % QCOLS || K % QK) return -1;
    return N / QCOLS * (K / QK) * block_bytes(type);
}

/* Column j's weights of one file block, as unsigned 8-bit values (with the type's offset). */
static void unpack_block(int type, const uint8_t *blk, uint8_t *u) {
    if (type == Q8_0) {
        for (int i = 0; i < QK; ++i) u[i] = (uint8_t)((int8_t)blk[2 + i] + 128);
        return;
    }
    const uint8_t *qs = blk + (type == Q4_1 ? 4 : 2);
    for (int i = 0; i < QK / 2; ++i) {
        u[i] = qs[i] & 0x0F;
        u[i + QK / 2] = qs[i] >> 4;
    }
}

/* w: the file's rows (N rows of K / 32 blocks each, in the file's block layout). */
int cbgen_q_pack(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    if (cbgen_q_packed_bytes(type, N, K) < 0) return -1;
    const int64_t KB = K / QK, fb = file_block_bytes(type), bb = block_bytes(type);
    const int nib = bits_of(type) == 4, two = type == Q4_1;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < N / QCOLS; ++p)
        for (int64_t b = 0; b < KB; ++b) {
            uint8_t *dst = out + (p * KB + b) * bb;
            uint8_t *q = dst + QCOLS * 2 * (two ? 2 : 1);
            for (int j = 0; j < QCOLS; ++j) {
                const uint8_t *blk = w + ((p * QCOLS + j) * KB + b) * fb;
                memcpy(dst + 2 * j, blk, 2); /* d */
                if (two) memcpy(dst + QCOLS * 2 + 2 * j, blk + 2, 2); /* m */
                uint8_t u[QK];
                unpack_block(type, blk, u);
                if (nib)
                    for (int r = 0; r < 4; ++r)
                        for (int t = 0; t < 4; ++t)
                            q[r * 64 + 4 * j + t] = (uint8_t)(u[8 * r + t] | u[8 * r + 4 + t] << 4);
                else
                    for (int r = 0; r < 8; ++r)
                        for (int t = 0; t < 4; ++t) q[r * 64 + 4 * j + t] = u[4 * r + t];
            }
        }
    return 0;
}

/* fp16 -> float32, exactly (the scales: no NaN or infinity expected, but kept as such). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) u = sign;
        else { /* subnormal: normalise */
            int e = -1;
            uint32_t m = man;
            do { ++e; m <<= 1; } while (!(m & 0x400));
            u = sign | (uint32_t)(127 - 15 - e) << 23 | (m & 0x3FF) << 13;
        }
    } else if (exp == 31) u = sign | 0x7F800000u | man << 13;
    else u = sign | (exp + 127 - 15) << 23 | man << 13;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* x's rows quantized: per block of 32, q (int8), d = max|x| / 127 and s = sum q. */
void cbgen_q8_quantize(const float *x, int64_t M, int64_t K, int8_t *q, float *d, int32_t *s) {
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < K / QK; ++b) {
            const float *xb = x + m * K + b * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; ++i) {
                const float a = fabsf(xb[i]);
                amax = a > amax ? a : amax;
            }
            const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
            int32_t sum = 0;
            int8_t *qb = q + m * K + b * QK;
            for (int i = 0; i < QK; ++i) {
                const int v = (int)nearbyintf(xb[i] * id);
                qb[i] = (int8_t)v;
                sum += v;
            }
            d[m * (K / QK) + b] = db;
            s[m * (K / QK) + b] = sum;
        }
}

/* The per-block float step every path takes: acc += float(isum) (d dx); (Q4_1) acc += m (dx sx). */
static inline float block_step(float acc, int32_t isum, float d, float dx, float m, float dxs,
                               int two) {
    const float t = d * dx;
    acc = acc + (float)isum * t;
    if (two) acc = acc + m * dxs;
    return acc;
}

/* The scalar reference (and the path of builds without AVX2): one column, one row. */
static float dot_ref(int type, const uint8_t *panel, int64_t KB, int j, const int8_t *qx,
                     const float *dx, const int32_t *sx) {
    const int64_t bb = block_bytes(type);
    const int nib = bits_of(type) == 4, two = type == Q4_1, off = offset_of(type);
    float acc = 0.0f;
    for (int64_t b = 0; b < KB; ++b) {
        const uint8_t *blk = panel + b * bb;
        uint16_t dh, mh = 0;
        memcpy(&dh, blk + 2 * j, 2);
        if (two) memcpy(&mh, blk + QCOLS * 2 + 2 * j, 2);
        const uint8_t *q = blk + QCOLS * 2 * (two ? 2 : 1);
        int32_t isum = 0;
        for (int k = 0; k < QK; ++k) {
            int w;
            if (nib) {
                const int r = k / 8, t = k % 4, hi = k % 8 >= 4;
                const uint8_t byte = q[r * 64 + 4 * j + t];
                w = hi ? byte >> 4 : byte & 0x0F;
            } else
                w = q[(k / 4) * 64 + 4 * j + k % 4];
            isum += w * qx[b * QK + k];
        }
        isum -= off * sx[b];
        acc = block_step(acc, isum, half_to_float(dh), dx[b], two ? half_to_float(mh) : 0.0f,
                         dx[b] * (float)sx[b], two);
    }
    return acc;
}

#if QISA == 2
/* AVX512-VNNI: a tile of R rows x the panel's 16 columns. */
static void tile_vnni(int type, const uint8_t *panel, int64_t KB, int R, const int8_t *qx,
                      int64_t ldq, const float *dx, const int32_t *sx, int64_t lds, float *y,
                      int64_t ldy, const float *bias) {
    const int64_t bb = block_bytes(type);
    const int nib = bits_of(type) == 4, two = type == Q4_1, off = offset_of(type);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[RMAX];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < KB; ++b) {
        const uint8_t *blk = panel + b * bb;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 m =
            two ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))) : d;
        const uint8_t *q = blk + QCOLS * 2 * (two ? 2 : 1);
        __m512i is[RMAX];
        for (int r = 0; r < R; ++r) is[r] = _mm512_setzero_si512();
        if (nib) {
            for (int run = 0; run < 4; ++run) {
                const __m512i v = _mm512_loadu_si512(q + run * 64);
                const __m512i lo = _mm512_and_si512(v, low4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                for (int r = 0; r < R; ++r) {
                    const int8_t *xr = qx + r * ldq + b * QK + 8 * run;
                    int32_t x0, x1;
                    memcpy(&x0, xr, 4);
                    memcpy(&x1, xr + 4, 4);
                    is[r] = _mm512_dpbusd_epi32(is[r], lo, _mm512_set1_epi32(x0));
                    is[r] = _mm512_dpbusd_epi32(is[r], hi, _mm512_set1_epi32(x1));
                }
            }
        } else {
            for (int run = 0; run < 8; ++run) {
                const __m512i v = _mm512_loadu_si512(q + run * 64);
                for (int r = 0; r < R; ++r) {
                    int32_t x0;
                    memcpy(&x0, qx + r * ldq + b * QK + 4 * run, 4);
                    is[r] = _mm512_dpbusd_epi32(is[r], v, _mm512_set1_epi32(x0));
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            const float dxr = dx[r * lds + b];
            const int32_t sxr = sx[r * lds + b];
            const __m512i isum = _mm512_sub_epi32(is[r], _mm512_set1_epi32(off * sxr));
            const __m512 t = _mm512_mul_ps(d, _mm512_set1_ps(dxr));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), t));
            if (two)
                acc[r] = _mm512_add_ps(acc[r],
                                       _mm512_mul_ps(m, _mm512_set1_ps(dxr * (float)sxr)));
        }
    }
    for (int r = 0; r < R; ++r) {
        __m512 v = acc[r];
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
        _mm512_storeu_ps(y + r * ldy, v);
    }
}
#elif QISA == 1
/* AVX2: a tile of R rows x 8 of the panel's 16 columns (half h); vpmaddubsw pairs u8 x s8 into
 * s16 (no saturation: a 4-bit weight is <= 15, an 8-bit one makes |w x| <= 255 x 127, so
 * Q8_0 adds its pairs apart), vpmaddwd sums them into the column's int32 lane. */
static inline __m256i dot4(__m256i w, __m256i x, int eight) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (!eight) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
    /* 8-bit: widen to s16 and multiply-add pairs (w + 128 <= 255 fits s16 exactly) */
    const __m256i even = _mm256_set1_epi16(0x00FF);
    const __m256i we = _mm256_and_si256(w, even), wo = _mm256_srli_epi16(w, 8);
    const __m256i xe = _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 8), xo = _mm256_srai_epi16(x, 8);
    return _mm256_add_epi32(_mm256_madd_epi16(we, xe), _mm256_madd_epi16(wo, xo));
}

static void tile_avx2(int type, const uint8_t *panel, int64_t KB, int R, const int8_t *qx,
                      int64_t ldq, const float *dx, const int32_t *sx, int64_t lds, float *y,
                      int64_t ldy, const float *bias, int h) {
    const int64_t bb = block_bytes(type);
    const int nib = bits_of(type) == 4, two = type == Q4_1, off = offset_of(type);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[RMAX];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < KB; ++b) {
        const uint8_t *blk = panel + b * bb;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
        const __m256 m =
            two ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h))) : d;
        const uint8_t *q = blk + QCOLS * 2 * (two ? 2 : 1) + 32 * h;
        __m256i is[RMAX];
        for (int r = 0; r < R; ++r) is[r] = _mm256_setzero_si256();
        const int runs = nib ? 4 : 8;
        for (int run = 0; run < runs; ++run) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + run * 64));
            const __m256i lo = nib ? _mm256_and_si256(v, low4) : v;
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            for (int r = 0; r < R; ++r) {
                const int8_t *xr = qx + r * ldq + b * QK + (nib ? 8 : 4) * run;
                int32_t x0, x1;
                memcpy(&x0, xr, 4);
                is[r] = _mm256_add_epi32(is[r], dot4(lo, _mm256_set1_epi32(x0), !nib));
                if (nib) {
                    memcpy(&x1, xr + 4, 4);
                    is[r] = _mm256_add_epi32(is[r], dot4(hi, _mm256_set1_epi32(x1), 0));
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            const float dxr = dx[r * lds + b];
            const int32_t sxr = sx[r * lds + b];
            const __m256i isum = _mm256_sub_epi32(is[r], _mm256_set1_epi32(off * sxr));
            const __m256 t = _mm256_mul_ps(d, _mm256_set1_ps(dxr));
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), t));
            if (two)
                acc[r] = _mm256_add_ps(acc[r],
                                       _mm256_mul_ps(m, _mm256_set1_ps(dxr * (float)sxr)));
        }
    }
    for (int r = 0; r < R; ++r) {
        __m256 v = acc[r];
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
        _mm256_storeu_ps(y + r * ldy + 8 * h, v);
    }
}
#endif

static int q_gemm(int type, const float *x, int64_t M, int64_t K, const uint8_t *wp, int64_t N,
                  const float *bias, float *y, int ref) {
    if (cbgen_q_packed_bytes(type, N, K) < 0) return -1;
    const int64_t KB = K / QK, P = N / QCOLS, bb = block_bytes(type);
    /* x quantized: q [M, K] int8, then d [M, KB] float, then s [M, KB] int32 */
    uint8_t *buf = thread_buffer(M * K + M * KB * 8 + 64);
    if (!buf) return -2;
    int8_t *qx = (int8_t *)buf;
    float *dx = (float *)(buf + (M * K + 63) / 64 * 64);
    int32_t *sx = (int32_t *)(dx + M * KB);
    cbgen_q8_quantize(x, M, K, qx, dx, sx);
    const int64_t tiles = (M + RMAX - 1) / RMAX;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t p = 0; p < P; ++p) {
        const uint8_t *panel = wp + p * KB * bb;
        const float *b = bias ? bias + p * QCOLS : 0;
        int64_t m0 = 0;
        for (int64_t t = 0; t < tiles; ++t) {
            const int R = (int)((M - m0) / (tiles - t));
            float *out = y + m0 * N + p * QCOLS;
            if (ref || QISA == 0) {
                for (int r = 0; r < R; ++r)
                    for (int j = 0; j < QCOLS; ++j) {
                        const int64_t row = m0 + r;
                        const float v = dot_ref(type, panel, KB, j, qx + row * K, dx + row * KB,
                                                sx + row * KB);
                        out[r * N + j] = b ? v + b[j] : v;
                    }
            }
#if QISA == 2
            else
                tile_vnni(type, panel, KB, R, qx + m0 * K, K, dx + m0 * KB, sx + m0 * KB, KB,
                          out, N, b);
#elif QISA == 1
            else
                for (int h = 0; h < 2; ++h)
                    tile_avx2(type, panel, KB, R, qx + m0 * K, K, dx + m0 * KB, sx + m0 * KB,
                              KB, out, N, b, h);
#endif
            m0 += R;
        }
    }
    return 0;
}

/* x [M, K] float32 contiguous, wp packed by cbgen_q_pack, y [M, N]. 0; -1: a type, N or K this
 * does not take; -2: no memory for x's quantized copy. */
int cbgen_q_gemm(int type, const float *x, int64_t M, int64_t K, const uint8_t *wp, int64_t N,
                 const float *bias, float *y) {
    return q_gemm(type, x, M, K, wp, N, bias, y, 0);
}

/* The same through the scalar reference (tests: every ISA path against it, bit for bit). */
int cbgen_q_gemm_ref(int type, const float *x, int64_t M, int64_t K, const uint8_t *wp,
                     int64_t N, const float *bias, float *y) {
    return q_gemm(type, x, M, K, wp, N, bias, y, 1);
}

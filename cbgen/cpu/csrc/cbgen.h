/* Every function the kernel library exports, with its exact C types: the one place they are
 * declared. Every .c file includes this header, so the compiler checks each definition against
 * its declaration, and a call from one file into another (decoder.c calls the kernels) goes
 * through it. cbgen/cpu/build.py gives ctypes the same signatures, and cbgen/cpu/c_header.py
 * checks them against this file before the library is built or loaded: where an argument
 * count, an argument type or a return type differs, the process gets no library (the torch
 * path runs) rather than calls through a wrong type. The build's -Werror=missing-prototypes
 * refuses an exported function this file does not declare.
 *
 * c_header.py parses this file with a small parser, not a C compiler, so declarations here keep
 * to what it reads: `typedef struct { type a, *b; ... } name;` and prototypes
 * `type name(type arg, ...);` (or `(void)`), whose types are void, float, double, int, size_t,
 * [u]int{8,16,32,64}_t or a struct typedef from this file, optionally const, with `*` for a
 * pointer: no arrays, function pointers or unsigned/long spellings. It refuses anything else.
 * Comments and preprocessor lines are ignored. The functions' contracts are beside their
 * definitions, in the .c file named above each group.
 */
#ifndef CBGEN_H
#define CBGEN_H

#include <stddef.h>
#include <stdint.h>

/* paged_decode.c: decode attention over the paged K/V cache */
int cbgen_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache,
                           const float *v_cache, const int32_t *block_table, int64_t bt_stride,
                           const int32_t *seq_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                           int64_t bs, float scale, int64_t window, float softcap, float *out);
int cbgen_paged_decode_bf16kv(const float *q, int64_t q_stride, const uint16_t *k_cache,
                              const uint16_t *v_cache, const int32_t *block_table,
                              int64_t bt_stride, const int32_t *seq_lens, int64_t B, int64_t H,
                              int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t window,
                              float softcap, float *out);
float cbgen_exp_sub_sum_f32(float *s, int64_t n, float m);

/* prefill_attention.c: causal attention over a prefill chunk's contiguous K/V */
int cbgen_prefill_attention_f32(const float *q, int64_t q_stride, const float *k, const float *v,
                                float *out, int64_t o_stride, int64_t Q, int64_t ctx, int64_t H,
                                int64_t Hkv, int64_t D, float scale, int64_t window,
                                float softcap);
/* the same over bfloat16 K/V with bf16 dot products (Q and the probabilities rounded to bf16);
 * -2 in a build without them */
int cbgen_prefill_attention_bf16(const float *q, int64_t q_stride, const uint16_t *k,
                                 const uint16_t *v, float *out, int64_t o_stride, int64_t Q,
                                 int64_t ctx, int64_t H, int64_t Hkv, int64_t D, float scale,
                                 int64_t window, float softcap);
int64_t cbgen_native_prefill_rows(void);
int cbgen_prefill_kernel_preferred(void);

/* fused_ops.c: element-wise ops that round exactly like torch's */
void cbgen_add_rmsnorm_f32(float *residual, const float *x, const float *w, float eps, int64_t T,
                           int64_t H, float *out);
void cbgen_rmsnorm_heads_f32(float *x, int64_t row_stride, int64_t T, int64_t heads, int64_t D,
                             const float *w, float eps);
void cbgen_rope_f32(float *x, int64_t row_stride, int64_t T, int64_t heads, int64_t D,
                    const int64_t *positions, const float *cos_t, const float *sin_t);
int cbgen_write_kv_f32(const float *key, int64_t k_stride, const float *value, int64_t v_stride,
                       float *k_cache, float *v_cache, int64_t num_slots, const int64_t *slots,
                       int64_t T, int64_t row);
int cbgen_write_kv_bf16(const float *key, int64_t k_stride, const float *value, int64_t v_stride,
                        uint16_t *k_cache, uint16_t *v_cache, int64_t num_slots,
                        const int64_t *slots, int64_t T, int64_t row);

/* small_gemm.c: matmuls of decode-sized batches over packed weight panels */
void cbgen_pack_panels_f32(const float *w, int64_t N, int64_t K, float *wp);
void cbgen_small_gemm_f32(const float *x, int64_t M, int64_t K, const float *wp, int64_t N,
                          const float *bias, int64_t blocked_from, float *y);
int cbgen_small_gemm_gated_f32(const float *x, int64_t M, int64_t K, const float *wp, int64_t I,
                               int act, float *y);
int64_t cbgen_small_gemm_max_rows(void);
int64_t cbgen_small_gemm_blocked_rows(void);
int cbgen_small_gemm_blocked_bf16w(const float *x, int64_t M, int64_t K, const uint16_t *wp,
                                   int64_t N, const float *bias, float *y);
int cbgen_small_gemm_gated_bf16w(const float *x, int64_t M, int64_t K, const uint16_t *wp,
                                 int64_t I, int act, float *y);

/* small_gemm_bf16.c: matmuls over bfloat16 weight panels (x, y float32) */
int64_t cbgen_bf16_native(void);
int64_t cbgen_panel_k_bf16(int64_t K);
void cbgen_pack_panels_bf16(const uint16_t *w, int64_t N, int64_t K, uint16_t *wp);
int cbgen_small_gemm_bf16(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                          const float *bias, int dot, int64_t blocked_from, float *y);
int cbgen_small_gemm_gated_bf16_dot(const float *x, int64_t M, int64_t K, const uint16_t *wp,
                                    int64_t I, int act, float *y);

/* qgemm.c: matmuls over GGUF-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
 * Q6_K) in their blocks, x quantized to 8 bits */
int64_t cbgen_q_isa(void);
int64_t cbgen_q_packed_bytes(int type, int64_t N, int64_t K);
int cbgen_q_pack(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *out);
void cbgen_q8_quantize(const float *x, int64_t M, int64_t K, int8_t *q, float *d, int32_t *s,
                       int32_t *l);
int cbgen_q_gemm(int64_t nseg, const int64_t *types, const int64_t *weights, const int64_t *ns,
                 const float *x, int64_t M, int64_t K, const float *bias, float *y, int64_t ref);
int cbgen_q_rows(int type, const uint8_t *wp, int64_t N, int64_t K, const int64_t *ids,
                 int64_t n, float *out);

/* activation.c: the gated MLP's activation over a gate-up product */
void cbgen_silu_mul_f32(const float *gu, int64_t T, int64_t I, float *out);
void cbgen_gelu_tanh_mul_f32(const float *gu, int64_t T, int64_t I, float *out);

/* bf16_head.c: the exact LM head from bf16 logits */
int64_t cbgen_head_bf16(const uint16_t *logits, int64_t M, int64_t V, const float *hidden,
                        const uint16_t *hidden16, int64_t K, const float *weight,
                        const float *wres, const float *wnorm, float g, float margin, float b,
                        float c, const float *temperature, const uint64_t *seed,
                        int64_t max_attempts, int64_t *out);

/* int16_head.c: the exact LM head from int16 logits */
int64_t cbgen_head_i16_available(void);
int64_t cbgen_head_i16_preferred(void);
int64_t cbgen_head_i16_levels(int64_t K);
int cbgen_head_i16_pack(const float *w, int64_t V, int64_t K, int64_t W, int16_t *q, float *scale,
                        float *wres);
int64_t cbgen_head_i16(const float *hidden, int64_t M, int64_t K, const int16_t *q,
                       const float *scale, int64_t V, int64_t W, const float *weight,
                       const float *wres, const float *wnorm, float g, float margin, float b,
                       float c, const float *temperature, const uint64_t *seed,
                       int64_t max_attempts, float *scratch, int64_t *out);

/* sample.c: temperature sampling by inverse CDF */
int cbgen_sample_f32(const float *logits, int64_t B, int64_t V, int64_t ld,
                     const float *temperature, const float *u, int64_t *out);

/* decoder.c: a decode step's layers in one call. The two structs are mirrored field for field
 * by NativeDecoder's ctypes Structures (tests/cpu/test_c_header.py compares them). */

/* A weight in GGUF blocks (cbgen_decoder_f32.weights 3): its segments as cbgen_q_gemm takes
 * them (a fused layer's parts, each in its type), mirrored by cbgen.cpu.quant.PackedWeight. */
typedef struct {
    int64_t nseg;
    const int64_t *types, *weights, *rows; /* [nseg]: type ids, packed bytes' addresses, rows */
} cbgen_qweight;

/* One layer's weights (small_gemm's panels) and its cache. */
typedef struct {
    const float *input_norm, *post_norm;     /* [H] */
    const float *qkv, *qkv_bias;             /* panels of [Q + 2 KV, H]; bias [Q + 2 KV] or NULL */
    const float *q_norm, *k_norm;            /* [D] each, or NULL: no q/k norms */
    const float *o, *gate_up, *down;         /* panels of [H, Q], [2 I, H], [H, I] (bf16 ones
                                                cast: cbgen_decoder_f32.weights says) */
    float *k_cache, *v_cache;                /* [num_slots, KV] each */
    const float *cos, *sin;                  /* RoPE tables [positions, head_dim / 2] */
    const float *pre_ff_norm, *post_ff_norm; /* [H] (gemma) */
    int64_t window;                          /* sliding window, 0: none */
} cbgen_layer_f32;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, block_size, num_slots;
    int64_t gemma;             /* Gemma's layers: norms after each block, GeGLU */
    int64_t blocked_rows;      /* small_gemm's row blocks from this many rows on (<= 0: default) */
    int64_t weights;           /* the panels: 0 float32, 1 bf16 widened, 2 bf16 dot products,
                                  3 GGUF blocks (the layers' pointers are cbgen_qweights) */
    int64_t kv_bf16;           /* the caches hold bf16 (cast from the layers' float pointers) */
    int64_t bf16_dots;         /* prompt chunks over a bf16 cache in bf16 dot products where
                                  the build has them (the attention backend's choice) */
    float eps, scale, softcap; /* softcap 0: none */
    const float *final_norm;   /* [H] */
    const cbgen_layer_f32 *layer;
} cbgen_decoder_f32;

/* A step's attention work: the decode kernel's tokens and the prefill kernel's prompt chunks. */
typedef struct {
    int64_t decodes;              /* tokens the decode kernel takes */
    const int64_t *decode_rows;   /* [decodes] their rows in the step; NULL: rows 0 .. decodes-1 */
    const int32_t *block_table;   /* [decodes, bt_stride]: each token's sequence's blocks */
    int64_t bt_stride;
    const int32_t *seq_lens;      /* [decodes]: the keys each sees, itself included */
    int64_t chunks;               /* prompt chunks the prefill kernel takes */
    const int64_t *chunk;         /* [chunks, 3]: first row, rows, keys (seq_len) */
    const int32_t *chunk_blocks;  /* [chunks, cb_stride]: each chunk's sequence's blocks */
    int64_t cb_stride;
} cbgen_decoder_step;

int64_t cbgen_decoder_work_f32(const cbgen_decoder_f32 *m, int64_t T, int64_t max_keys);
int cbgen_decoder_forward_f32(const cbgen_decoder_f32 *m, int64_t T, float *residual,
                              const int64_t *positions, const int64_t *slots,
                              const cbgen_decoder_step *step, float *work, float *out);

#endif

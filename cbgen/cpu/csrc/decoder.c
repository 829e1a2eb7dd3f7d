/* A whole forward pass of a Llama-type (or Gemma) decoder over a step's tokens (decodes, and
 * prompt chunks of up to the matmuls' rows), in one call: the same kernels, in the same order, on the same buffers as CausalLM.forward_layers (Gemma's)
 * with the cpu ops and the cpu attention backend, so its hidden states are bit for bit that
 * path's. Per layer, with residual, x, h [T, H]:
 *
 *   x = add_rmsnorm(residual += h, input_norm)      (no add before the first layer)
 *   qkv = x @ Wqkv (+ bias)                          small_gemm, [T, Q + 2 KV] (or
 *                                                    small_gemm_bf16 for bf16 panels)
 *   q and k heads RMSNormed in place                 (models with q/k norms: Qwen3)
 *   rope(q and k, side by side in each row)
 *   write k, v at their slots;  o = attention:      paged_decode for the step's decodes,
 *                                                    prefill_attention for its prompt chunks
 *   h = o @ Wo
 *   x = add_rmsnorm(residual += h, post_norm)
 *   h = silu_mul(x @ Wgate_up) @ Wdown                (one pass from small_gemm's row blocks on)
 *
 * and out = add_rmsnorm(residual += h, final_norm). Gemma's layers (gemma set) norm each block's
 * output too, and the MLP is GeGLU:
 *
 *   x = add_rmsnorm(residual += h, input_norm);   h = rmsnorm(attention(x) @ Wo, post_norm)
 *   x = add_rmsnorm(residual += h, pre_ff_norm);  h = rmsnorm(geglu(x), post_ff_norm)
 *
 * with each layer's own RoPE tables (Gemma 3's sliding layers have their own base). A 30-layer model makes ~270 kernel calls a
 * step; from Python each costs its argument checks, a tensor allocation and a ctypes call, while
 * the other core waits in the kernels' thread pool. The caller checks the shapes the kernels
 * hold before it calls; a kernel that still refuses (a slot past the cache, no memory for the
 * attention's scores) ends the call with a non-zero code, and the caller runs the step its own
 * way: the K/V written so far are the values it writes again.
 */
#include <stdint.h>
#include <string.h>

#include "cbgen.h" /* the kernels it calls, cbgen_layer_f32, cbgen_decoder_f32 */

#define KEY_STEP 64 /* keys per softmax step of the prefill kernel (KC, every ISA) */

/* y [T, N] = x [T, K] @ W^T (+ bias) through the matmul the model's weights are packed for:
 * float32 panels (weights 0), bf16 panels widened (1) or with bf16 dot products (2), or GGUF
 * blocks (3: w is a cbgen_qweight). 0, or small_gemm_bf16's or cbgen_q_gemm's code. */
static int matmul(const cbgen_decoder_f32 *m, const float *x, int64_t T, int64_t K,
                  const float *w, int64_t N, const float *bias, int64_t blocked, float *y) {
    if (m->weights == 0) {
        cbgen_small_gemm_f32(x, T, K, w, N, bias, blocked, y);
        return 0;
    }
    if (m->weights == 3) {
        const cbgen_qweight *q = (const cbgen_qweight *)(const void *)w;
        return cbgen_q_gemm(q->nseg, q->types, q->weights, q->rows, x, T, K, bias, y, 0);
    }
    return cbgen_small_gemm_bf16(x, T, K, (const uint16_t *)w, N, bias, m->weights == 2, 0, y);
}

/* act [T, I] = SiLU (gelu 0) or GELU (gelu 1) of x @ W_gate times x @ W_up: applied to the
 * matmul's tiles (float32 and widened bf16 from small_gemm's row blocks on, bf16 dot products
 * at any rows), else the product gu [T, 2I] and then the activation pass (the same bits either
 * way). */
static int gated(const cbgen_decoder_f32 *m, const float *x, int64_t T, int64_t H,
                 const float *gate_up, int64_t I, int gelu, int64_t blocked, float *gu,
                 float *act) {
    if (m->weights == 0 && T >= blocked &&
        cbgen_small_gemm_gated_f32(x, T, H, gate_up, I, gelu, act) == 0)
        return 0;
    /* bf16 panels: the gated forms take I in whole 32-column panels (dot products any rows,
     * widened from the row blocks on) */
    const uint16_t *wp = (const uint16_t *)(const void *)gate_up;
    if (m->weights == 2 && I % 32 == 0 &&
        cbgen_small_gemm_gated_bf16_dot(x, T, H, wp, I, gelu, act) == 0)
        return 0;
    if (m->weights == 1 && I % 32 == 0 && T >= blocked &&
        cbgen_small_gemm_gated_bf16w(x, T, H, wp, I, gelu, act) == 0)
        return 0;
    const int rc = matmul(m, x, T, H, gate_up, 2 * I, 0, blocked, gu);
    if (rc) return rc;
    if (gelu)
        cbgen_gelu_tanh_mul_f32(gu, T, I, act);
    else
        cbgen_silu_mul_f32(gu, T, I, act);
    return 0;
}

/* Floats of workspace a call over T tokens needs, its prompt chunks reading max_keys keys at
 * most. */
int64_t cbgen_decoder_work_f32(const cbgen_decoder_f32 *m, int64_t T, int64_t max_keys) {
    const int64_t q = m->heads * m->head_dim, kv = m->kv_heads * m->head_dim;
    return T * (3 * m->hidden + (q + 2 * kv) + q + 3 * m->inter) + 2 * T * q +
           3 * (max_keys + KEY_STEP) * kv;
}

/* The first block a prompt chunk's keys are gathered from: its first query's window's (the
 * torch backend's first_window_block). */
static int64_t window_block(int64_t seq_len, int64_t rows, int64_t window, int64_t bs) {
    if (window <= 0) return 0;
    const int64_t key = seq_len - rows - window + 1;
    return (key > 0 ? key : 0) / bs;
}

/* o [T, Q] = the layer's attention of the step's queries (rows of qkv): the decodes through the
 * decode kernel (their rows gathered into qd where they are not rows 0 .. decodes - 1, the
 * results scattered back from od), each prompt chunk through the prefill kernel over its keys
 * gathered from the cache into kb, vb behind zero rows up to a whole step (the cpu backend's
 * step_aligned_context): the cpu backend's calls on the same values. */
static int attend(const cbgen_decoder_f32 *m, const cbgen_layer_f32 *L,
                  const cbgen_decoder_step *s, const float *qkv, int64_t row, float *o,
                  float *qd, float *od, float *kb, float *vb) {
    const int64_t D = m->head_dim, q = m->heads * D, kv = m->kv_heads * D, bs = m->block_size;
    const size_t qbytes = (size_t)q * sizeof(float), kvbytes = (size_t)kv * sizeof(float);
    int rc = 0;
    if (s->decodes) {
        const float *qs = qkv;
        int64_t qstride = row;
        float *os = o;
        if (s->decode_rows) {
            for (int64_t i = 0; i < s->decodes; ++i)
                memcpy(qd + i * q, qkv + s->decode_rows[i] * row, qbytes);
            qs = qd;
            qstride = q;
            os = od;
        }
        if (m->kv_bf16)
            rc = cbgen_paged_decode_bf16kv(qs, qstride, (const uint16_t *)L->k_cache,
                                           (const uint16_t *)L->v_cache, s->block_table,
                                           s->bt_stride, s->seq_lens, s->decodes, m->heads,
                                           m->kv_heads, D, bs, m->scale, L->window, m->softcap,
                                           os);
        else
            rc = cbgen_paged_decode_f32(qs, qstride, L->k_cache, L->v_cache, s->block_table,
                                        s->bt_stride, s->seq_lens, s->decodes, m->heads,
                                        m->kv_heads, D, bs, m->scale, L->window, m->softcap, os);
        if (rc) return rc;
        if (s->decode_rows)
            for (int64_t i = 0; i < s->decodes; ++i)
                memcpy(o + s->decode_rows[i] * q, od + i * q, qbytes);
    }
    for (int64_t c = 0; c < s->chunks; ++c) {
        const int64_t r0 = s->chunk[3 * c], n = s->chunk[3 * c + 1], len = s->chunk[3 * c + 2];
        const int64_t k0 = window_block(len, n, L->window, bs) * bs, pad = k0 % KEY_STEP;
        const int64_t keys = pad + len - k0;
        const int32_t *blocks = s->chunk_blocks + c * s->cb_stride;
        rc = -2;
        if (m->kv_bf16 && m->bf16_dots) { /* the cache's rows as they are */
            uint16_t *kh = (uint16_t *)(vb + keys * kv), *vh = kh + keys * kv;
            memset(kh, 0, (size_t)pad * kvbytes / 2);
            memset(vh, 0, (size_t)pad * kvbytes / 2);
            for (int64_t p = k0; p < len; ++p) {
                const int64_t slot = (int64_t)blocks[p / bs] * bs + p % bs;
                memcpy(kh + (pad + p - k0) * kv, (const uint16_t *)L->k_cache + slot * kv,
                       kvbytes / 2);
                memcpy(vh + (pad + p - k0) * kv, (const uint16_t *)L->v_cache + slot * kv,
                       kvbytes / 2);
            }
            rc = cbgen_prefill_attention_bf16(qkv + r0 * row, row, kh, vh, o + r0 * q, q, n,
                                              keys - n, m->heads, m->kv_heads, D, m->scale,
                                              L->window, m->softcap);
            if (rc != -2) { /* -2: no bf16 dot products in this build, widened below */
                if (rc) return rc;
                continue;
            }
        }
        memset(kb, 0, (size_t)pad * kvbytes);
        memset(vb, 0, (size_t)pad * kvbytes);
        for (int64_t p = k0; p < len; ++p) {
            const int64_t slot = (int64_t)blocks[p / bs] * bs + p % bs, j = pad + p - k0;
            if (m->kv_bf16) { /* widened, exactly */
                const uint16_t *kr = (const uint16_t *)L->k_cache + slot * kv;
                const uint16_t *vr = (const uint16_t *)L->v_cache + slot * kv;
                uint32_t *kd = (uint32_t *)(kb + j * kv), *vd = (uint32_t *)(vb + j * kv);
                for (int64_t e = 0; e < kv; ++e) {
                    kd[e] = (uint32_t)kr[e] << 16;
                    vd[e] = (uint32_t)vr[e] << 16;
                }
            } else {
                memcpy(kb + j * kv, L->k_cache + slot * kv, kvbytes);
                memcpy(vb + j * kv, L->v_cache + slot * kv, kvbytes);
            }
        }
        rc = cbgen_prefill_attention_f32(qkv + r0 * row, row, kb, vb, o + r0 * q, q, n, keys - n,
                                         m->heads, m->kv_heads, D, m->scale, L->window,
                                         m->softcap);
        if (rc) return rc;
    }
    return 0;
}

/* residual [T, H]: the tokens' embeddings in, the residual stream out; out [T, H]: the hidden
 * states after the final norm. positions [T] and slots [T] int64; step: which tokens are
 * decodes and which prompt chunks (every token one or the other). work:
 * cbgen_decoder_work_f32 floats. 0, or the failing kernel's code. */
int cbgen_decoder_forward_f32(const cbgen_decoder_f32 *m, int64_t T, float *residual,
                              const int64_t *positions, const int64_t *slots,
                              const cbgen_decoder_step *step, float *work, float *out) {
    const int64_t H = m->hidden, D = m->head_dim, I = m->inter;
    const int64_t q = m->heads * D, kv = m->kv_heads * D, row = q + 2 * kv;
    const int64_t blocked = m->blocked_rows > 0 ? m->blocked_rows : cbgen_small_gemm_blocked_rows();
    int64_t max_keys = 0;
    for (int64_t c = 0; c < step->chunks; ++c)
        if (step->chunk[3 * c + 2] > max_keys) max_keys = step->chunk[3 * c + 2];
    float *x = work, *h = x + T * H, *a = h + T * H, *qkv = a + T * H, *o = qkv + T * row,
          *gu = o + T * q, *act = gu + T * 2 * I, *qd = act + T * I, *od = qd + T * q,
          *kb = od + T * q, *vb = kb + (max_keys + KEY_STEP) * kv;
    int rc;
#define CHECK(call)          \
    if ((rc = (call)) != 0) \
        return rc;
    for (int64_t l = 0; l < m->layers; ++l) {
        const cbgen_layer_f32 *L = m->layer + l;
        cbgen_add_rmsnorm_f32(residual, l ? h : 0, L->input_norm, m->eps, T, H, x);
        CHECK(matmul(m, x, T, H, L->qkv, row, L->qkv_bias, blocked, qkv));
        if (L->q_norm) {
            cbgen_rmsnorm_heads_f32(qkv, row, T, m->heads, D, L->q_norm, m->eps);
            cbgen_rmsnorm_heads_f32(qkv + q, row, T, m->kv_heads, D, L->k_norm, m->eps);
        }
        cbgen_rope_f32(qkv, row, T, m->heads + m->kv_heads, D, positions, L->cos, L->sin);
        if (m->kv_bf16) { /* the cache holds bf16: written rounded, read widened */
            CHECK(cbgen_write_kv_bf16(qkv + q, row, qkv + q + kv, row, (uint16_t *)L->k_cache,
                                      (uint16_t *)L->v_cache, m->num_slots, slots, T, kv));
        } else {
            CHECK(cbgen_write_kv_f32(qkv + q, row, qkv + q + kv, row, L->k_cache, L->v_cache,
                                     m->num_slots, slots, T, kv));
        }
        CHECK(attend(m, L, step, qkv, row, o, qd, od, kb, vb));
        if (m->gemma) {
            CHECK(matmul(m, o, T, q, L->o, H, 0, blocked, a));
            cbgen_add_rmsnorm_f32(a, 0, L->post_norm, m->eps, T, H, h);
            cbgen_add_rmsnorm_f32(residual, h, L->pre_ff_norm, m->eps, T, H, x);
            CHECK(gated(m, x, T, H, L->gate_up, I, 1, blocked, gu, act));
            CHECK(matmul(m, act, T, I, L->down, H, 0, blocked, a));
            cbgen_add_rmsnorm_f32(a, 0, L->post_ff_norm, m->eps, T, H, h);
        } else {
            CHECK(matmul(m, o, T, q, L->o, H, 0, blocked, h));
            cbgen_add_rmsnorm_f32(residual, h, L->post_norm, m->eps, T, H, x);
            CHECK(gated(m, x, T, H, L->gate_up, I, 0, blocked, gu, act));
            CHECK(matmul(m, act, T, I, L->down, H, 0, blocked, h));
        }
    }
#undef CHECK
    cbgen_add_rmsnorm_f32(residual, m->layers ? h : 0, m->final_norm, m->eps, T, H, out);
    return 0;
}

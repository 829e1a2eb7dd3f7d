/* The paged decode kernel of paged_decode.c over a cache of KV_T elements, included once per
 * cache dtype with KV_T, KVSUF (the names' suffix), LOAD8 / LOAD16 (8 / 16 elements as float32
 * vectors), TOF (one element as a float), LINE (elements per cache line) and KERNEL_NAME
 * defined. The float32 instance is the kernel as it was written for float32; the bf16 one
 * widens each element to float32 as it is loaded (a bf16 is the top half of a float32), so
 * its arithmetic is the float32 kernel's on the widened values, from half the bytes.
 * GROUPED (the bf16 instance): with AVX-512, head sizes 64 and 128, a block's K and V rows are
 * loaded and widened once for all the query heads of their KV head rather than once a query
 * head, each head's operations unchanged (the same bits); where the loads fold into the FMAs
 * (float32) the grouping measured no faster. */

/* Written in eight-float vectors (not left to the vectoriser) so that both instances sum in
 * the same order: the bf16 one gives the float32 one's bits on the widened cache. */
static inline float FN(dot)(const float *a, const KV_T *b, int64_t n) {
    v8 acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc += *(const v8u *)(a + i) * LOAD8(b + i);
    float s = hsum8(acc);
    for (; i < n; ++i) s += a[i] * TOF(b[i]);
    return s;
}

/* Scores of nt tokens (rows `tok_stride` apart) against one query head, four tokens at a
 * time so that four independent FMA chains are in flight; C = D / 8 is a constant. */
#define QK_ROWS(C)                                                                        \
    static void FN(qk_rows_##C)(const float *qh, const KV_T *k0, int64_t tok_stride,         \
                            int64_t nt, float scale, float *dst, float *mx) {             \
        v8 qv[C];                                                                         \
        for (int c = 0; c < C; ++c) qv[c] = *(const v8u *)(qh + 8 * c);                   \
        float m = *mx;                                                                    \
        int64_t t = 0;                                                                    \
        for (; t + 4 <= nt; t += 4) {                                                     \
            const KV_T *r0 = k0 + t * tok_stride, *r1 = r0 + tok_stride;                 \
            const KV_T *r2 = r1 + tok_stride, *r3 = r2 + tok_stride;                     \
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                    \
            for (int c = 0; c < C; ++c) {                                                 \
                a0 += qv[c] * LOAD8(r0 + 8 * c);                                      \
                a1 += qv[c] * LOAD8(r1 + 8 * c);                                      \
                a2 += qv[c] * LOAD8(r2 + 8 * c);                                      \
                a3 += qv[c] * LOAD8(r3 + 8 * c);                                      \
            }                                                                             \
            const float s0 = hsum8(a0) * scale, s1 = hsum8(a1) * scale;                   \
            const float s2 = hsum8(a2) * scale, s3 = hsum8(a3) * scale;                   \
            dst[t] = s0; dst[t + 1] = s1; dst[t + 2] = s2; dst[t + 3] = s3;               \
            m = max_score(max_score(max_score(max_score(m, s0), s1), s2), s3);            \
        }                                                                                 \
        for (; t < nt; ++t) {                                                             \
            const KV_T *r = k0 + t * tok_stride;                                         \
            v8 a = {0};                                                                   \
            for (int c = 0; c < C; ++c) a += qv[c] * LOAD8(r + 8 * c);                \
            dst[t] = hsum8(a) * scale;                                                    \
            m = max_score(m, dst[t]);                                                     \
        }                                                                                 \
        *mx = m;                                                                          \
    }                                                                                     \
    /* acc_h += sum_t p[t] * v_t over nt rows, the accumulator held in registers */       \
    static void FN(pv_rows_##C)(const float *p, const KV_T *v0, int64_t tok_stride,          \
                            int64_t nt, float *acc) {                                     \
        v8 a[C];                                                                          \
        for (int c = 0; c < C; ++c) a[c] = *(const v8u *)(acc + 8 * c);                   \
        for (int64_t t = 0; t < nt; ++t) {                                                \
            const KV_T *r = v0 + t * tok_stride;                                         \
            const float pt = p[t];                                                        \
            for (int c = 0; c < C; ++c) a[c] += pt * LOAD8(r + 8 * c);                \
        }                                                                                 \
        for (int c = 0; c < C; ++c) *(v8u *)(acc + 8 * c) = a[c];                         \
    }

QK_ROWS(8)
QK_ROWS(16)

static void FN(qk_rows_any)(const float *qh, const KV_T *k0, int64_t tok_stride, int64_t nt,
                        int64_t D, float scale, float *dst, float *mx) {
    for (int64_t t = 0; t < nt; ++t) {
        dst[t] = FN(dot)(qh, k0 + t * tok_stride, D) * scale;
        if (dst[t] > *mx) *mx = dst[t];
    }
}

static void FN(pv_rows_any)(const float *p, const KV_T *v0, int64_t tok_stride, int64_t nt,
                        int64_t D, float *acc) {
    for (int64_t t = 0; t < nt; ++t)
        for (int64_t d = 0; d < D; ++d) acc[d] += p[t] * TOF(v0[t * tok_stride + d]);
}

#if defined(__AVX512F__)
/* Scores of 16 tokens against one query head of size 64: one 16-wide vector of partial sums
 * per token, then a transposing reduction turns the 16 vectors into the 16 scores (about two
 * shuffles a token instead of a full horizontal sum each). */
static inline void FN(qk16_d64)(const float *qh, const KV_T *k0, int64_t tok_stride, float scale,
                            float *dst, float *mx) {
    const __m512 q0 = _mm512_loadu_ps(qh), q1 = _mm512_loadu_ps(qh + 16);
    const __m512 q2 = _mm512_loadu_ps(qh + 32), q3 = _mm512_loadu_ps(qh + 48);
    __m512 a[16], c[4];
    for (int t = 0; t < 16; ++t) {
        const KV_T *r = k0 + t * tok_stride;
        __m512 x = _mm512_mul_ps(q0, LOAD16(r));
        x = _mm512_fmadd_ps(q1, LOAD16(r + 16), x);
        x = _mm512_fmadd_ps(q2, LOAD16(r + 32), x);
        a[t] = _mm512_fmadd_ps(q3, LOAD16(r + 48), x);
    }
    for (int i = 0; i < 4; ++i) c[i] = quad_sums(a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]);
    scores16(c, scale, dst, mx);
}
#endif

/* The blocks an item reads, in order: K blocks, V blocks, then the next item's first K
 * blocks. Prefetching walks this sequence `AHEAD` blocks in front of the reads. */
typedef struct {
    const KV_T *k_cache, *v_cache;
    const int32_t *bt, *next_bt; /* next_bt: the next item's block table row, or NULL */
    int64_t nblk, next_nblk, blk_stride;
    const KV_T *cur;              /* block being prefetched, NULL when none */
    int64_t done, slice;          /* elements of it prefetched so far, elements per call */
} FN(prefetcher);

static void FN(prefetch_target)(FN(prefetcher) *pf, int64_t pos) {
    pos += AHEAD;
    const int64_t n = pf->nblk;
    pf->done = 0;
    if (pos < n) pf->cur = pf->k_cache + (int64_t)pf->bt[pos] * pf->blk_stride;
    else if (pos < 2 * n) pf->cur = pf->v_cache + (int64_t)pf->bt[pos - n] * pf->blk_stride;
    else if (pf->next_bt && pos - 2 * n < pf->next_nblk)
        pf->cur = pf->k_cache + (int64_t)pf->next_bt[pos - 2 * n] * pf->blk_stride;
    else pf->cur = NULL;
}

/* the next slice of the target block, into L2 */
static inline void FN(prefetch_some)(FN(prefetcher) *pf) {
    if (!pf->cur) return;
    const int64_t end = pf->done + pf->slice < pf->blk_stride ? pf->done + pf->slice : pf->blk_stride;
    for (; pf->done < end; pf->done += LINE) __builtin_prefetch(pf->cur + pf->done, 0, 1);
}

#if GROUPED && defined(__AVX512F__)
/* Scores of 16 tokens against GC (<= 4) query heads of one KV head, head size 64: each token's
 * K row is loaded (and widened) once for all GC heads, and each head's arithmetic is
 * qk16_d64's, the same operations in the same order (the same bits). */
static inline __attribute__((always_inline)) void FN(qk16_d64_heads)(
    const int GC, const float *qh, const KV_T *k0, int64_t tok_stride, float scale, float *dst,
    int64_t L, float *mx, FN(prefetcher) *pf) {
    __m512 q[4][4], c[4][4];
    for (int g = 0; g < GC; ++g)
        for (int i = 0; i < 4; ++i) q[g][i] = _mm512_loadu_ps(qh + g * 64 + 16 * i);
    for (int quad = 0; quad < 4; ++quad) {
        __m512 a[4][4];
        for (int u = 0; u < 4; ++u) {
            const KV_T *r = k0 + (quad * 4 + u) * tok_stride;
            const __m512 k_0 = LOAD16(r), k_1 = LOAD16(r + 16);
            const __m512 k_2 = LOAD16(r + 32), k_3 = LOAD16(r + 48);
            for (int g = 0; g < GC; ++g) {
                __m512 x = _mm512_mul_ps(q[g][0], k_0);
                x = _mm512_fmadd_ps(q[g][1], k_1, x);
                x = _mm512_fmadd_ps(q[g][2], k_2, x);
                a[g][u] = _mm512_fmadd_ps(q[g][3], k_3, x);
            }
        }
        for (int g = 0; g < GC; ++g) c[g][quad] = quad_sums(a[g][0], a[g][1], a[g][2], a[g][3]);
        FN(prefetch_some)(pf);
    }
    for (int g = 0; g < GC; ++g) scores16(c[g], scale, dst + g * L, mx + g);
}

/* acc_g += sum_t p_g[t] * v_t for GC heads (p_g = p + g L, acc_g = acc + g 16 C), head size
 * 16 C: each V row loaded (and widened) once for all GC heads; per head and element the FMAs
 * of pv_rows_*, in token order (the same bits). */
static inline __attribute__((always_inline)) void FN(pv_heads)(
    const int C, const int GC, const float *p, int64_t L, const KV_T *v0, int64_t tok_stride,
    int64_t nt, float *acc, FN(prefetcher) *pf) {
    __m512 a[4][8];
    for (int g = 0; g < GC; ++g)
        for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * 16 * C + 16 * c);
    for (int64_t t = 0; t < nt; ++t) {
        const KV_T *r = v0 + t * tok_stride;
        __m512 v[8];
        for (int c = 0; c < C; ++c) v[c] = LOAD16(r + 16 * c);
        for (int g = 0; g < GC; ++g) {
            const __m512 pt = _mm512_set1_ps(p[g * L + t]);
            for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pt, v[c], a[g][c]);
        }
        if ((t & 3) == 3) FN(prefetch_some)(pf);
    }
    for (int g = 0; g < GC; ++g)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * 16 * C + 16 * c, a[g][c]);
}
#endif

/* Scores of one block's nt tokens against one query head. */
static inline void FN(qk_block)(const float *qh, const KV_T *k0, int64_t tok_stride, int64_t nt,
                            int64_t D, float scale, float *dst, float *mx) {
    int64_t t = 0;
#if defined(__AVX512F__)
    if (D == 64)
        for (; t + 16 <= nt; t += 16) FN(qk16_d64)(qh, k0 + t * tok_stride, tok_stride, scale, dst + t, mx);
#endif
    if (t == nt) return;
    if (D == 64) FN(qk_rows_8)(qh, k0 + t * tok_stride, tok_stride, nt - t, scale, dst + t, mx);
    else if (D == 128) FN(qk_rows_16)(qh, k0 + t * tok_stride, tok_stride, nt - t, scale, dst + t, mx);
    else FN(qk_rows_any)(qh, k0 + t * tok_stride, tok_stride, nt - t, D, scale, dst + t, mx);
}

/* acc += sum_t p[t] * v_t over one block's nt rows, one query head. */
static inline void FN(pv_block)(const float *p, const KV_T *v0, int64_t tok_stride, int64_t nt,
                                int64_t D, float *acc) {
    if (D == 64) FN(pv_rows_8)(p, v0, tok_stride, nt, acc);
    else if (D == 128) FN(pv_rows_16)(p, v0, tok_stride, nt, acc);
    else FN(pv_rows_any)(p, v0, tok_stride, nt, D, acc);
}

/* Scores of one block's nt tokens against the G query heads of one KV head (head g's at
 * dst + g L, its running maximum mx[g]); each head's bits are qk_block's. */
static inline void FN(qk_block_heads)(const float *qh, int64_t G, const KV_T *k0,
                                      int64_t tok_stride, int64_t nt, int64_t D, float scale,
                                      float *dst, int64_t L, float *mx, FN(prefetcher) *pf) {
#if GROUPED && defined(__AVX512F__)
    if (D == 64 && nt >= 16) {
        int64_t t = 0;
        for (; t + 16 <= nt; t += 16)
            for (int64_t g = 0; g < G; g += 4) {
                const float *qg = qh + g * D;
                const KV_T *kt = k0 + t * tok_stride;
                float *dg = dst + g * L + t;
                switch (G - g < 4 ? G - g : 4) {
                case 1: FN(qk16_d64_heads)(1, qg, kt, tok_stride, scale, dg, L, mx + g, pf); break;
                case 2: FN(qk16_d64_heads)(2, qg, kt, tok_stride, scale, dg, L, mx + g, pf); break;
                case 3: FN(qk16_d64_heads)(3, qg, kt, tok_stride, scale, dg, L, mx + g, pf); break;
                default: FN(qk16_d64_heads)(4, qg, kt, tok_stride, scale, dg, L, mx + g, pf); break;
                }
            }
        if (t < nt)
            for (int64_t g = 0; g < G; ++g)
                FN(qk_rows_8)(qh + g * D, k0 + t * tok_stride, tok_stride, nt - t, scale,
                              dst + g * L + t, mx + g);
        return;
    }
#endif
    /* head by head: a prefetch slice a query head, or (grouped) the KV head's four at once */
    if (GROUPED)
        for (int i = 0; i < 4; ++i) FN(prefetch_some)(pf);
    for (int64_t g = 0; g < G; ++g) {
        if (!GROUPED) FN(prefetch_some)(pf);
        FN(qk_block)(qh + g * D, k0, tok_stride, nt, D, scale, dst + g * L, mx + g);
    }
}

/* acc_g += sum_t p_g[t] * v_t over one block's nt rows for the G query heads of one KV head
 * (p_g = p + g L, acc_g = acc + g D); each head's bits are pv_rows_*'s. */
static inline void FN(pv_block_heads)(const float *p, int64_t G, int64_t L, const KV_T *v0,
                                      int64_t tok_stride, int64_t nt, int64_t D, float *acc,
                                      FN(prefetcher) *pf) {
#if GROUPED && defined(__AVX512F__)
    if (D == 64) {
        for (int64_t g = 0; g < G; g += 4) {
            const float *pg = p + g * L;
            float *ag = acc + g * D;
            switch (G - g < 4 ? G - g : 4) {
            case 1: FN(pv_heads)(4, 1, pg, L, v0, tok_stride, nt, ag, pf); break;
            case 2: FN(pv_heads)(4, 2, pg, L, v0, tok_stride, nt, ag, pf); break;
            case 3: FN(pv_heads)(4, 3, pg, L, v0, tok_stride, nt, ag, pf); break;
            default: FN(pv_heads)(4, 4, pg, L, v0, tok_stride, nt, ag, pf); break;
            }
        }
        return;
    }
    if (D == 128) {
        for (int64_t g = 0; g < G; g += 2) {
            if (G - g == 1) FN(pv_heads)(8, 1, p + g * L, L, v0, tok_stride, nt, acc + g * D, pf);
            else FN(pv_heads)(8, 2, p + g * L, L, v0, tok_stride, nt, acc + g * D, pf);
        }
        return;
    }
#endif
    if (GROUPED)
        for (int i = 0; i < 4; ++i) FN(prefetch_some)(pf);
    for (int64_t g = 0; g < G; ++g) {
        if (!GROUPED) FN(prefetch_some)(pf);
        FN(pv_block)(p + g * L, v0, tok_stride, nt, D, acc + g * D);
    }
}

int KERNEL_NAME(const float *q, int64_t q_stride, const KV_T *k_cache, const KV_T *v_cache,
                           const int32_t *block_table, int64_t bt_stride,
                           const int32_t *seq_lens, int64_t B, int64_t H, int64_t Hkv,
                           int64_t D, int64_t bs, float scale, int64_t window, float softcap,
                           float *out) {
    const int64_t G = H / Hkv;
    /* (the per-item arrays below hold up to MAX_HEADS query heads; past that, the caller's
     * torch path) */
    if (G > MAX_GROUP || D > MAX_HEAD_DIM || G * Hkv != H || H > MAX_HEADS) return -1;
    int64_t max_len = 0; /* the most keys an item reads */
    for (int64_t b = 0; b < B; ++b) {
        const int64_t n = seq_lens[b] - first_key(seq_lens[b], window);
        if (n > max_len) max_len = n;
    }
    const int64_t tok_stride = Hkv * D;
    const int64_t blk_stride = bs * Hkv * D;
    const int64_t threads = omp_get_max_threads();
    int64_t splits = 1;
    while (splits < Hkv && B * splits < 4 * threads) ++splits;
    const int64_t items = B * splits;
    atomic_long next_item = 0;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(H * (max_len > 0 ? max_len : 1)));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(H * D));
        if (!scores || !acc) {
#pragma omp atomic write
            failed = 1;
        }
        /* Items are taken one at a time like schedule(dynamic, 1), but each thread claims its
         * next item before it starts the current one, so it can prefetch that item's first
         * blocks while it finishes this one. (A thread without its buffers leaves the work
         * to the others; the call then reports the failure.) */
        int64_t w = atomic_fetch_add(&next_item, 1);
        while (scores && acc && w < items) {
            const int64_t w_next = atomic_fetch_add(&next_item, 1);
            const int64_t b = w / splits, s = w % splits;
            const int64_t h0 = s * Hkv / splits, h1 = (s + 1) * Hkv / splits;
            const int64_t nh = (h1 - h0) * G; /* query heads of this item */
            /* keys [k0, end) from block j0 on; scores[h * L + t - k0] is key t's
             *   blocks:  ... | j0: .. k0 ........ | ........ | .. end - 1 |
             */
            const int64_t end = seq_lens[b], k0 = first_key(end, window), L = end - k0;
            const int64_t j0 = k0 / bs, nblk = (end + bs - 1) / bs - j0;
            const int32_t *bt = block_table + b * bt_stride + j0;
            const float *qb = q + b * q_stride + h0 * G * D;
            float m[MAX_HEADS];
            FN(prefetcher) pf = {k_cache, v_cache, bt, NULL, nblk, 0, blk_stride, NULL, 0, 0};
            /* a block per pass over the heads: four slices a KV head (grouped), else one a
             * query head */
            pf.slice = (blk_stride / (GROUPED ? 4 * (h1 - h0) : nh) + LINE - 1) / LINE * LINE;
            if (w_next < items) {
                const int64_t bn = w_next / splits;
                const int64_t jn = first_key(seq_lens[bn], window) / bs;
                pf.next_bt = block_table + bn * bt_stride + jn;
                pf.next_nblk = (seq_lens[bn] + bs - 1) / bs - jn;
            }
            for (int64_t h = 0; h < nh; ++h) m[h] = -INFINITY;
            /* scores[h * L + t - k0] = q_h . k_t * scale, block by block; a block's rows
             * [lo, hi) are its keys in [k0, end) */
            for (int64_t j = 0; j < nblk; ++j) {
                const int64_t base = (j0 + j) * bs;
                const int64_t lo = j ? 0 : k0 - base, hi = end - base < bs ? end - base : bs;
                const KV_T *blk = k_cache + (int64_t)bt[j] * blk_stride + lo * tok_stride;
                FN(prefetch_target)(&pf, j);
                for (int64_t hk = h0; hk < h1; ++hk) {
                    const int64_t h = (hk - h0) * G; /* the KV head's first query head */
                    FN(qk_block_heads)(qb + h * D, G, blk + hk * D, tok_stride, hi - lo, D, scale,
                                       scores + h * L + base + lo - k0, L, m + h, &pf);
                }
            }
            if (softcap > 0.0f)
                for (int64_t h = 0; h < nh; ++h)
                    m[h] = softcap_scores(scores + h * L, L, softcap, m[h]);
            float sum[MAX_HEADS];
            for (int64_t h = 0; h < nh; ++h) sum[h] = exp_sub_sum(scores + h * L, L, m[h]);
            memset(acc, 0, sizeof(float) * (size_t)(nh * D));
            for (int64_t j = 0; j < nblk; ++j) {
                const int64_t base = (j0 + j) * bs;
                const int64_t lo = j ? 0 : k0 - base, hi = end - base < bs ? end - base : bs;
                const int64_t nt = hi - lo;
                const KV_T *blk = v_cache + (int64_t)bt[j] * blk_stride + lo * tok_stride;
                FN(prefetch_target)(&pf, nblk + j);
                for (int64_t hk = h0; hk < h1; ++hk) {
                    const int64_t h = (hk - h0) * G;
                    FN(pv_block_heads)(scores + h * L + base + lo - k0, G, L, blk + hk * D,
                                       tok_stride, nt, D, acc + h * D, &pf);
                }
            }
            float *ob = out + (b * H + h0 * G) * D;
            for (int64_t h = 0; h < nh; ++h) {
                const float inv = 1.0f / sum[h];
                for (int64_t d = 0; d < D; ++d) ob[h * D + d] = acc[h * D + d] * inv;
            }
            w = w_next;
        }
        free(scores);
        free(acc);
    }
    return failed ? -2 : 0;
}

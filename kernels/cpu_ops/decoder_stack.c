/* A Llama-family decoder stack on CPU in one call: for each layer, RMSNorm (with the residual add),
 * the merged q/k/v GEMM (+ bias; Qwen3's per-head q/k norms), rotary + KV store, paged attention,
 * the o GEMM, RMSNorm, the merged gate/up GEMM, SiLU-and-multiply and the down GEMM (each GEMM
 * with its bias where the model has one); then the final norm.
 *
 * The model's Python code runs the same kernels one call at a time (a decode step of a 30-layer
 * model makes about 300 calls, each a few microseconds of Python and ctypes around work that is
 * itself a few microseconds at one token). This file calls them directly: the GEMMs, rotary,
 * attention and norms are the functions of the three sources included below, with the same
 * arguments, so the only arithmetic of its own is SiLU-and-multiply (and the bias adds, the same
 * float32 sums as torch's). Weights are the packed group-affine tiles of group_affine_gemm.c (each
 * GEMM's `Plan`, bound once by the wrapper).
 *
 * The o and down GEMMs run the packed GEMM's wide form: each group's term summed in float64 into
 * the step's `partial` buffer, rounded to float32 once (then the bias). Under tensor parallelism
 * each rank runs its shard of every layer, and those two are its row-parallel partial sums: the
 * step's `reduce` (the caller's all-reduce of `partial` over the ranks, in float64) runs between
 * the GEMM and the rounding, so every rank continues with the full sum, the bits one process gets
 * (see group_affine_gemm.c on the wide form). Without ranks `reduce` is NULL.
 *
 * A step with LoRA adapter rows passes a `LoRA` (otherwise NULL, and nothing of it runs): after
 * each GEMM (and its bias), every adapter row gets `scale * B (A x)` added into each slice of the
 * projection's output, per slot present in the step, so each adapter's weights are read from
 * memory once per step and projection whatever its number of rows (see lora_add). The slot pool
 * is float32 or bfloat16 (lora_weights.c); the arithmetic is float32 either way.
 */
#include "group_affine_gemm.c"
#include "paged_attention.c"
#include "rms_norm.c"
#include "lora_weights.c"

#include <stdlib.h>

/* One decoder layer's weights and its KV cache. */
typedef struct {
    const Plan *qkv, *o, *gate_up, *down;
    int32_t qkv_threads, o_threads, gate_up_threads, down_threads;
    /* Each projection's bias [its output size], or NULL (Qwen2: q/k/v only; Llama's
     * attention_bias and mlp_bias: any). */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim] RMSNorm of each q and k head (Qwen3), or NULL */
    void *k_cache, *v_cache;
    int64_t window; /* sliding window, 0 for full attention */
} Layer;

/* The model's shape and one step's attention metadata (as paged_attention and rotary_store_kv
 * take them). */
typedef struct {
    int64_t num_tokens, hidden, intermediate, num_heads, num_kv_heads, head_dim;
    float eps, scale;
    int32_t cache_dtype, threads;
    int64_t num_blocks, block_size, num_slots;
    const int32_t *block_table;
    int64_t block_table_stride;
    const int32_t *seq_lens, *query_start;
    int64_t num_requests;
    const int64_t *slots;
    const float *cos, *sin; /* [num_tokens, head_dim / 2] */
    double *partial;        /* [num_tokens, hidden]: the o and down GEMMs' float64 sums */
    int (*reduce)(void);    /* sums `partial` over the ranks in place (0 on success), or NULL */
} Step;

/* One projection's LoRA slot stacks, in the layout of kvasir.kernels.reference.lora (shared with
 * the layer-by-layer path, so the pool is one set of tensors); elements of LoRA.weight_dtype. */
typedef struct {
    const void *a; /* [slots, slices * rank, in]: slice i's A in rows i * rank.. */
    const void *b; /* [slots, slices * rank, out]: slice i's B^T in rows i * rank.., in its own columns
                    * (the other columns hold zeros and are never read) */
} LoRAWeights;

typedef struct {
    LoRAWeights qkv, o, gate_up, down;
} LoRALayer;

/* The pool (bound once) and one step's adapter rows, grouped by slot (kvasir.kernels.lora_rows). */
typedef struct {
    const LoRALayer *layers; /* [num_layers] */
    int64_t rank;            /* the pool's rank R (every slot's stride) */
    const float *scalings;   /* [slots]: lora_alpha / r (or / sqrt(r)) */
    const int32_t *ranks;    /* [slots]: rows of A and B^T per slice that hold the adapter (the rest: zeros) */
    int64_t num_groups;
    const int32_t *group_slots;  /* [G] */
    const int32_t *group_starts; /* [G + 1]: group g is rows[group_starts[g]..group_starts[g + 1]) */
    const int64_t *rows;         /* the batch rows with an adapter, grouped by slot */
    int32_t weight_dtype;        /* the pool's a and b: LORA_FLOAT32 or LORA_BFLOAT16 */
} LoRA;

/* Return codes beyond paged_attention's (1..4, *bad = the request). */
enum {
    STACK_BAD_SLOT = 16,       /* *bad = the token whose slot is outside the cache */
    STACK_GEMM_REFUSED = 17,   /* *bad = the layer whose GEMM refused its call */
    STACK_NO_MEMORY = 18,      /* the scratch buffers or a GEMM's could not be allocated */
    STACK_REDUCE_FAILED = 19,  /* *bad = the layer whose all-reduce failed (the caller knows why) */
};

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]; silu(g) = g * sigmoid(g), with the
 * exponential of -|g| only (never overflows). */
static void silu_and_mul_rows(const float *gate_up, int64_t rows, int64_t I, float *out) {
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
#ifdef __AVX512F__
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= I; i += 16) {
            const __m512 x = _mm512_loadu_ps(g + i);
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x))); /* e^-|x| */
            const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
            /* sigmoid(x) = 1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) = e * inv for x < 0 */
            const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 sigmoid = _mm512_mask_mul_ps(inv, negative, e, inv);
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(x, sigmoid), _mm512_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) {
            const float x = g[i], e = expf(-fabsf(x)), inv = 1.0f / (1.0f + e);
            o[i] = x * (x < 0.0f ? e * inv : inv) * u[i];
        }
    }
}

/* Rows of a group handled together: a tile of x (8 rows of a few thousand floats) stays in L1
 * while the slot's A streams past it once. */
enum { LORA_ROW_TILE = 8 };

/* out[row, slice i] += scale * B_i (A_i x[row]) for every row with an adapter, one slot at a time:
 * each weight row is read from memory once per group and used for all the tile's rows while in
 * cache (a later tile of a long group finds the slot's weights in L2). The weights are read four
 * rows at a time, each against two rows of the tile, by lora_weights.c in the pool's dtype.
 * x [T, in], out [T, out_width] (the slices side by side), y scratch of LORA_ROW_TILE * slices * R.
 * Rows without an adapter are in no group: never touched. Only the first ranks[slot] rows of each
 * slice are read (the padding up to R is zeros, which would add exact zeros). */
static void lora_add(const LoRA *lora, const LoRAWeights *w, const float *x, int64_t in, float *out,
                     int64_t out_width, const int64_t *slices, int64_t num_slices, float *y) {
    const int64_t R = lora->rank, width = num_slices * R;
    const int32_t dtype = lora->weight_dtype;
    for (int64_t g = 0; g < lora->num_groups; g++) {
        const int32_t slot = lora->group_slots[g];
        const int64_t rank = lora->ranks[slot];
        const float scale = lora->scalings[slot];
        const void *a = weight_at(w->a, dtype, (int64_t)slot * width * in);
        const void *b = weight_at(w->b, dtype, (int64_t)slot * width * out_width);
        for (int64_t first = lora->group_starts[g]; first < lora->group_starts[g + 1]; first += LORA_ROW_TILE) {
            const int64_t end = first + LORA_ROW_TILE < lora->group_starts[g + 1] ? first + LORA_ROW_TILE
                                                                                   : lora->group_starts[g + 1];
            const int64_t *rows = lora->rows + first;
            const int64_t count = end - first;
            /* shrink: y[i, s * R + k] = scale * A_s[k] . x[row i], four rows of A against two rows of x at a time */
            for (int64_t s = 0; s < num_slices; s++) {
                const int64_t last = s * R + rank;
                int64_t k = s * R;
                for (; k + 4 <= last; k += 4) {
                    const void *ak = weight_at(a, dtype, k * in);
                    int64_t i = 0;
                    for (; i + 2 <= count; i += 2)
                        dot4_weights(ak, dtype, in, x + rows[i] * in, x + rows[i + 1] * in, in, y + i * width + k,
                                     y + (i + 1) * width + k);
                    if (i < count) dot4_weights(ak, dtype, in, x + rows[i] * in, NULL, in, y + i * width + k, NULL);
                }
                for (; k < last; k++)
                    for (int64_t i = 0; i < count; i++)
                        y[i * width + k] = dot_weights(weight_at(a, dtype, k * in), dtype, x + rows[i] * in, in);
                for (int64_t i = 0; i < count; i++)
                    for (k = s * R; k < last; k++) y[i * width + k] *= scale;
            }
            /* expand: out[row i, slice s] += sum_k y[i, s * R + k] * B_s^T[k], four rows of B^T into two
             * output rows at a time */
            int64_t offset = 0;
            for (int64_t s = 0; s < num_slices; offset += slices[s], s++) {
                const int64_t last = s * R + rank;
                int64_t k = s * R;
                for (; k + 4 <= last; k += 4) {
                    const void *bk = weight_at(b, dtype, k * out_width + offset);
                    int64_t i = 0;
                    for (; i + 2 <= count; i += 2)
                        axpy4_weights(out + rows[i] * out_width + offset, out + rows[i + 1] * out_width + offset,
                                      y + i * width + k, y + (i + 1) * width + k, bk, dtype, out_width, slices[s]);
                    if (i < count)
                        axpy4_weights(out + rows[i] * out_width + offset, NULL, y + i * width + k, NULL, bk, dtype,
                                      out_width, slices[s]);
                }
                for (; k < last; k++)
                    for (int64_t i = 0; i < count; i++)
                        axpy_weights(out + rows[i] * out_width + offset, y[i * width + k],
                                     weight_at(b, dtype, k * out_width + offset), dtype, slices[s]);
            }
        }
    }
}

/* One projection's LoRA terms added into out (the stack's lora_add, exported for the tests). */
int lora_projection(const LoRA *lora, const LoRAWeights *w, const float *x, int64_t in, float *out,
                    int64_t out_width, const int64_t *slices, int64_t num_slices) {
    float *y = malloc(sizeof(float) * (size_t)(LORA_ROW_TILE * num_slices * lora->rank));
    if (y == NULL) return STACK_NO_MEMORY;
    lora_add(lora, w, x, in, out, out_width, slices, num_slices, y);
    free(y);
    return 0;
}

/* y [rows, N] = x @ W^T (+ bias). */
static int run_gemm(const Plan *p, int threads, const float *bias, const float *x, float *y, int64_t rows) {
    const int status = group_affine_tiled_gemm_planned(p, x, y, rows, threads);
    if (status != 0) return status == -2 ? STACK_NO_MEMORY : STACK_GEMM_REFUSED;
    if (bias != NULL)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t n = 0; n < p->N; n++) y[r * p->N + n] += bias[n];
    return 0;
}

/* y [rows, hidden] = x @ W^T for o and down, the row-parallel GEMMs: summed in float64 into
 * s->partial (with this rank's LoRA terms, made in float32 into y first), all-reduced there when
 * the step has ranks, rounded to float32 into y once, plus the bias. */
static int run_row_gemm(const Plan *p, int threads, const float *bias, const float *x, float *y, int64_t rows,
                        const Step *s, const LoRA *lora, const LoRAWeights *w, float *lora_y) {
    const int status = group_affine_tiled_gemm_wide(p, -1, x, s->partial, rows, threads);
    if (status != 0) return status == -2 ? STACK_NO_MEMORY : STACK_GEMM_REFUSED;
    const int64_t count = rows * p->N;
    if (lora != NULL) {
        const int64_t one_slice[1] = {p->N};
        memset(y, 0, sizeof(float) * (size_t)count);
        lora_add(lora, w, x, p->K, y, p->N, one_slice, 1, lora_y);
        for (int64_t i = 0; i < count; i++) s->partial[i] += y[i];
    }
    if (s->reduce != NULL && s->reduce() != 0) return STACK_REDUCE_FAILED;
    for (int64_t i = 0; i < count; i++) y[i] = (float)s->partial[i];
    if (bias != NULL)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t n = 0; n < p->N; n++) y[r * p->N + n] += bias[n];
    return 0;
}

/* RMSNorm of each head of q and k in place, in the merged q/k/v rows (Qwen3, before rotary). */
static void norm_heads(float *qkv, int64_t rows, int64_t width, const Step *s, const float *q_norm,
                       const float *k_norm) {
    const int64_t D = s->head_dim;
    for (int64_t t = 0; t < rows; t++) {
        float *q = qkv + t * width, *k = q + s->num_heads * D;
        rms_norm(q, D, 0, 0, q_norm, q, 0, s->num_heads, D, s->eps); /* reads a row before writing it */
        rms_norm(k, D, 0, 0, k_norm, k, 0, s->num_kv_heads, D, s->eps);
    }
}

/* hidden [T, hidden]: the embedded tokens in, the final norm's output out. Runs `num_layers`
 * layers (with the LoRA terms of `lora`'s rows, or none when it is NULL); returns 0, a paged_attention problem code or a STACK_* code (with *bad set). A bad slot
 * or attention argument is found by the first layer, before anything of that layer is computed
 * beyond its K/V store (as the layer-by-layer path does). */
int decoder_stack(const Layer *layers, int64_t num_layers, const Step *s, const float *final_norm,
                  const LoRA *lora, float *hidden, int64_t *bad) {
    const int64_t T = s->num_tokens, H = s->hidden, I = s->intermediate, D = s->head_dim;
    const int64_t q_width = s->num_heads * D, kv_width = s->num_kv_heads * D, qkv_width = q_width + 2 * kv_width;
    const int64_t lora_scratch = lora == NULL ? 0 : LORA_ROW_TILE * 3 * lora->rank; /* q/k/v: 3 slices */
    float *buffer = malloc(sizeof(float) * (size_t)(T * (2 * H + qkv_width + 2 * q_width + 3 * I) + lora_scratch));
    if (buffer == NULL) return STACK_NO_MEMORY;
    float *residual = buffer, *normed = residual + T * H, *qkv = normed + T * H, *q = qkv + T * qkv_width,
          *attended = q + T * q_width, *gate_up = attended + T * q_width, *activated = gate_up + T * 2 * I;
    float *lora_y = activated + T * I;
    const int64_t qkv_slices[3] = {q_width, kv_width, kv_width}, gate_up_slices[2] = {I, I};
    float *branch = hidden; /* the last block's output, still to be added to the residual */
    int status = 0;
    for (int64_t l = 0; l < num_layers && status == 0; l++) {
        const Layer *layer = &layers[l];
        *bad = l;
        if (l == 0) {
            memcpy(residual, hidden, sizeof(float) * (size_t)(T * H));
            rms_norm(hidden, H, 0, 0, layer->input_norm, normed, 0, T, H, s->eps);
        } else {
            rms_norm(branch, H, residual, H, layer->input_norm, normed, residual, T, H, s->eps);
        }
        if ((status = run_gemm(layer->qkv, layer->qkv_threads, layer->qkv_bias, normed, qkv, T))) break;
        if (lora != NULL) lora_add(lora, &lora->layers[l].qkv, normed, H, qkv, qkv_width, qkv_slices, 3, lora_y);
        if (layer->q_norm != NULL) norm_heads(qkv, T, qkv_width, s, layer->q_norm, layer->k_norm);
        const int bad_token = rotary_store_kv(qkv, qkv_width, qkv + q_width, qkv_width, qkv + q_width + kv_width,
                                              qkv_width, s->cos, s->sin, s->slots, T, s->num_heads,
                                              s->num_kv_heads, D, q, layer->k_cache, layer->v_cache,
                                              s->num_slots, s->cache_dtype);
        if (bad_token) {
            *bad = bad_token - 1;
            status = STACK_BAD_SLOT;
            break;
        }
        status = paged_attention(q, T, layer->k_cache, layer->v_cache, s->num_blocks, s->cache_dtype, s->block_table,
                                 s->block_table_stride, s->seq_lens, s->query_start, s->num_requests, s->num_heads,
                                 s->num_kv_heads, D, s->block_size, s->scale, layer->window, attended, s->threads,
                                 bad);
        if (status) break;
        *bad = l;
        /* hidden is free from here on (layer 0 copied it into the residual): the branch outputs go there */
        branch = hidden;
        if ((status = run_row_gemm(layer->o, layer->o_threads, layer->o_bias, attended, branch, T, s, lora,
                                   lora == NULL ? NULL : &lora->layers[l].o, lora_y)))
            break;
        rms_norm(branch, H, residual, H, layer->post_norm, normed, residual, T, H, s->eps);
        if ((status = run_gemm(layer->gate_up, layer->gate_up_threads, layer->gate_up_bias, normed, gate_up, T))) break;
        if (lora != NULL) lora_add(lora, &lora->layers[l].gate_up, normed, H, gate_up, 2 * I, gate_up_slices, 2, lora_y);
        silu_and_mul_rows(gate_up, T, I, activated);
        if ((status = run_row_gemm(layer->down, layer->down_threads, layer->down_bias, activated, branch, T, s, lora,
                                   lora == NULL ? NULL : &lora->layers[l].down, lora_y)))
            break;
    }
    if (status == 0 && num_layers > 0) rms_norm(branch, H, residual, H, final_norm, hidden, residual, T, H, s->eps);
    free(buffer);
    return status;
}

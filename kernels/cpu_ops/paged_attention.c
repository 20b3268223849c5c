/* The paged KV cache on CPU: store this step's rotated K and V, and attend over each request's
 * context, reading blocks straight through the block table (no gathered copy of K/V).
 * `kvasir.kernels.reference.attention` and `kvasir.kernels.reference.rotary` are the same
 * arithmetic in torch.
 *
 * Layouts: a cache is [num_blocks, block_size, num_kv_heads, head_dim]; token j of request r lives
 * in block block_table[r, j / block_size], row j % block_size. Queries and outputs are float32;
 * the cache holds float32, float16 or bfloat16 (converted on load and store; float16 and bfloat16
 * round to nearest even, as torch's casts do).
 *
 * Attention is computed per (query row, KV head): the G query heads sharing the KV head are done
 * together, so each key and value row is read and converted once for all of them. The softmax is
 * online over tiles of up to 16 keys (one tile never crosses a block): a tile's scores, then one
 * rescale of the running sum and accumulator. Work items are split among OpenMP threads.
 *
 * Compiled with -march=native: with AVX-512 the head dimension is processed 16 floats at a time
 * when it is a multiple of 16, and exp is a vector polynomial; other head sizes and machines
 * without AVX-512 run the portable loops (the tests cover both).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

enum { CACHE_F32 = 0, CACHE_F16 = 1, CACHE_BF16 = 2 };

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define TILE 16

int paged_attention_max_head_dim(void) { return MAX_HEAD_DIM; }
int paged_attention_max_group(void) { return MAX_GROUP; }

/* ---- element conversions ---------------------------------------------------------------- */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x0040u); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* Row `src` of `n` cache elements as floats in `dst`. */
static inline void load_row(const void *src, int dtype, int64_t n, float *dst) {
    int64_t i = 0;
    if (dtype == CACHE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *h = (const uint16_t *)src;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(h + i));
        __m512 v = dtype == CACHE_F16
                       ? _mm512_cvtph_ps(raw)
                       : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        _mm512_storeu_ps(dst + i, v);
    }
#endif
    if (dtype == CACHE_F16) {
        const _Float16 *x = (const _Float16 *)src;
        for (; i < n; i++) dst[i] = (float)x[i];
    } else {
        for (; i < n; i++) dst[i] = bf16_to_f32(h[i]);
    }
}

/* `n` floats stored into a cache row of `dtype`. */
static inline void store_row(const float *src, int dtype, int64_t n, void *dst) {
    int64_t i = 0;
    if (dtype == CACHE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *h = (uint16_t *)dst;
#ifdef __AVX512F__
    if (dtype == CACHE_F16) {
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(h + i),
                                _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    if (dtype == CACHE_F16) {
        _Float16 *x = (_Float16 *)dst;
        for (; i < n; i++) x[i] = (_Float16)src[i];
    } else {
        for (; i < n; i++) h[i] = f32_to_bf16(src[i]);
    }
}

/* ---- rotary embedding and the cache store ------------------------------------------------- */

/* NeoX rotation of one head: element i pairs with i + D/2. Same products and sums as the torch
 * reference, in the same order (ISO C: no fused multiply-adds), so results are bit-identical. */
static inline void rotate(const float *x, const float *cos, const float *sin, int64_t half, float *out) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        out[i] = x1 * cos[i] - x2 * sin[i];
        out[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/* q_out[t] = rotate(q[t]); the cache slot slots[t] receives rotate(k[t]) and v[t] (skipped where
 * the slot is -1). q, k and v rows are `*_stride` floats apart (views of one merged projection);
 * heads within a row are contiguous. cos and sin are [T, D/2]. Returns 0, or 1 + the first token
 * whose slot is outside -1..num_slots-1 (then nothing is written). */
int rotary_store_kv(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                    int64_t v_stride, const float *cos, const float *sin, const int64_t *slots,
                    int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    float *q_out, void *k_cache, void *v_cache, int64_t num_slots, int dtype) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return (int)(t + 1); /* nothing written yet */
    const int64_t half = head_dim / 2;
    const size_t elem = dtype == CACHE_F32 ? 4 : 2;
    float rotated[MAX_HEAD_DIM];
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < num_heads; h++)
            rotate(q + t * q_stride + h * head_dim, c, s, half, q_out + (t * num_heads + h) * head_dim);
        if (slots[t] < 0) continue;
        const int64_t row = slots[t] * num_kv_heads * head_dim; /* slot -> first element of its row */
        for (int64_t h = 0; h < num_kv_heads; h++) {
            rotate(k + t * k_stride + h * head_dim, c, s, half, rotated);
            store_row(rotated, dtype, head_dim, (char *)k_cache + (row + h * head_dim) * elem);
            store_row(v + t * v_stride + h * head_dim, dtype, head_dim, (char *)v_cache + (row + h * head_dim) * elem);
        }
    }
    return 0;
}

/* ---- attention ---------------------------------------------------------------------------- */

#ifdef __AVX512F__
/* e^x for x <= 0 (scores minus their running maximum): 2^n * p(r), x = n ln2 + r, |r| <= ln2/2,
 * p the degree-6 Taylor polynomial (relative error below 2e-7). */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

static inline float dot(const float *a, const float *b, int64_t n) {
#ifdef __AVX512F__
    if (n % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float total = 0.0f;
    for (int64_t i = 0; i < n; i++) total += a[i] * b[i];
    return total;
}

/* acc += p * v over n floats. */
static inline void axpy(float *acc, float p, const float *v, int64_t n) {
#ifdef __AVX512F__
    if (n % 16 == 0) {
        const __m512 w = _mm512_set1_ps(p);
        for (int64_t i = 0; i < n; i += 16)
            _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(w, _mm512_loadu_ps(v + i), _mm512_loadu_ps(acc + i)));
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) acc[i] += p * v[i];
}

/* p[i] = exp(s[i] - max) for i < n; returns their sum. */
static inline float exp_shifted(float *s, int n, float max) {
#ifdef __AVX512F__
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);
    __m512 p = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s), _mm512_set1_ps(max)));
    _mm512_mask_storeu_ps(s, mask, p);
    return _mm512_mask_reduce_add_ps(mask, p);
#else
    float total = 0.0f;
    for (int i = 0; i < n; i++) total += (s[i] = expf(s[i] - max));
    return total;
#endif
}

/* scores[i] = q . rows[i] for the n rows of a tile. With AVX-512 the head is taken 64 floats (four
 * vectors) at a time, q's chunk loaded once per tile rather than once per key. */
static inline void tile_scores(const float *q, float rows[][MAX_HEAD_DIM], int64_t n, int64_t head_dim, float *scores) {
#ifdef __AVX512F__
    if (head_dim % 64 == 0) {
        __m512 partial[TILE];
        for (int64_t i = 0; i < n; i++) partial[i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 64) {
            const __m512 q0 = _mm512_loadu_ps(q + d), q1 = _mm512_loadu_ps(q + d + 16);
            const __m512 q2 = _mm512_loadu_ps(q + d + 32), q3 = _mm512_loadu_ps(q + d + 48);
            for (int64_t i = 0; i < n; i++) {
                const float *r = rows[i] + d;
                __m512 a = _mm512_fmadd_ps(q0, _mm512_loadu_ps(r), partial[i]);
                a = _mm512_fmadd_ps(q1, _mm512_loadu_ps(r + 16), a);
                a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(r + 32), a);
                partial[i] = _mm512_fmadd_ps(q3, _mm512_loadu_ps(r + 48), a);
            }
        }
        for (int64_t i = 0; i < n; i++) scores[i] = _mm512_reduce_add_ps(partial[i]);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) scores[i] = dot(q, rows[i], head_dim);
}

/* acc += sum_i p[i] * rows[i]; with AVX-512 the accumulator's 64-float chunks stay in registers
 * for the whole tile. */
static inline void tile_accumulate(float *acc, const float *p, float rows[][MAX_HEAD_DIM], int64_t n, int64_t head_dim) {
#ifdef __AVX512F__
    if (head_dim % 64 == 0) {
        for (int64_t d = 0; d < head_dim; d += 64) {
            __m512 a0 = _mm512_loadu_ps(acc + d), a1 = _mm512_loadu_ps(acc + d + 16);
            __m512 a2 = _mm512_loadu_ps(acc + d + 32), a3 = _mm512_loadu_ps(acc + d + 48);
            for (int64_t i = 0; i < n; i++) {
                const __m512 w = _mm512_set1_ps(p[i]);
                const float *r = rows[i] + d;
                a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(r), a0);
                a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(r + 16), a1);
                a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(r + 32), a2);
                a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(r + 48), a3);
            }
            _mm512_storeu_ps(acc + d, a0);
            _mm512_storeu_ps(acc + d + 16, a1);
            _mm512_storeu_ps(acc + d + 32, a2);
            _mm512_storeu_ps(acc + d + 48, a3);
        }
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) axpy(acc, p[i], rows[i], head_dim);
}

/* One query row against keys [first, last] of one KV head, for the G query heads sharing it. */
static void attend_row(const float *q, float scale, const void *k_cache, const void *v_cache, int dtype,
                       const int32_t *blocks, int64_t block_size, int64_t num_kv_heads, int64_t kv_head,
                       int64_t head_dim, int64_t group, int64_t first, int64_t last, float *out) {
    const size_t elem = dtype == CACHE_F32 ? 4 : 2;
    float qs[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], scores[MAX_GROUP][TILE];
    float rows[TILE][MAX_HEAD_DIM], max[MAX_GROUP], sum[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        for (int64_t d = 0; d < head_dim; d++) qs[g][d] = q[g * head_dim + d] * scale;
        memset(acc[g], 0, (size_t)head_dim * sizeof(float));
        max[g] = -INFINITY;
        sum[g] = 0.0f;
    }
    for (int64_t j = first; j <= last;) {
        const int64_t offset = j % block_size;
        int64_t n = block_size - offset;
        if (n > TILE) n = TILE;
        if (n > last + 1 - j) n = last + 1 - j;
        /* element index of (key j, this KV head); consecutive keys of a block are a row apart */
        const int64_t base = ((int64_t)blocks[j / block_size] * block_size + offset) * num_kv_heads * head_dim + kv_head * head_dim;
        const int64_t key_stride = num_kv_heads * head_dim;
        /* The tile's keys converted once, then scored against each query head sharing them. */
        for (int64_t i = 0; i < n; i++)
            load_row((const char *)k_cache + (base + i * key_stride) * elem, dtype, head_dim, rows[i]);
        for (int64_t g = 0; g < group; g++) tile_scores(qs[g], rows, n, head_dim, scores[g]);
        float keep[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) {
            float tile_max = scores[g][0];
            for (int64_t i = 1; i < n; i++) tile_max = scores[g][i] > tile_max ? scores[g][i] : tile_max;
            const float new_max = tile_max > max[g] ? tile_max : max[g];
            keep[g] = expf(max[g] - new_max); /* 0 on the first tile: max is -inf */
            sum[g] = sum[g] * keep[g] + exp_shifted(scores[g], (int)n, new_max);
            max[g] = new_max;
            if (keep[g] != 1.0f)
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] *= keep[g];
        }
        for (int64_t i = 0; i < n; i++)
            load_row((const char *)v_cache + (base + i * key_stride) * elem, dtype, head_dim, rows[i]);
        for (int64_t g = 0; g < group; g++) tile_accumulate(acc[g], scores[g], rows, n, head_dim);
        j += n;
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = 1.0f / sum[g];
        for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] = acc[g][d] * inv;
    }
}

/* What paged_attention found wrong with its arguments (the wrapper raises with the request). */
enum {
    OK = 0,
    BAD_QUERY_START = 1, /* query_start does not run from 0 to num_tokens */
    BAD_QUERY_LEN = 2,   /* a request's query length is negative or exceeds its seq_len */
    BAD_SEQ_LEN = 3,     /* a request's seq_len exceeds its block-table row */
    BAD_BLOCK = 4,       /* a block id the request reads is outside the cache */
};

/* Key rows times head_dim per thread below which fewer threads run: a decode step over a short
 * context is a few microseconds of work, less than waking another thread. */
#define ELEMENTS_PER_THREAD (1 << 18)

/* Causal attention of the flattened batch q [T, Hq, D] over the paged cache into out [T, Hq, D].
 * Request r owns rows query_start[r]..query_start[r+1]-1, the last ones of its seq_lens[r] tokens;
 * the row at position p sees keys max(0, p - window + 1)..p (window 0: no window).
 * Every length and every block id read is checked first: on a bad one nothing is computed, the
 * problem's code is returned and *bad_request names the request. */
int paged_attention(const float *q, int64_t num_tokens, const void *k_cache, const void *v_cache, int64_t num_blocks,
                    int dtype, const int32_t *block_table, int64_t block_table_stride, const int32_t *seq_lens,
                    const int32_t *query_start, int64_t num_requests, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim, int64_t block_size, float scale, int64_t window, float *out, int max_threads,
                    int64_t *bad_request) {
    if (query_start[0] != 0 || query_start[num_requests] != num_tokens) return BAD_QUERY_START;
    int64_t work = 0;
    for (int64_t r = 0; r < num_requests; r++) {
        *bad_request = r;
        const int64_t query_len = query_start[r + 1] - query_start[r];
        if (query_len < 0 || query_len > seq_lens[r]) return BAD_QUERY_LEN;
        if (seq_lens[r] > block_table_stride * block_size) return BAD_SEQ_LEN;
        const int32_t *blocks = block_table + r * block_table_stride;
        for (int64_t b = 0; b * block_size < seq_lens[r] && query_len > 0; b++)
            if (blocks[b] < 0 || blocks[b] >= num_blocks) return BAD_BLOCK;
        work += query_len * seq_lens[r];
    }
    work *= num_kv_heads * head_dim;
    int nthreads = (int)(work / ELEMENTS_PER_THREAD);
    if (nthreads > max_threads) nthreads = max_threads;
    if (nthreads < 1) nthreads = 1;

    const int64_t group = num_heads / num_kv_heads;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t item = 0; item < num_tokens * num_kv_heads; item++) {
        const int64_t t = item / num_kv_heads, h = item % num_kv_heads;
        int64_t lo = 0, hi = num_requests - 1; /* the request owning row t: binary search */
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (query_start[mid] <= t) lo = mid;
            else hi = mid - 1;
        }
        const int64_t r = lo;
        const int64_t position = seq_lens[r] - (query_start[r + 1] - t);
        const int64_t first = window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
        const int64_t offset = (t * num_heads + h * group) * head_dim;
        attend_row(q + offset, scale, k_cache, v_cache, dtype, block_table + r * block_table_stride, block_size,
                   num_kv_heads, h, head_dim, group, first, position, out + offset);
    }
    return OK;
}

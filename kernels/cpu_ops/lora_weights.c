/* Reading a LoRA slot's weights for decoder_stack.c's lora_add: four rows of A dotted with an
 * activation row (the shrink), four rows of B^T added into an output row (the expand), and the
 * single-row forms for a rank that is not a multiple of four. Each comes in float32 and in
 * bfloat16 (`--lora-dtype bfloat16`), and `*_weights` picks one by the pool's dtype.
 *
 * Why bfloat16 is read this way: at decode the LoRA terms are bound by the bytes of the adapters'
 * weights, not by arithmetic (a few rows of x against megabytes of A and B). bfloat16 is the top
 * half of a float32, so widening is a 16-bit shift, exact: the sums are the float32 sums of the
 * same (bf16-representable) weights, with x, the accumulators and the output staying float32.
 * Only the bytes read are halved. The shift needs AVX-512F only (AVX512_BF16's conversion
 * instruction does the same shift; its dot-product instructions would round x to bfloat16 too).
 *
 * Included by decoder_stack.c after paged_attention.c (whose dot and axpy it uses).
 */
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* The pool's element type (decoder_stack_lora.py's WEIGHT_DTYPES). */
enum { LORA_FLOAT32 = 0, LORA_BFLOAT16 = 1 };

/* ---- float32 weights ---------------------------------------------------------------------- */

/* out[j] = A[j] . x for the four rows A[0..3] (row stride `stride`): four independent sums, so
 * the FMAs do not wait on each other, and each x vector is loaded once for the four. */
static void dot4(const float *a, int64_t stride, const float *x, int64_t n, float out[4]) {
    int64_t i = 0;
    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#ifdef __AVX512F__
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        for (int j = 0; j < 4; j++) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(a + j * stride + i), v, acc[j]);
    }
    for (int j = 0; j < 4; j++) sums[j] = _mm512_reduce_add_ps(acc[j]);
#endif
    for (; i < n; i++)
        for (int j = 0; j < 4; j++) sums[j] += a[j * stride + i] * x[i];
    for (int j = 0; j < 4; j++) out[j] = sums[j];
}

/* acc[0..n) += y[0] B[0] + y[1] B[1] + y[2] B[2] + y[3] B[3] (row stride `stride`): acc is loaded
 * and stored once for four rows of B. */
static void axpy4(float *acc, const float y[4], const float *b, int64_t stride, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 w0 = _mm512_set1_ps(y[0]), w1 = _mm512_set1_ps(y[1]), w2 = _mm512_set1_ps(y[2]),
                 w3 = _mm512_set1_ps(y[3]);
    for (; i + 16 <= n; i += 16) {
        __m512 sum = _mm512_loadu_ps(acc + i);
        sum = _mm512_fmadd_ps(w0, _mm512_loadu_ps(b + i), sum);
        sum = _mm512_fmadd_ps(w1, _mm512_loadu_ps(b + stride + i), sum);
        sum = _mm512_fmadd_ps(w2, _mm512_loadu_ps(b + 2 * stride + i), sum);
        sum = _mm512_fmadd_ps(w3, _mm512_loadu_ps(b + 3 * stride + i), sum);
        _mm512_storeu_ps(acc + i, sum);
    }
#endif
    for (; i < n; i++)
        acc[i] += y[0] * b[i] + y[1] * b[stride + i] + y[2] * b[2 * stride + i] + y[3] * b[3 * stride + i];
}

/* ---- bfloat16 weights: the same loops, each weight widened on load ------------------------- */

/* A bfloat16 as the float32 whose top half it is. */
static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f); /* not a pointer cast: that would break strict aliasing */
    return f;
}

#ifdef __AVX512F__
/* 16 bfloat16 weights as 16 floats: each zero-extended to 32 bits, then shifted into the top half. */
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m256i halves = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
#endif

/* dot4 over bfloat16 rows of A. */
static void dot4_bf16(const uint16_t *a, int64_t stride, const float *x, int64_t n, float out[4]) {
    int64_t i = 0;
    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#ifdef __AVX512F__
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        for (int j = 0; j < 4; j++) acc[j] = _mm512_fmadd_ps(load16_bf16(a + j * stride + i), v, acc[j]);
    }
    for (int j = 0; j < 4; j++) sums[j] = _mm512_reduce_add_ps(acc[j]);
#endif
    for (; i < n; i++)
        for (int j = 0; j < 4; j++) sums[j] += bf16_to_float(a[j * stride + i]) * x[i];
    for (int j = 0; j < 4; j++) out[j] = sums[j];
}

/* axpy4 over bfloat16 rows of B^T. */
static void axpy4_bf16(float *acc, const float y[4], const uint16_t *b, int64_t stride, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 w0 = _mm512_set1_ps(y[0]), w1 = _mm512_set1_ps(y[1]), w2 = _mm512_set1_ps(y[2]),
                 w3 = _mm512_set1_ps(y[3]);
    for (; i + 16 <= n; i += 16) {
        __m512 sum = _mm512_loadu_ps(acc + i);
        sum = _mm512_fmadd_ps(w0, load16_bf16(b + i), sum);
        sum = _mm512_fmadd_ps(w1, load16_bf16(b + stride + i), sum);
        sum = _mm512_fmadd_ps(w2, load16_bf16(b + 2 * stride + i), sum);
        sum = _mm512_fmadd_ps(w3, load16_bf16(b + 3 * stride + i), sum);
        _mm512_storeu_ps(acc + i, sum);
    }
#endif
    for (; i < n; i++)
        acc[i] += y[0] * bf16_to_float(b[i]) + y[1] * bf16_to_float(b[stride + i]) +
                  y[2] * bf16_to_float(b[2 * stride + i]) + y[3] * bf16_to_float(b[3 * stride + i]);
}

/* One row each, for the last rank % 4 rows (scalar: ranks are multiples of 4 in practice). */
static float dot_bf16(const uint16_t *a, const float *x, int64_t n) {
    float total = 0.0f;
    for (int64_t i = 0; i < n; i++) total += bf16_to_float(a[i]) * x[i];
    return total;
}

static void axpy_bf16(float *acc, float y, const uint16_t *b, int64_t n) {
    for (int64_t i = 0; i < n; i++) acc[i] += y * bf16_to_float(b[i]);
}

/* ---- either: the pool's dtype is one per pool, so each branch goes the same way every call ---- */

/* The weight at element `index` of a float32 or bfloat16 array. */
static const void *weight_at(const void *base, int32_t dtype, int64_t index) {
    return dtype == LORA_BFLOAT16 ? (const void *)((const uint16_t *)base + index)
                                  : (const void *)((const float *)base + index);
}

static void dot4_weights(const void *a, int32_t dtype, int64_t stride, const float *x, int64_t n, float out[4]) {
    if (dtype == LORA_BFLOAT16) dot4_bf16(a, stride, x, n, out);
    else dot4(a, stride, x, n, out);
}

static float dot_weights(const void *a, int32_t dtype, const float *x, int64_t n) {
    return dtype == LORA_BFLOAT16 ? dot_bf16(a, x, n) : dot(a, x, n);
}

static void axpy4_weights(float *acc, const float y[4], const void *b, int32_t dtype, int64_t stride, int64_t n) {
    if (dtype == LORA_BFLOAT16) axpy4_bf16(acc, y, b, stride, n);
    else axpy4(acc, y, b, stride, n);
}

static void axpy_weights(float *acc, float y, const void *b, int32_t dtype, int64_t n) {
    if (dtype == LORA_BFLOAT16) axpy_bf16(acc, y, b, n);
    else axpy(acc, y, b, n);
}

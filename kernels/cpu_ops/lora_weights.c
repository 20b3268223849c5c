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

/* A bfloat16 as the float32 whose top half it is. */
static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f); /* not a pointer cast: that would break strict aliasing */
    return f;
}

/* Weight `i` of a float32 or bfloat16 array, as a float. */
static inline float load1(const void *w, int32_t dtype, int64_t i) {
    return dtype == LORA_BFLOAT16 ? bf16_to_float(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

#ifdef __AVX512F__
/* 16 bfloat16 weights as 16 floats: each zero-extended to 32 bits, then shifted into the top half. */
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m256i halves = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

/* Weights i..i+15 of a float32 or bfloat16 array, as floats. */
static inline __m512 load16(const void *w, int32_t dtype, int64_t i) {
    return dtype == LORA_BFLOAT16 ? load16_bf16((const uint16_t *)w + i) : _mm512_loadu_ps((const float *)w + i);
}
#endif

static const void *weight_at(const void *base, int32_t dtype, int64_t index);

/* Prefetching. A slot's A (and each slice's B^T) is read four rows at a time: four short streams
 * (a row is a few KB) that end before the hardware prefetcher has learnt them, so at decode the
 * loops wait on memory. Each loop asks, once per cache line it reads, for the same line of the next
 * four rows (past a slice's last row that is a harmless hint). Measured on the embedded model's
 * shapes (4 slots, 2 rows each, 30 layers of bfloat16 weights, the C function alone): 5.8 to
 * 4.8 ms per step; with the weights in cache, no cost. Eight rows ahead did no better.
 *
 * The two loops of lora_add, for four weight rows (row stride `stride`) and one or two activation
 * rows (`two`). With two, each weight vector is loaded (and widened) once for both rows: the loads
 * and conversions, which bound these loops more than the FMAs do, are halved. Each row's sums are
 * the same operations in the same order either way. `dtype` and `two` are constants at every call
 * (the wrappers below), so the compiler emits one branch-free loop per combination. */

/* y0[j] = A[j] . x0 (and y1[j] = A[j] . x1) for the four rows A[0..3]: four independent sums per
 * activation row, so the FMAs do not wait on each other. */
static inline __attribute__((always_inline)) void dot4_rows(const void *a, int32_t dtype, int64_t stride,
                                                            const float *x0, const float *x1, int two,
                                                            int64_t n, float y0[4], float y1[4]) {
    int64_t i = 0;
    float s0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#ifdef __AVX512F__
    __m512 acc0[4], acc1[4];
    for (int j = 0; j < 4; j++) acc0[j] = acc1[j] = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 v0 = _mm512_loadu_ps(x0 + i), v1 = two ? _mm512_loadu_ps(x1 + i) : v0;
        for (int j = 0; j < 4; j++) {
            if (dtype == LORA_FLOAT32 || !(i & 31)) /* once per 64-byte line */
                _mm_prefetch((const char *)weight_at(a, dtype, (j + 4) * stride + i), _MM_HINT_T0);
            const __m512 w = load16(a, dtype, j * stride + i);
            acc0[j] = _mm512_fmadd_ps(w, v0, acc0[j]);
            if (two) acc1[j] = _mm512_fmadd_ps(w, v1, acc1[j]);
        }
    }
    for (int j = 0; j < 4; j++) {
        s0[j] = _mm512_reduce_add_ps(acc0[j]);
        if (two) s1[j] = _mm512_reduce_add_ps(acc1[j]);
    }
#endif
    for (; i < n; i++)
        for (int j = 0; j < 4; j++) {
            const float w = load1(a, dtype, j * stride + i);
            s0[j] += w * x0[i];
            if (two) s1[j] += w * x1[i];
        }
    for (int j = 0; j < 4; j++) {
        y0[j] = s0[j];
        if (two) y1[j] = s1[j];
    }
}

/* acc0[0..n) += y0[0] B[0] + y0[1] B[1] + y0[2] B[2] + y0[3] B[3] (and acc1 with y1): each
 * accumulator row is loaded and stored once for four rows of B. */
static inline __attribute__((always_inline)) void axpy4_rows(float *acc0, float *acc1, const float y0[4],
                                                             const float y1[4], int two, const void *b,
                                                             int32_t dtype, int64_t stride, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 w0[4], w1[4];
    for (int j = 0; j < 4; j++) {
        w0[j] = _mm512_set1_ps(y0[j]);
        w1[j] = two ? _mm512_set1_ps(y1[j]) : w0[j];
    }
    for (; i + 16 <= n; i += 16) {
        if (dtype == LORA_FLOAT32 || !(i & 31)) /* once per 64-byte line */
            for (int j = 0; j < 4; j++) _mm_prefetch((const char *)weight_at(b, dtype, (j + 4) * stride + i), _MM_HINT_T0);
        const __m512 b0 = load16(b, dtype, i), b1 = load16(b, dtype, stride + i),
                     b2 = load16(b, dtype, 2 * stride + i), b3 = load16(b, dtype, 3 * stride + i);
        __m512 sum = _mm512_loadu_ps(acc0 + i);
        sum = _mm512_fmadd_ps(w0[0], b0, sum);
        sum = _mm512_fmadd_ps(w0[1], b1, sum);
        sum = _mm512_fmadd_ps(w0[2], b2, sum);
        sum = _mm512_fmadd_ps(w0[3], b3, sum);
        _mm512_storeu_ps(acc0 + i, sum);
        if (two) {
            sum = _mm512_loadu_ps(acc1 + i);
            sum = _mm512_fmadd_ps(w1[0], b0, sum);
            sum = _mm512_fmadd_ps(w1[1], b1, sum);
            sum = _mm512_fmadd_ps(w1[2], b2, sum);
            sum = _mm512_fmadd_ps(w1[3], b3, sum);
            _mm512_storeu_ps(acc1 + i, sum);
        }
    }
#endif
    for (; i < n; i++) {
        const float c0 = load1(b, dtype, i), c1 = load1(b, dtype, stride + i), c2 = load1(b, dtype, 2 * stride + i),
                    c3 = load1(b, dtype, 3 * stride + i);
        acc0[i] += y0[0] * c0 + y0[1] * c1 + y0[2] * c2 + y0[3] * c3;
        if (two) acc1[i] += y1[0] * c0 + y1[1] * c1 + y1[2] * c2 + y1[3] * c3;
    }
}

/* ---- what lora_add calls: the pool's dtype is one per pool, so each branch goes the same way ---- */

/* The weight at element `index` of a float32 or bfloat16 array. */
static const void *weight_at(const void *base, int32_t dtype, int64_t index) {
    return dtype == LORA_BFLOAT16 ? (const void *)((const uint16_t *)base + index)
                                  : (const void *)((const float *)base + index);
}

/* Four rows of A against one activation row (y0) or two (y0, y1; x1 NULL for one). */
static void dot4_weights(const void *a, int32_t dtype, int64_t stride, const float *x0, const float *x1,
                         int64_t n, float y0[4], float y1[4]) {
    if (dtype == LORA_BFLOAT16) {
        if (x1 != NULL) dot4_rows(a, LORA_BFLOAT16, stride, x0, x1, 1, n, y0, y1);
        else dot4_rows(a, LORA_BFLOAT16, stride, x0, x0, 0, n, y0, y0);
    } else {
        if (x1 != NULL) dot4_rows(a, LORA_FLOAT32, stride, x0, x1, 1, n, y0, y1);
        else dot4_rows(a, LORA_FLOAT32, stride, x0, x0, 0, n, y0, y0);
    }
}

/* Four rows of B^T added into one output row (acc0) or two (acc1 NULL for one). */
static void axpy4_weights(float *acc0, float *acc1, const float y0[4], const float y1[4], const void *b,
                          int32_t dtype, int64_t stride, int64_t n) {
    if (dtype == LORA_BFLOAT16) {
        if (acc1 != NULL) axpy4_rows(acc0, acc1, y0, y1, 1, b, LORA_BFLOAT16, stride, n);
        else axpy4_rows(acc0, acc0, y0, y0, 0, b, LORA_BFLOAT16, stride, n);
    } else {
        if (acc1 != NULL) axpy4_rows(acc0, acc1, y0, y1, 1, b, LORA_FLOAT32, stride, n);
        else axpy4_rows(acc0, acc0, y0, y0, 0, b, LORA_FLOAT32, stride, n);
    }
}

/* One row of A or B^T, for the last rank % 4 rows (bfloat16: scalar, as ranks are multiples of 4
 * in practice; float32: paged_attention.c's dot and axpy). */
static float dot_weights(const void *a, int32_t dtype, const float *x, int64_t n) {
    if (dtype != LORA_BFLOAT16) return dot(a, x, n);
    float total = 0.0f;
    for (int64_t i = 0; i < n; i++) total += load1(a, LORA_BFLOAT16, i) * x[i];
    return total;
}

static void axpy_weights(float *acc, float y, const void *b, int32_t dtype, int64_t n) {
    if (dtype != LORA_BFLOAT16) {
        axpy(acc, y, b, n);
        return;
    }
    for (int64_t i = 0; i < n; i++) acc[i] += y * load1(b, LORA_BFLOAT16, i);
}

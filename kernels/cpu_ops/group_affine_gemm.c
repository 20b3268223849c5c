/* y[M, N] = x[M, K] @ W^T for a weight held as integer codes with a scale and an offset per group:
 * W[n, k] = scale[n, g] * code[n, k] + offset[n, g], g = k / G (kvasir.kernels.reference.group_affine
 * is the same arithmetic in torch).
 *
 * For decode (small M) on CPU: every weight byte is read once per call, unpacked to float in
 * registers and multiplied with all M rows of x; the offset term uses per-group sums of x
 * (xsum[M, K / G]) computed once by the caller. Codes of 4 bits hold two per byte: byte j of a
 * group holds element j (low nibble) and element j + G/2 (high nibble). Rows of W are split
 * among the OpenMP threads. Compiled on the machine that runs it (-march=native): with AVX-512 the
 * unpacking and the multiply-adds are written out in intrinsics (16 floats a vector, two per group
 * of 32), elsewhere the compiler vectorizes the fixed-size loops of the portable version.
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_M 64

/* Portable version: any (bits, group); the compiler vectorizes the fixed-size inner loops. */
#define DEFINE_PORTABLE(NAME, G, BITS)                                                              \
    static void NAME(const float *x, const float *xsum, const uint8_t *codes, const float *scale,  \
                     const float *offset, float *y, int64_t M, int64_t N, int64_t K, int nthreads) { \
        const int64_t groups = K / (G);                                                            \
        const int64_t row_bytes = K * (BITS) / 8;                                                  \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                       \
        for (int64_t n = 0; n < N; n++) {                                                          \
            float acc[MAX_M][G];                                                                   \
            float off[MAX_M];                                                                      \
            memset(acc, 0, sizeof(float) * (G) * M);                                               \
            memset(off, 0, sizeof(float) * M);                                                     \
            const uint8_t *row = codes + n * row_bytes;                                            \
            for (int64_t g = 0; g < groups; g++) {                                                 \
                const float s = scale[n * groups + g];                                             \
                const float o = offset[n * groups + g];                                            \
                float w[G];                                                                        \
                if ((BITS) == 4) {                                                                 \
                    const uint8_t *b = row + g * ((G) / 2);                                        \
                    for (int i = 0; i < (G) / 2; i++) {                                            \
                        w[i] = s * (float)(b[i] & 0x0F);                                           \
                        w[i + (G) / 2] = s * (float)(b[i] >> 4);                                   \
                    }                                                                              \
                } else {                                                                           \
                    const uint8_t *b = row + g * (G);                                              \
                    for (int i = 0; i < (G); i++) w[i] = s * (float)b[i];                          \
                }                                                                                  \
                for (int64_t m = 0; m < M; m++) {                                                  \
                    const float *xg = x + m * K + g * (G);                                         \
                    for (int i = 0; i < (G); i++) acc[m][i] += w[i] * xg[i];                       \
                    off[m] += o * xsum[m * groups + g];                                            \
                }                                                                                  \
            }                                                                                      \
            for (int64_t m = 0; m < M; m++) {                                                      \
                float total = off[m];                                                              \
                for (int i = 0; i < (G); i++) total += acc[m][i];                                  \
                y[m * N + n] = total;                                                              \
            }                                                                                      \
        }                                                                                          \
    }

DEFINE_PORTABLE(portable_4bit_g32, 32, 4)
DEFINE_PORTABLE(portable_8bit_g32, 32, 8)
DEFINE_PORTABLE(portable_8bit_g16, 16, 8)

#ifdef __AVX512F__
/* The 16 codes of one vector as floats times the group's scale. */
static inline __m512 scaled(__m128i codes, __m512 s) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)), s);
}

/* sum_g offset[g] * xsum[g] over one row's groups: the offsets' share of a dot product. */
static inline float offset_dot(const float *offset, const float *xsum, int64_t groups) {
    __m512 acc = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 16 <= groups; g += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(offset + g), _mm512_loadu_ps(xsum + g), acc);
    float total = _mm512_reduce_add_ps(acc);
    for (; g < groups; g++) total += offset[g] * xsum[g];
    return total;
}

/* The weights of group g of one row, times its scale: elements 0..15 and 16..31. */
static inline void load_group(int bits, const uint8_t *row, int64_t g, __m512 s, __m512 *w0, __m512 *w1) {
    if (bits == 4) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(row + g * 16));
        const __m128i low_nibbles = _mm_set1_epi8(0x0F);
        *w0 = scaled(_mm_and_si128(b, low_nibbles), s);
        *w1 = scaled(_mm_and_si128(_mm_srli_epi16(b, 4), low_nibbles), s);
    } else {
        *w0 = scaled(_mm_loadu_si128((const __m128i *)(row + g * 32)), s);
        *w1 = scaled(_mm_loadu_si128((const __m128i *)(row + g * 32 + 16)), s);
    }
}

/* Rows of W taken together: their independent multiply-add chains hide each other's latency. */
#define ROWS 4
/* Values of a row unpacked at a time into a float buffer that stays in L1 (ROWS x CHUNK floats). */
#define CHUNK 256
/* Rows of x whose accumulators stay in registers while a chunk of weights is swept. */
#define XTILE 4

/* acc[m][r] += sum over the chunk of w[r][:] * x[m][:], for XT rows of x (XT <= XTILE). */
#define DEFINE_MICRO(NAME, XT)                                                                      \
    static inline void NAME(const float *w, const float *x, int64_t K, int64_t values, __m512 *acc) { \
        __m512 a[XT][ROWS];                                                                        \
        for (int m = 0; m < (XT); m++)                                                             \
            for (int r = 0; r < ROWS; r++) a[m][r] = acc[m * ROWS + r];                            \
        for (int64_t v = 0; v < values; v += 16) {                                                 \
            __m512 wv[ROWS];                                                                       \
            for (int r = 0; r < ROWS; r++) wv[r] = _mm512_loadu_ps(w + r * CHUNK + v);             \
            for (int m = 0; m < (XT); m++) {                                                       \
                const __m512 xv = _mm512_loadu_ps(x + m * K + v);                                  \
                for (int r = 0; r < ROWS; r++) a[m][r] = _mm512_fmadd_ps(wv[r], xv, a[m][r]);      \
            }                                                                                      \
        }                                                                                          \
        for (int m = 0; m < (XT); m++)                                                             \
            for (int r = 0; r < ROWS; r++) acc[m * ROWS + r] = a[m][r];                            \
    }

DEFINE_MICRO(micro_x4, 4)
DEFINE_MICRO(micro_x1, 1)

/* AVX-512, groups of 32. Per tile of ROWS rows of W and per CHUNK of K: the codes are unpacked and
 * scaled once into an L1 buffer, then every row of x sweeps it with its accumulators in
 * registers, XTILE rows of x at a time (so a batch of M rows unpacks each weight once, not M
 * times, and reads x from L1). The offsets' share is added per row at the end (offset_dot). */
static void avx512_g32(int bits, const float *x, const float *xsum, const uint8_t *codes, const float *scale,
                       const float *offset, float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t groups = K / 32;
    const int64_t row_bytes = K * bits / 8;
    const int64_t tiles = (N + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t tile = 0; tile < tiles; tile++) {
        const int64_t first = tile * ROWS;
        const int rows = (int)(N - first < ROWS ? N - first : ROWS);
        float w[ROWS * CHUNK] __attribute__((aligned(64)));
        __m512 acc[MAX_M * ROWS];
        for (int64_t i = 0; i < M * ROWS; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
            const int64_t values = K - k0 < CHUNK ? K - k0 : CHUNK;
            for (int r = 0; r < ROWS; r++) {
                float *dst = w + r * CHUNK;
                if (r >= rows) { /* past the last row of W: zeros, never stored */
                    memset(dst, 0, sizeof(float) * values);
                    continue;
                }
                const int64_t n = first + r;
                for (int64_t g = k0 / 32; g < (k0 + values) / 32; g++) {
                    __m512 w0, w1;
                    load_group(bits, codes + n * row_bytes, g, _mm512_set1_ps(scale[n * groups + g]), &w0, &w1);
                    _mm512_store_ps(dst + (g * 32 - k0), w0);
                    _mm512_store_ps(dst + (g * 32 - k0) + 16, w1);
                }
            }
            int64_t m = 0;
            for (; m + XTILE <= M; m += XTILE) micro_x4(w, x + m * K + k0, K, values, acc + m * ROWS);
            for (; m < M; m++) micro_x1(w, x + m * K + k0, K, values, acc + m * ROWS);
        }
        for (int r = 0; r < rows; r++) {
            const int64_t n = first + r;
            for (int64_t m = 0; m < M; m++) {
                const float dot = _mm512_reduce_add_ps(acc[m * ROWS + r]);
                y[m * N + n] = dot + offset_dot(offset + n * groups, xsum + m * groups, groups);
            }
        }
    }
}
#endif

void group_affine_gemm_4bit_g32(const float *x, const float *xsum, const uint8_t *codes, const float *scale,
                                const float *offset, float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
#ifdef __AVX512F__
    avx512_g32(4, x, xsum, codes, scale, offset, y, M, N, K, nthreads);
#else
    portable_4bit_g32(x, xsum, codes, scale, offset, y, M, N, K, nthreads);
#endif
}

void group_affine_gemm_8bit_g32(const float *x, const float *xsum, const uint8_t *codes, const float *scale,
                                const float *offset, float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
#ifdef __AVX512F__
    avx512_g32(8, x, xsum, codes, scale, offset, y, M, N, K, nthreads);
#else
    portable_8bit_g32(x, xsum, codes, scale, offset, y, M, N, K, nthreads);
#endif
}

void group_affine_gemm_8bit_g16(const float *x, const float *xsum, const uint8_t *codes, const float *scale,
                                const float *offset, float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    portable_8bit_g16(x, xsum, codes, scale, offset, y, M, N, K, nthreads);
}

/* The portable versions, callable directly so the tests check them on AVX-512 machines too. */
void group_affine_gemm_portable(int bits, int group, const float *x, const float *xsum, const uint8_t *codes,
                                const float *scale, const float *offset, float *y, int64_t M, int64_t N, int64_t K,
                                int nthreads) {
    if (bits == 4) portable_4bit_g32(x, xsum, codes, scale, offset, y, M, N, K, nthreads);
    else if (group == 32) portable_8bit_g32(x, xsum, codes, scale, offset, y, M, N, K, nthreads);
    else portable_8bit_g16(x, xsum, codes, scale, offset, y, M, N, K, nthreads);
}

int group_affine_max_rows(void) { return MAX_M; }

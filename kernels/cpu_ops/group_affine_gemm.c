/* y[M, N] = x[M, K] @ W^T for a weight held as integer codes with a scale and an offset per group:
 * W[n, k] = scale[n, g] * code[n, k] + offset[n, g], g = k / G (kvasir.kernels.reference.group_affine
 * is the same arithmetic in torch; kvasir.kernels.cpu_ops.group_affine lays the weight out and
 * calls this).
 *
 * Decode (small M) on a CPU reads every weight byte once per call, so the weight is repacked once
 * at load into tiles a vector unit streams: TILE = 16 rows of W side by side, one 32-bit lane per
 * row. For tile t and group g the codes are G/4 "quads" of 64 bytes; lane r of quad q holds the
 * codes k = g*G + 4q .. 4q+3 of row 16t + r. 4-bit codes hold two quads per 64 bytes: the low
 * nibbles are quad c, the high nibbles quad c + G/8. 5-bit codes (groups of 32) are the 4-bit layout
 * of their low nibbles followed by a 64-byte plane of fifth bits: bit q of plane byte j is the
 * fifth bit of byte j of quad q. Scales and offsets are float32 [tiles, groups, 16]. Rows past N
 * are zero codes and are never stored.
 *
 * Three arithmetics on that layout, by the activations' bits (`act_bits`):
 * - 8 (as llama.cpp runs its quantized types): each row of x is rounded once per call to int8 per
 *   block of 32 values, q1 = round(x * 127 / amax) (half to even), step = amax / 127, and each
 *   group's dot product is summed exactly in int32 (AVX512-VNNI `vpdpbusd`: codes unsigned,
 *   activations signed), then scaled: y = sum_g scale_g * step * isum_g + offset_g * sum(x^_g),
 *   where x^ = step * q1 is the rounded activation. So y is the exact product of W and x^, up to
 *   float32 rounding: the only new error is x's rounding.
 * - 16: the same with a second int8 limb for what the first leaves, q2 = round((x - step * q1) *
 *   (127 * 254 / amax)), so x^ = (step / 254) * (254 * q1 + q2): 16-bit activations (an error 254
 *   times smaller) for two `vpdpbusd` per four inputs, combined exactly in int32.
 * - 0: float activations: the codes are converted to float32 and multiplied with x as it is; the
 *   result equals the dequantized weight's GEMM up to the order of the float32 sums.
 * Tiles are split among the OpenMP threads. Without AVX512-VNNI (or AVX-512) the portable loops
 * below run the same arithmetic; the tests call them directly on every machine.
 *
 * The wide form (`group_affine_tiled_gemm_wide`) computes each group's term of each output as above
 * in float32, but sums the terms over the groups in float64 and stores float64: the sum then
 * hardly depends on how K is split. Tensor parallelism splits a row-parallel projection's K among
 * the ranks on group boundaries, and each rank's partial is one of these sums: added in float64 and
 * rounded to float32 once, N ranks' partials give (all but ties at 2^-29) the bits one process's
 * whole sum gives, where float32 partials differ in their last bits, which 30 layers amplify.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1
#include <immintrin.h>
#else
#define HAVE_VNNI 0
#endif

#define CHUNK_M 64 /* rows of x per sweep of the weight (a longer x is swept in chunks) */
#define TILE 16   /* rows of W per tile */
#define XBLOCK 32 /* activations share one int8 step per block of 32 values */
#define MBLOCK 8  /* rows of x whose accumulators stay in registers */
#ifndef MBLOCK_TWO_LIMBS
#define MBLOCK_TWO_LIMBS 4 /* the same with two int8 limbs (three accumulators a row) */
#endif

/* One call's activations in the forms the arithmetics read. */
typedef struct {
    int8_t *q;   /* [M, K] first int8 limb (8 and 16 bits) */
    int8_t *q2;  /* [M, K] second int8 limb (16 bits) */
    float *step; /* [M, K / XBLOCK] the step of one unit of the last limb */
    float *gsum; /* [M, K / G] per weight group: sum of x^ (integer bits) or of x (float) */
} Activations;

/* Scales and offsets [tiles, groups, 16]: float32, or float16 where every value is exact in it
 * (Q4_0, Q4_1 and Q8_0 store theirs as float16: fewer bytes to stream). */
typedef struct {
    const void *scale, *offset;
    int half;
} Scales;

/* The kernels' tables list the layouts in this order: 4-bit g32, 8-bit g32, 8-bit g16, 5-bit g32. */
static inline int layout_index(int bits, int G) { return bits == 4 ? 0 : bits == 5 ? 3 : G == 32 ? 1 : 2; }

/* IEEE binary16 -> float32 (normal, subnormal, zero, infinity and NaN). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) bits = sign | 0x7F800000u | (mantissa << 13);
    else if (exponent) bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else if (mantissa == 0) bits = sign;
    else {
        float value = (float)mantissa * 0x1p-24f; /* subnormal: mantissa * 2^-24, exact */
        memcpy(&bits, &value, 4);
        bits |= sign;
    }
    float result;
    memcpy(&result, &bits, 4);
    return result;
}

static inline float scale_at(const void *values, int64_t i, int half) {
    return half ? half_to_float(((const uint16_t *)values)[i]) : ((const float *)values)[i];
}

static inline float round_even(float v) { return (float)lrintf(v); } /* as torch.round */

/* Round row x[K] to one or two int8 limbs per block of 32 and sum x^ per weight group of G. */
static void quantize_row(const float *x, int64_t K, int G, int limbs, int8_t *q, int8_t *q2, float *step,
                         float *gsum) {
    for (int64_t b = 0; b < K / XBLOCK; b++) {
        const float *xb = x + b * XBLOCK;
        float amax = 0.0f;
        int finite = 1;
        for (int i = 0; i < XBLOCK; i++) amax = fmaxf(amax, fabsf(xb[i])), finite &= isfinite(xb[i]) != 0;
        const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        const float d = amax / 127.0f;
        step[b] = !finite ? NAN : limbs == 1 ? d : d / 254.0f; /* NaN or infinity: the row's y is NaN */
        int32_t sums[XBLOCK / 16] = {0};
        for (int i = 0; i < XBLOCK; i++) {
            const float first = round_even(xb[i] * inverse);
            int32_t v = (int32_t)first;
            q[b * XBLOCK + i] = (int8_t)v;
            if (limbs == 2) {
                const float rest = xb[i] - first * d;
                const float second = fminf(fmaxf(round_even(rest * (inverse * 254.0f)), -127.0f), 127.0f);
                q2[b * XBLOCK + i] = (int8_t)second;
                v = v * 254 + (int32_t)second;
            }
            sums[i / 16] += v;
        }
        if (G == 32) gsum[b] = step[b] * (float)(sums[0] + sums[1]);
        else gsum[2 * b] = step[b] * (float)sums[0], gsum[2 * b + 1] = step[b] * (float)sums[1];
    }
}

#if HAVE_VNNI
/* quantize_row with 16 values a vector: the same operations in the same order (no fused
 * multiply-adds), so the limbs are bit for bit the scalar version's. */
static void quantize_row_vector(const float *x, int64_t K, int G, int limbs, int8_t *q, int8_t *q2, float *step,
                                float *gsum) {
    const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t b = 0; b < K / XBLOCK; b++) {
        const __m512 half[2] = {_mm512_loadu_ps(x + b * XBLOCK), _mm512_loadu_ps(x + b * XBLOCK + 16)};
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(half[0]), _mm512_abs_ps(half[1])));
        const __m512 largest = _mm512_set1_ps(FLT_MAX);
        const int finite = !(_mm512_cmp_ps_mask(_mm512_abs_ps(half[0]), largest, _CMP_NLE_UQ) |
                             _mm512_cmp_ps_mask(_mm512_abs_ps(half[1]), largest, _CMP_NLE_UQ));
        const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        const float d = amax / 127.0f;
        step[b] = !finite ? NAN : limbs == 1 ? d : d / 254.0f; /* NaN or infinity: the row's y is NaN */
        int32_t sums[2];
        for (int h = 0; h < 2; h++) {
            const __m512 first = _mm512_roundscale_ps(_mm512_mul_ps(half[h], _mm512_set1_ps(inverse)), nearest);
            __m512i v = _mm512_cvtps_epi32(first);
            _mm_storeu_si128((__m128i *)(q + b * XBLOCK + 16 * h), _mm512_cvtepi32_epi8(v));
            if (limbs == 2) {
                const __m512 rest = _mm512_sub_ps(half[h], _mm512_mul_ps(first, _mm512_set1_ps(d)));
                __m512 second = _mm512_roundscale_ps(_mm512_mul_ps(rest, _mm512_set1_ps(inverse * 254.0f)), nearest);
                second = _mm512_min_ps(_mm512_max_ps(second, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
                const __m512i s2 = _mm512_cvtps_epi32(second);
                _mm_storeu_si128((__m128i *)(q2 + b * XBLOCK + 16 * h), _mm512_cvtepi32_epi8(s2));
                v = _mm512_add_epi32(_mm512_mullo_epi32(v, _mm512_set1_epi32(254)), s2);
            }
            sums[h] = _mm512_reduce_add_epi32(v);
        }
        if (G == 32) gsum[b] = step[b] * (float)(sums[0] + sums[1]);
        else gsum[2 * b] = step[b] * (float)sums[0], gsum[2 * b + 1] = step[b] * (float)sums[1];
    }
}
#endif

static void float_sums_row(const float *x, int64_t K, int G, float *gsum) {
    for (int64_t g = 0; g < K / G; g++) {
        float total = 0.0f;
        for (int i = 0; i < G; i++) total += x[g * G + i];
        gsum[g] = total;
    }
}

/* Fill `a` for this call (limbs: 0 float, 1 or 2 int8 limbs); returns 0 if memory ran out. */
static int prepare(int limbs, int G, const float *x, int64_t M, int64_t K, int vector, Activations *a) {
    a->q = limbs ? malloc((size_t)(M * K)) : NULL;
    a->q2 = limbs == 2 ? malloc((size_t)(M * K)) : NULL;
    a->step = limbs ? malloc(sizeof(float) * (size_t)(M * K / XBLOCK)) : NULL;
    a->gsum = malloc(sizeof(float) * (size_t)(M * (K / G)));
    if (a->gsum == NULL || (limbs && (a->q == NULL || a->step == NULL)) || (limbs == 2 && a->q2 == NULL)) return 0;
    for (int64_t m = 0; m < M; m++) {
        if (limbs) {
            void (*quantize)(const float *, int64_t, int, int, int8_t *, int8_t *, float *, float *) = quantize_row;
#if HAVE_VNNI
            if (vector) quantize = quantize_row_vector;
#else
            (void)vector;
#endif
            quantize(x + m * K, K, G, limbs, a->q + m * K, limbs == 2 ? a->q2 + m * K : NULL,
                     a->step + m * (K / XBLOCK), a->gsum + m * (K / G));
        }
        else float_sums_row(x + m * K, K, G, a->gsum + m * (K / G));
    }
    return 1;
}

static void release(Activations *a) {
    free(a->q);
    free(a->q2);
    free(a->step);
    free(a->gsum);
}

/* Portable version: any (bits, group), the three arithmetics, plain loops written so a compiler
 * vectorizes them (AVX2, NEON): each group's codes are unpacked once into a k-major buffer (G
 * inputs x 16 rows), which every row of x (at most CHUNK_M) then sweeps with the tile's 16 sums in
 * registers. */
static void portable_tile(int bits, int G, int limbs, const float *x, const Activations *a, const uint8_t *codes,
                          const Scales *sc, void *y, int wide, int64_t M, int64_t N, int64_t K, int64_t tile) {
    const int64_t groups = K / G, group_bytes = (int64_t)TILE * G * bits / 8;
    const int mask = bits == 8 ? 0xFF : 0x0F;
    float acc[CHUNK_M][TILE];
    double wacc[CHUNK_M][TILE]; /* the wide form's sums */
    memset(acc, 0, sizeof(float) * TILE * (size_t)M);
    if (wide) memset(wacc, 0, sizeof(double) * TILE * (size_t)M);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gc = codes + (tile * groups + g) * group_bytes;
        const int64_t at = (tile * groups + g) * TILE;
        int32_t w[32][TILE]; /* [input k of the group][row] */
        for (int q = 0; q < G / 4; q++) {
            /* 4-bit: quads c and c + G/8 share 64 bytes, in the low and the high nibbles. */
            const uint8_t *quad = gc + 64 * (bits == 8 ? q : q % (G / 8));
            const uint8_t *fifth = gc + 64 * (G / 8); /* 5-bit: the plane after the nibbles */
            const int shift = bits != 8 && q >= G / 8 ? 4 : 0;
            for (int r = 0; r < TILE; r++)
                for (int b = 0; b < 4; b++) {
                    w[4 * q + b][r] = (quad[4 * r + b] >> shift) & mask;
                    if (bits == 5) w[4 * q + b][r] |= ((fifth[4 * r + b] >> q) & 1) << 4;
                }
        }
        float s[TILE], o[TILE];
        for (int r = 0; r < TILE; r++) s[r] = scale_at(sc->scale, at + r, sc->half), o[r] = scale_at(sc->offset, at + r, sc->half);
        if (limbs) {
            for (int64_t m = 0; m < M; m++) {
                const int64_t k0 = m * K + g * G;
                int32_t sum[TILE] = {0};
                for (int k = 0; k < G; k++) {
                    const int32_t v = limbs == 2 ? a->q[k0 + k] * 254 + a->q2[k0 + k] : a->q[k0 + k];
                    for (int r = 0; r < TILE; r++) sum[r] += w[k][r] * v;
                }
                const float step = a->step[m * (K / XBLOCK) + g * G / XBLOCK], gs = a->gsum[m * groups + g];
                if (wide)
                    for (int r = 0; r < TILE; r++) wacc[m][r] += (double)fmaf(o[r], gs, (float)sum[r] * (s[r] * step));
                else
                    for (int r = 0; r < TILE; r++) acc[m][r] += (float)sum[r] * (s[r] * step) + o[r] * gs;
            }
        } else {
            float wf[32][TILE];
            for (int k = 0; k < G; k++)
                for (int r = 0; r < TILE; r++) wf[k][r] = (float)w[k][r];
            for (int64_t m = 0; m < M; m++) {
                const float *v = x + m * K + g * G;
                float sum[TILE] = {0};
                for (int k = 0; k < G; k += 4)
                    for (int r = 0; r < TILE; r++)
                        sum[r] += wf[k][r] * v[k] + wf[k + 1][r] * v[k + 1] + wf[k + 2][r] * v[k + 2] +
                                  wf[k + 3][r] * v[k + 3];
                const float gs = a->gsum[m * groups + g];
                if (wide)
                    for (int r = 0; r < TILE; r++) wacc[m][r] += (double)fmaf(o[r], gs, sum[r] * s[r]);
                else
                    for (int r = 0; r < TILE; r++) acc[m][r] += sum[r] * s[r] + o[r] * gs;
            }
        }
    }
    for (int64_t m = 0; m < M; m++)
        for (int r = 0; r < TILE && tile * TILE + r < N; r++) {
            if (wide) ((double *)y)[m * N + tile * TILE + r] = wacc[m][r];
            else ((float *)y)[m * N + tile * TILE + r] = acc[m][r];
        }
}

#if HAVE_VNNI
#define INLINE static inline __attribute__((always_inline))

/* Bit q of each byte of `plane` moved to bit 4 (the rest zero): quad q's fifth bits. A 16-bit
 * shift moves bits across the two bytes of a word, but never into bit 4 of either. */
INLINE __m512i fifth_bits(__m512i plane, int q) {
    const __m512i moved = q <= 4 ? _mm512_slli_epi16(plane, 4 - q) : _mm512_srli_epi16(plane, q - 4);
    return _mm512_and_si512(moved, _mm512_set1_epi8(0x10));
}

/* Quad q of one group of one tile, one code per byte. */
INLINE __m512i load_quad(int bits, int G, const uint8_t *src, int q) {
    if (bits == 8) return _mm512_loadu_si512(src + 64 * q);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512i w;
    if (q < G / 8) w = _mm512_and_si512(_mm512_loadu_si512(src + 64 * q), low);
    else w = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(src + 64 * (q - G / 8)), 4), low);
    if (bits == 5) w = _mm512_or_si512(w, fifth_bits(_mm512_loadu_si512(src + 64 * (G / 8)), q));
    return w;
}

/* The G/4 quads of codes of one group of one tile (4- and 5-bit codes unpacked to one per byte). */
INLINE void load_quads(int bits, int G, const uint8_t *src, __m512i *w) {
    for (int q = 0; q < G / 4; q++) w[q] = load_quad(bits, G, src, q);
}

/* 16 scales (or offsets) of one tile's group as float32. */
INLINE __m512 load_scales(const void *values, int64_t at, int half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)values + at)));
    return _mm512_loadu_ps((const float *)values + at);
}

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
/* Ask for the codes PREFETCH_BYTES ahead of this group's (and the scales and offsets as far ahead
 * in groups): the weights stream once from memory, and a matrix of a few hundred KiB ends before
 * the hardware prefetchers have ramped up on its three streams. Tiles follow each other in
 * memory, so "ahead" runs on into the next tile. */
INLINE void prefetch_ahead(const uint8_t *group_codes, int64_t group_bytes, const Scales *sc, int64_t at) {
    for (int64_t line = 0; line < group_bytes; line += 64)
        _mm_prefetch((const char *)(group_codes + PREFETCH_BYTES + line), _MM_HINT_T0);
    const int64_t size = sc->half ? 2 : 4, ahead = (at + PREFETCH_BYTES / group_bytes) * TILE * size;
    _mm_prefetch((const char *)sc->scale + ahead, _MM_HINT_T0);
    _mm_prefetch((const char *)sc->offset + ahead, _MM_HINT_T0);
}

/* Four int8 activations in every 32-bit lane. */
INLINE __m512i broadcast4(const int8_t *src) {
    int32_t v;
    memcpy(&v, src, 4);
    return _mm512_set1_epi32(v);
}

INLINE void store_rows(float *y, int64_t N, int64_t tile, __m512 v) {
    const int64_t first = tile * TILE;
    if (first + TILE <= N) _mm512_storeu_ps(y + first, v);
    else _mm512_mask_storeu_ps(y + first, (__mmask16)((1u << (N - first)) - 1), v);
}

/* The wide form: a group's 16 float32 terms added to the tile's two float64 sums (rows 0-7, 8-15). */
INLINE void add_wide(__m512d *sums, __m512 term) {
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(term), 1));
    sums[0] = _mm512_add_pd(sums[0], _mm512_cvtps_pd(_mm512_castps512_ps256(term)));
    sums[1] = _mm512_add_pd(sums[1], _mm512_cvtps_pd(high));
}

INLINE void store_wide(double *y, int64_t N, int64_t tile, const __m512d *sums) {
    for (int h = 0; h < 2; h++) {
        const int64_t first = tile * TILE + 8 * h;
        if (first + 8 <= N) _mm512_storeu_pd(y + first, sums[h]);
        else if (first < N) _mm512_mask_storeu_pd(y + first, (__mmask8)((1u << (N - first)) - 1), sums[h]);
    }
}

/* One row's results: the float32 sum, or the wide form's two float64 ones. */
INLINE void store_tile_row(void *y, int wide, int64_t row, int64_t N, int64_t tile, __m512 acc, const __m512d *sums) {
    if (wide) store_wide((double *)y + row * N, N, tile, sums);
    else store_rows((float *)y + row * N, N, tile, acc);
}

/* Rows m0 .. m0 + MB of x against one tile, integer activations of one or two limbs. Each quad of
 * codes is loaded once and meets every row's broadcast activations, so a row of x costs one
 * `vpdpbusd` per quad (two with two limbs, combined as 254 * first + second). A single row keeps
 * two chains (even and odd quads) so consecutive `vpdpbusd` do not wait on each other. */
INLINE void int8_rows(int bits, int G, int limbs, int MB, const Activations *a, const uint8_t *codes, const Scales *sc,
                      void *y, int wide, int64_t m0, int64_t N, int64_t K, int64_t tile) {
    const int64_t groups = K / G, group_bytes = (int64_t)TILE * G * bits / 8, blocks = K / XBLOCK;
    const int chains = limbs == 2 || MB > 2 ? 1 : 2;
    __m512 acc[MBLOCK];
    __m512d sums[MBLOCK][2];
    for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps(), sums[m][0] = sums[m][1] = _mm512_setzero_pd();
    for (int64_t g = 0; g < groups; g++) {
        const int64_t at = tile * groups + g;
        const uint8_t *src = codes + at * group_bytes;
        prefetch_ahead(src, group_bytes, sc, at);
        __m512i first[MBLOCK][2], second[MBLOCK];
        for (int m = 0; m < MB; m++) {
            first[m][0] = first[m][1] = second[m] = _mm512_setzero_si512();
        }
        for (int q = 0; q < G / 4; q++) {
            const __m512i w = load_quad(bits, G, src, q);
            for (int m = 0; m < MB; m++) {
                const int64_t at_x = (m0 + m) * K + g * G + 4 * q;
                const int chain = chains == 2 ? q % 2 : 0;
                first[m][chain] = _mm512_dpbusd_epi32(first[m][chain], w, broadcast4(a->q + at_x));
                if (limbs == 2) second[m] = _mm512_dpbusd_epi32(second[m], w, broadcast4(a->q2 + at_x));
            }
        }
        const __m512 s = load_scales(sc->scale, at * TILE, sc->half), o = load_scales(sc->offset, at * TILE, sc->half);
        for (int m = 0; m < MB; m++) {
            __m512i sum = chains == 2 ? _mm512_add_epi32(first[m][0], first[m][1]) : first[m][0];
            if (limbs == 2) sum = _mm512_add_epi32(_mm512_mullo_epi32(sum, _mm512_set1_epi32(254)), second[m]);
            const __m512 step = _mm512_set1_ps(a->step[(m0 + m) * blocks + g * G / XBLOCK]);
            const __m512 gsum = _mm512_set1_ps(a->gsum[(m0 + m) * groups + g]);
            if (wide) {
                add_wide(sums[m], _mm512_fmadd_ps(o, gsum, _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s, step))));
            } else {
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s, step), acc[m]);
                acc[m] = _mm512_fmadd_ps(o, gsum, acc[m]);
            }
        }
    }
    for (int m = 0; m < MB; m++) store_tile_row(y, wide, m0 + m, N, tile, acc[m], sums[m]);
}

/* Rows m0 .. m0 + MB of x against one tile, float activations: the codes of one input for 16 rows
 * are converted to float once and meet every row's broadcast activation (one or two rows keep four
 * or two chains of multiply-adds, so consecutive ones do not wait on each other). */
INLINE void float_rows(int bits, int G, int MB, const float *x, const Activations *a, const uint8_t *codes,
                       const Scales *sc, void *y, int wide, int64_t m0, int64_t N, int64_t K, int64_t tile) {
    const int64_t groups = K / G, group_bytes = (int64_t)TILE * G * bits / 8;
    const int chains = MB == 1 ? 4 : MB == 2 ? 2 : 1;
    const __m512i byte = _mm512_set1_epi32(0xFF);
    __m512 acc[MBLOCK];
    __m512d sums[MBLOCK][2];
    for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps(), sums[m][0] = sums[m][1] = _mm512_setzero_pd();
    for (int64_t g = 0; g < groups; g++) {
        const int64_t at = tile * groups + g;
        __m512i w[8];
        prefetch_ahead(codes + at * group_bytes, group_bytes, sc, at);
        load_quads(bits, G, codes + at * group_bytes, w);
        __m512 dot[MBLOCK][4];
        for (int m = 0; m < MB; m++)
            for (int c = 0; c < 4; c++) dot[m][c] = _mm512_setzero_ps();
        for (int k = 0; k < G; k++) {
            const __m512i shifted = k % 4 ? _mm512_srli_epi32(w[k / 4], 8 * (k % 4)) : w[k / 4];
            const __m512 wf = _mm512_cvtepi32_ps(k % 4 == 3 ? shifted : _mm512_and_si512(shifted, byte));
            for (int m = 0; m < MB; m++) {
                dot[m][k % chains] = _mm512_fmadd_ps(wf, _mm512_set1_ps(x[(m0 + m) * K + g * G + k]), dot[m][k % chains]);
            }
        }
        const __m512 s = load_scales(sc->scale, at * TILE, sc->half), o = load_scales(sc->offset, at * TILE, sc->half);
        for (int m = 0; m < MB; m++) {
            __m512 sum = dot[m][0];
            for (int c = 1; c < chains; c++) sum = _mm512_add_ps(sum, dot[m][c]);
            const __m512 gsum = _mm512_set1_ps(a->gsum[(m0 + m) * groups + g]);
            if (wide) {
                add_wide(sums[m], _mm512_fmadd_ps(o, gsum, _mm512_mul_ps(sum, s)));
            } else {
                acc[m] = _mm512_fmadd_ps(sum, s, acc[m]);
                acc[m] = _mm512_fmadd_ps(o, gsum, acc[m]);
            }
        }
    }
    for (int m = 0; m < MB; m++) store_tile_row(y, wide, m0 + m, N, tile, acc[m], sums[m]);
}

/* Every row of x against one tile, MBLOCK rows at a time (MB a constant in each instance, so the
 * accumulators live in registers). */
INLINE void vnni_tile(int bits, int G, int limbs, const float *x, const Activations *a, const uint8_t *codes,
                      const Scales *sc, void *y, int wide, int64_t M, int64_t N, int64_t K, int64_t tile) {
    const int block = limbs == 2 ? MBLOCK_TWO_LIMBS : MBLOCK;
    for (int64_t m0 = 0; m0 < M; m0 += block) {
#define ROWS_CASE(MB)                                                                                 \
    case MB:                                                                                          \
        if (limbs) int8_rows(bits, G, limbs, MB, a, codes, sc, y, wide, m0, N, K, tile);                \
        else float_rows(bits, G, MB, x, a, codes, sc, y, wide, m0, N, K, tile);                    \
        break;
        switch (M - m0 < block ? M - m0 : block) {
            ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
        }
#undef ROWS_CASE
    }
}

/* (`wide` is passed to the inlined tile as a constant: each form compiles to its own loop.) */
#define DEFINE_VNNI(NAME, BITS, G, LIMBS)                                                               \
    static void NAME(const float *x, const Activations *a, const uint8_t *codes, const Scales *sc, void *y,  \
                     int wide, int64_t M, int64_t N, int64_t K, int nthreads) {                         \
        const int64_t tiles = (N + TILE - 1) / TILE;                                                    \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static) if(nthreads > 1)")            \
        for (int64_t tile = 0; tile < tiles; tile++) {                                                  \
            if (wide) vnni_tile(BITS, G, LIMBS, x, a, codes, sc, y, 1, M, N, K, tile);                  \
            else vnni_tile(BITS, G, LIMBS, x, a, codes, sc, y, 0, M, N, K, tile);                       \
        }                                                                                               \
    }

DEFINE_VNNI(vnni_4bit_g32_float, 4, 32, 0)
DEFINE_VNNI(vnni_4bit_g32_int8, 4, 32, 1)
DEFINE_VNNI(vnni_4bit_g32_int16, 4, 32, 2)
DEFINE_VNNI(vnni_8bit_g32_float, 8, 32, 0)
DEFINE_VNNI(vnni_8bit_g32_int8, 8, 32, 1)
DEFINE_VNNI(vnni_8bit_g32_int16, 8, 32, 2)
DEFINE_VNNI(vnni_8bit_g16_float, 8, 16, 0)
DEFINE_VNNI(vnni_8bit_g16_int8, 8, 16, 1)
DEFINE_VNNI(vnni_8bit_g16_int16, 8, 16, 2)
DEFINE_VNNI(vnni_5bit_g32_float, 5, 32, 0)
DEFINE_VNNI(vnni_5bit_g32_int8, 5, 32, 1)
DEFINE_VNNI(vnni_5bit_g32_int16, 5, 32, 2)

typedef void (*Kernel)(const float *, const Activations *, const uint8_t *, const Scales *, void *, int, int64_t,
                       int64_t, int64_t, int);
/* [layout (`layout_index`)][limbs] */
static const Kernel KERNELS[4][3] = {
    {vnni_4bit_g32_float, vnni_4bit_g32_int8, vnni_4bit_g32_int16},
    {vnni_8bit_g32_float, vnni_8bit_g32_int8, vnni_8bit_g32_int16},
    {vnni_8bit_g16_float, vnni_8bit_g16_int8, vnni_8bit_g16_int16},
    {vnni_5bit_g32_float, vnni_5bit_g32_int8, vnni_5bit_g32_int16},
};
#endif

static void portable(int bits, int G, int limbs, const float *x, const Activations *a, const uint8_t *codes,
                     const Scales *sc, void *y, int wide, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t tile = 0; tile < tiles; tile++)
        portable_tile(bits, G, limbs, x, a, codes, sc, y, wide, M, N, K, tile);
}

#include "group_affine_avx2.h"

/* The instruction sets a call can run on, as `group_affine_kernel_isa` reports them. The 256-bit
 * ones serve integer activations only (float ones run the portable loops there). */
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512_VNNI = 2, ISA_AVX_VNNI = 3 };

/* Whether this CPU runs `isa`'s kernels (AVX512-VNNI: compiled in by -march=native). */
static int isa_supported(int isa) {
    switch (isa) {
    case ISA_AVX512_VNNI: return HAVE_VNNI;
#if HAVE_AVX2_KERNEL
    case ISA_AVX_VNNI: return avx_vnni_supported();
    case ISA_AVX2: return avx2_supported();
#endif
    case ISA_PORTABLE: return 1;
    default: return 0;
    }
}

/* The fastest kernels this CPU runs: AVX512-VNNI, else AVX-VNNI, else AVX2, else the portable loops. */
static int best_isa(void) {
    static int best = -1; /* the CPU does not change: found once (a race writes the same value) */
    if (best < 0) {
        const int order[] = {ISA_AVX512_VNNI, ISA_AVX_VNNI, ISA_AVX2, ISA_PORTABLE};
        int i = 0;
        while (!isa_supported(order[i])) i++;
        best = order[i];
    }
    return best;
}

/* Whether (bits, group, act_bits) runs: 4-bit codes in groups of 32, 8-bit in groups of 16 or 32;
 * activations of 0 (float), 8 or 16 bits, the integer ones with K in whole blocks of 32. */
static int valid(int bits, int group, int act_bits, int64_t M, int64_t K) {
    const int layout = ((bits == 4 || bits == 5) && group == 32) || (bits == 8 && (group == 16 || group == 32));
    const int activations = act_bits == 0 || ((act_bits == 8 || act_bits == 16) && K % XBLOCK == 0);
    return layout && activations && M >= 1 && K % group == 0;
}

/* Validate, round the activations, and sweep the weight CHUNK_M rows of x at a time (so a chunk's
 * activations stay in cache while every tile meets them) with `isa`'s kernels (ISA_*). Returns 0,
 * -1 for a call it does not take, -2 if memory ran out, -3 for an `isa` this CPU lacks. */
static int gemm(int isa, int bits, int group, int act_bits, int half, const float *x, const uint8_t *codes,
                const void *scale, const void *offset, void *y, int wide, int64_t M, int64_t N, int64_t K,
                int nthreads) {
    if (!valid(bits, group, act_bits, M, K)) return -1;
    if (!isa_supported(isa)) return -3;
    const int limbs = act_bits / 8;
    const int vector = isa == ISA_AVX512_VNNI;
    const int vnni256 = limbs && isa == ISA_AVX_VNNI, avx2 = limbs && isa == ISA_AVX2;
    const Scales sc = {scale, offset, half};
    Activations a;
    if (!prepare(limbs, group, x, M, K, vector, &a)) {
        release(&a);
        return -2;
    }
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK_M) {
        const int64_t rows = M - m0 < CHUNK_M ? M - m0 : CHUNK_M;
        void *out = wide ? (void *)((double *)y + m0 * N) : (void *)((float *)y + m0 * N);
        const Activations chunk = {
            a.q ? a.q + m0 * K : NULL, a.q2 ? a.q2 + m0 * K : NULL, a.step ? a.step + m0 * (K / XBLOCK) : NULL,
            a.gsum + m0 * (K / group),
        };
#if HAVE_AVX2_KERNEL
        if (vnni256) {
            vnni256_gemm(bits, group, limbs, &chunk, codes, &sc, out, wide, rows, N, K, nthreads);
            continue;
        }
        if (avx2) {
            if (avx2_gemm(bits, group, limbs, &chunk, codes, &sc, out, wide, rows, N, K, nthreads) != 0) {
                release(&a);
                return -2;
            }
            continue;
        }
#endif
#if HAVE_VNNI
        if (vector) {
            KERNELS[layout_index(bits, group)][limbs](x + m0 * K, &chunk, codes, &sc, out, wide, rows, N, K,
                                                      nthreads);
            continue;
        }
#endif
        portable(bits, group, limbs, x + m0 * K, &chunk, codes, &sc, out, wide, rows, N, K, nthreads);
    }
    release(&a);
    return 0;
}

/* The entry point: the fastest kernels this CPU runs (best_isa). */
int group_affine_tiled_gemm(int bits, int group, int act_bits, int half, const float *x, const uint8_t *codes,
                            const void *scale, const void *offset, float *y, int64_t M, int64_t N, int64_t K,
                            int nthreads) {
    return gemm(best_isa(), bits, group, act_bits, half, x, codes, scale, offset, y, 0, M, N, K, nthreads);
}

/* The portable loops, callable directly so the tests check them on AVX-512 machines too. */
int group_affine_tiled_gemm_portable(int bits, int group, int act_bits, int half, const float *x,
                                     const uint8_t *codes, const void *scale, const void *offset, float *y, int64_t M,
                                     int64_t N, int64_t K, int nthreads) {
    return gemm(ISA_PORTABLE, bits, group, act_bits, half, x, codes, scale, offset, y, 0, M, N, K, nthreads);
}

/* The AVX2 kernel (integer activations; float ones run the portable loops), callable directly so
 * the tests check it on AVX-512 machines too; -3 on a CPU without AVX2. */
int group_affine_tiled_gemm_avx2(int bits, int group, int act_bits, int half, const float *x, const uint8_t *codes,
                                 const void *scale, const void *offset, float *y, int64_t M, int64_t N, int64_t K,
                                 int nthreads) {
    return gemm(ISA_AVX2, bits, group, act_bits, half, x, codes, scale, offset, y, 0, M, N, K, nthreads);
}

/* One weight's fixed arguments, bound once, so a call from Python passes five instead of twelve. */
typedef struct {
    int32_t bits, group, act_bits, half;
    const uint8_t *codes;
    const void *scale, *offset;
    int64_t N, K;
} Plan;

int group_affine_tiled_gemm_planned(const Plan *p, const float *x, float *y, int64_t M, int nthreads) {
    return group_affine_tiled_gemm(p->bits, p->group, p->act_bits, p->half, x, p->codes, p->scale, p->offset, y, M,
                                   p->N, p->K, nthreads);
}

/* The wide form (see the top of the file): y [M, N] float64, each group's float32 term summed over
 * the groups in float64. `isa`: one of ISA_*, or -1 for the fastest this CPU runs. */
int group_affine_tiled_gemm_wide(const Plan *p, int isa, const float *x, double *y, int64_t M, int nthreads) {
    return gemm(isa < 0 ? best_isa() : isa, p->bits, p->group, p->act_bits, p->half, x, p->codes, p->scale,
                p->offset, y, 1, M, p->N, p->K, nthreads);
}


/* The AVX-VNNI kernel, likewise: -3 on a CPU without AVX-VNNI. */
int group_affine_tiled_gemm_avx_vnni(int bits, int group, int act_bits, int half, const float *x,
                                     const uint8_t *codes, const void *scale, const void *offset, float *y, int64_t M,
                                     int64_t N, int64_t K, int nthreads) {
    return gemm(ISA_AVX_VNNI, bits, group, act_bits, half, x, codes, scale, offset, y, 0, M, N, K, nthreads);
}

/* Which of the 256-bit versions run on this CPU: bit 0 AVX2, bit 1 AVX-VNNI. */
int group_affine_256_supported(void) { return isa_supported(ISA_AVX2) | (isa_supported(ISA_AVX_VNNI) << 1); }

/* What the entry point runs on this CPU: 2 AVX512-VNNI, 3 AVX-VNNI, 1 AVX2, 0 the portable loops. */
int group_affine_kernel_isa(void) { return best_isa(); }

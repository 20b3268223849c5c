/* The tiled group-affine GEMM with AVX2 (x86-64-v3: Zen 2/3, Intel client CPUs, most laptops), and
 * with AVX-VNNI where the CPU has it (below), for integer activations: part of group_affine_gemm.c
 * (included by it, after its types), not a standalone source.
 *
 * AVX2 has no 8-bit dot product that is exact for 8-bit codes (`vpmaddubsw` saturates), so codes
 * and activations are both widened to int16 and multiplied with `vpmaddwd` (int16 x int16, pairs
 * summed into int32). An activation is one int16, 254 * q1 + q2 with two limbs (|v| <= 32,385) or
 * q1 with one, so the integer sum of a group is exactly the VNNI kernel's 254 * sum(w q1) +
 * sum(w q2), and the float steps after it are the same operations in the same order: the results
 * are bit for bit those of the AVX512-VNNI kernel (the tests compare them). Bounds: a product is at
 * most 255 x 32,385, a group of 32 sums 32 of them: below 2^31.
 *
 * Layout (see group_affine_gemm.c): 16 bytes of a quad are rows 4c .. 4c+3 of the tile, four codes
 * each. Widened, they meet a row of x's four activations of that quad, broadcast: `vpmaddwd` gives
 * two partial sums per tile row; `vphaddd` and a permute put each row's sum in place at the end of
 * the group. The functions carry their own target attribute, so the kernel is in every x86 build
 * (the tests run it on AVX-512 machines too) and is chosen at run time where the CPU has AVX2.
 */
#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_AVX2_KERNEL 1
#define AVX2_FUNCTION static __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

static int avx2_supported(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* Quad q's codes of tile rows 4c .. 4c+3 as 16 int16 (4-bit: quad q < G/8 in the low nibbles of
 * its 64 bytes, quad q >= G/8 in the high nibbles of quad q - G/8's; 5-bit: those, and bit q of
 * the fifth-bit plane after them moved to bit 4, as the 512-bit kernel's `fifth_bits`). */
AVX2_INLINE __m256i avx2_codes(int bits, int G, const uint8_t *src, int q, int c) {
    if (bits == 8) return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + 64 * q + 16 * c)));
    const int high = q >= G / 8;
    __m128i packed = _mm_loadu_si128((const __m128i *)(src + 64 * (high ? q - G / 8 : q) + 16 * c));
    if (high) packed = _mm_srli_epi16(packed, 4);
    packed = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
    if (bits == 5) {
        const __m128i plane = _mm_loadu_si128((const __m128i *)(src + 64 * (G / 8) + 16 * c));
        const __m128i moved = q <= 4 ? _mm_slli_epi16(plane, 4 - q) : _mm_srli_epi16(plane, q - 4);
        packed = _mm_or_si128(packed, _mm_and_si128(moved, _mm_set1_epi8(0x10)));
    }
    return _mm256_cvtepu8_epi16(packed);
}

/* Two accumulators of four tile rows each, (row, partial) in every pair of lanes, into the eight
 * rows' int32 sums in order. */
AVX2_INLINE __m256i avx2_row_sums(__m256i first, __m256i second) {
    const __m256i sums = _mm256_hadd_epi32(first, second); /* rows 0 1 4 5 | 2 3 6 7 */
    return _mm256_permute4x64_epi64(sums, _MM_SHUFFLE(3, 1, 2, 0));
}

AVX2_INLINE __m256 avx2_scales(const void *values, int64_t at, int half) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)values + at)));
    return _mm256_loadu_ps((const float *)values + at);
}

AVX2_INLINE void avx2_store(float *y, int64_t N, int64_t first, __m256 v) {
    if (first + 8 <= N) {
        _mm256_storeu_ps(y + first, v);
        return;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    for (int64_t r = 0; first + r < N; r++) y[first + r] = lanes[r];
}

/* The wide form (group_affine_gemm.c): a group's 8 float32 terms added to two float64 sums of 4. */
AVX2_INLINE void avx2_add_wide(__m256d *sums, __m256 term) {
    sums[0] = _mm256_add_pd(sums[0], _mm256_cvtps_pd(_mm256_castps256_ps128(term)));
    sums[1] = _mm256_add_pd(sums[1], _mm256_cvtps_pd(_mm256_extractf128_ps(term, 1)));
}

/* 8 rows' results at `first`: the float32 sums, or the wide form's float64 ones. */
AVX2_INLINE void avx2_store_row(void *y, int wide, int64_t N, int64_t first, __m256 acc, const __m256d *sums) {
    if (!wide) {
        avx2_store((float *)y, N, first, acc);
        return;
    }
    double lanes[8];
    _mm256_storeu_pd(lanes, sums[0]);
    _mm256_storeu_pd(lanes + 4, sums[1]);
    for (int64_t r = 0; r < 8 && first + r < N; r++) ((double *)y)[first + r] = lanes[r];
}

/* One group's dot products for one row of x (its int16 activations `x`) against the group's
 * widened codes `w` [G/4 quads][4 chunks]: the 16 tile rows' int32 sums, as two vectors of 8. */
AVX2_INLINE void avx2_group_sums(int G, const __m256i *w, const int16_t *x, __m256i *low, __m256i *high) {
    __m256i part[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                       _mm256_setzero_si256()};
    for (int q = 0; q < G / 4; q++) {
        int64_t four; /* the row's four activations of this quad */
        memcpy(&four, x + 4 * q, sizeof four);
        const __m256i xq = _mm256_set1_epi64x(four);
        for (int c = 0; c < 4; c++) part[c] = _mm256_add_epi32(part[c], _mm256_madd_epi16(w[4 * q + c], xq));
    }
    *low = avx2_row_sums(part[0], part[1]);
    *high = avx2_row_sums(part[2], part[3]);
}

/* Every row of x (M at most CHUNK_M, as int16 activations x16) against one tile. Each group's
 * codes are widened once into `w` (1 KiB, in L1), which every row then reads: the widening is
 * not repeated per row of x. */
AVX2_INLINE void avx2_tile(int bits, int G, const int16_t *x16, const Activations *a, const uint8_t *codes,
                           const Scales *sc, void *y, int wide, int64_t M, int64_t N, int64_t K, int64_t tile) {
    const int64_t groups = K / G, group_bytes = (int64_t)TILE * G * bits / 8, blocks = K / XBLOCK;
    __m256 acc[CHUNK_M][2];
    __m256d sums[CHUNK_M][2][2];
    __m256i w[8 * 4];
    for (int64_t m = 0; m < M; m++) {
        acc[m][0] = acc[m][1] = _mm256_setzero_ps();
        if (wide) sums[m][0][0] = sums[m][0][1] = sums[m][1][0] = sums[m][1][1] = _mm256_setzero_pd();
    }
    for (int64_t g = 0; g < groups; g++) {
        const int64_t at = tile * groups + g;
        const uint8_t *src = codes + at * group_bytes;
        _mm_prefetch((const char *)(src + 4096), _MM_HINT_T0);
        for (int q = 0; q < G / 4; q++)
            for (int c = 0; c < 4; c++) w[4 * q + c] = avx2_codes(bits, G, src, q, c);
        const __m256 s[2] = {avx2_scales(sc->scale, at * TILE, sc->half), avx2_scales(sc->scale, at * TILE + 8, sc->half)};
        const __m256 o[2] = {avx2_scales(sc->offset, at * TILE, sc->half),
                             avx2_scales(sc->offset, at * TILE + 8, sc->half)};
        for (int64_t m = 0; m < M; m++) {
            __m256i sum[2];
            avx2_group_sums(G, w, x16 + m * K + g * G, &sum[0], &sum[1]);
            const __m256 step = _mm256_set1_ps(a->step[m * blocks + g * G / XBLOCK]);
            const __m256 gsum = _mm256_set1_ps(a->gsum[m * groups + g]);
            for (int h = 0; h < 2; h++) {
                const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(sum[h]), _mm256_mul_ps(s[h], step));
                if (wide) {
                    avx2_add_wide(sums[m][h], _mm256_fmadd_ps(o[h], gsum, scaled));
                } else {
                    acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h]), _mm256_mul_ps(s[h], step), acc[m][h]);
                    acc[m][h] = _mm256_fmadd_ps(o[h], gsum, acc[m][h]);
                }
            }
        }
    }
    for (int64_t m = 0; m < M; m++) {
        void *row = wide ? (void *)((double *)y + m * N) : (void *)((float *)y + m * N);
        for (int h = 0; h < 2; h++) avx2_store_row(row, wide, N, tile * TILE + 8 * h, acc[m][h], sums[m][h]);
    }
}

#define DEFINE_AVX2(NAME, BITS, G)                                                                         \
    AVX2_FUNCTION void NAME(const int16_t *x16, const Activations *a, const uint8_t *codes, const Scales *sc,   \
                            void *y, int wide, int64_t M, int64_t N, int64_t K, int nthreads) {               \
        const int64_t tiles = (N + TILE - 1) / TILE;                                                       \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static) if(nthreads > 1)")               \
        for (int64_t tile = 0; tile < tiles; tile++) {                                                     \
            if (wide) avx2_tile(BITS, G, x16, a, codes, sc, y, 1, M, N, K, tile);                          \
            else avx2_tile(BITS, G, x16, a, codes, sc, y, 0, M, N, K, tile);                               \
        }                                                                                                  \
    }
DEFINE_AVX2(avx2_4bit_g32, 4, 32)
DEFINE_AVX2(avx2_8bit_g32, 8, 32)
DEFINE_AVX2(avx2_8bit_g16, 8, 16)
DEFINE_AVX2(avx2_5bit_g32, 5, 32)

/* x's rows (M at most CHUNK_M, already rounded into `a`) through the AVX2 kernel; 0, or -2 if
 * memory ran out. */
static int avx2_gemm(int bits, int G, int limbs, const Activations *a, const uint8_t *codes, const Scales *sc,
                     void *y, int wide, int64_t M, int64_t N, int64_t K, int nthreads) {
    int16_t *x16 = malloc(sizeof(int16_t) * (size_t)(M * K));
    if (x16 == NULL) return -2;
    for (int64_t i = 0; i < M * K; i++) x16[i] = (int16_t)(limbs == 2 ? a->q[i] * 254 + a->q2[i] : a->q[i]);
    if (bits == 4) avx2_4bit_g32(x16, a, codes, sc, y, wide, M, N, K, nthreads);
    else if (bits == 5) avx2_5bit_g32(x16, a, codes, sc, y, wide, M, N, K, nthreads);
    else if (G == 32) avx2_8bit_g32(x16, a, codes, sc, y, wide, M, N, K, nthreads);
    else avx2_8bit_g16(x16, a, codes, sc, y, wide, M, N, K, nthreads);
    free(x16);
    return 0;
}
/* AVX-VNNI (Intel client CPUs since Alder Lake, Sierra Forest: `vpdpbusd` on 256 bits, no
 * AVX-512): the VNNI kernel's arithmetic on half its width. A quad's 64 bytes are two vectors, tile
 * rows 0-7 and 8-15; every row of x meets them with its four int8 activations broadcast, one
 * `vpdpbusd` per half and limb, the limbs combined as 254 * first + second: the same integers and
 * float steps as the 512-bit kernel, so the same results bit for bit. */
#define VNNI256_FUNCTION static __attribute__((target("avx2,fma,f16c,avxvnni")))
#define VNNI256_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c,avxvnni")))

static int avx_vnni_supported(void) { return avx2_supported() && __builtin_cpu_supports("avxvnni"); }

/* Quad q's codes of tile rows 8h .. 8h+7, one per byte (5-bit: as `avx2_codes`). */
VNNI256_INLINE __m256i vnni256_codes(int bits, int G, const uint8_t *src, int q, int h) {
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)(src + 64 * q + 32 * h));
    const int high = q >= G / 8;
    __m256i packed = _mm256_loadu_si256((const __m256i *)(src + 64 * (high ? q - G / 8 : q) + 32 * h));
    if (high) packed = _mm256_srli_epi16(packed, 4);
    packed = _mm256_and_si256(packed, _mm256_set1_epi8(0x0F));
    if (bits == 5) {
        const __m256i plane = _mm256_loadu_si256((const __m256i *)(src + 64 * (G / 8) + 32 * h));
        const __m256i moved = q <= 4 ? _mm256_slli_epi16(plane, 4 - q) : _mm256_srli_epi16(plane, q - 4);
        packed = _mm256_or_si256(packed, _mm256_and_si256(moved, _mm256_set1_epi8(0x10)));
    }
    return packed;
}

VNNI256_INLINE __m256i vnni256_broadcast4(const int8_t *src) {
    int32_t v;
    memcpy(&v, src, 4);
    return _mm256_set1_epi32(v);
}

/* Every row of x (M at most CHUNK_M) against one tile; a group's codes are loaded once for all. */
VNNI256_INLINE void vnni256_tile(int bits, int G, int limbs, const Activations *a, const uint8_t *codes,
                                 const Scales *sc, void *y, int wide, int64_t M, int64_t N, int64_t K, int64_t tile) {
    const int64_t groups = K / G, group_bytes = (int64_t)TILE * G * bits / 8, blocks = K / XBLOCK;
    __m256 acc[CHUNK_M][2];
    __m256d sums[CHUNK_M][2][2];
    __m256i w[8][2];
    for (int64_t m = 0; m < M; m++) {
        acc[m][0] = acc[m][1] = _mm256_setzero_ps();
        if (wide) sums[m][0][0] = sums[m][0][1] = sums[m][1][0] = sums[m][1][1] = _mm256_setzero_pd();
    }
    for (int64_t g = 0; g < groups; g++) {
        const int64_t at = tile * groups + g;
        const uint8_t *src = codes + at * group_bytes;
        _mm_prefetch((const char *)(src + 4096), _MM_HINT_T0);
        for (int q = 0; q < G / 4; q++) w[q][0] = vnni256_codes(bits, G, src, q, 0), w[q][1] = vnni256_codes(bits, G, src, q, 1);
        const __m256 s[2] = {avx2_scales(sc->scale, at * TILE, sc->half), avx2_scales(sc->scale, at * TILE + 8, sc->half)};
        const __m256 o[2] = {avx2_scales(sc->offset, at * TILE, sc->half),
                             avx2_scales(sc->offset, at * TILE + 8, sc->half)};
        for (int64_t m = 0; m < M; m++) {
            __m256i first[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            __m256i second[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            const int64_t at_x = m * K + g * G;
            for (int q = 0; q < G / 4; q++) {
                const __m256i x1 = vnni256_broadcast4(a->q + at_x + 4 * q);
                first[0] = _mm256_dpbusd_avx_epi32(first[0], w[q][0], x1);
                first[1] = _mm256_dpbusd_avx_epi32(first[1], w[q][1], x1);
                if (limbs == 2) {
                    const __m256i x2 = vnni256_broadcast4(a->q2 + at_x + 4 * q);
                    second[0] = _mm256_dpbusd_avx_epi32(second[0], w[q][0], x2);
                    second[1] = _mm256_dpbusd_avx_epi32(second[1], w[q][1], x2);
                }
            }
            const __m256 step = _mm256_set1_ps(a->step[m * blocks + g * G / XBLOCK]);
            const __m256 gsum = _mm256_set1_ps(a->gsum[m * groups + g]);
            for (int h = 0; h < 2; h++) {
                __m256i sum = first[h];
                if (limbs == 2) sum = _mm256_add_epi32(_mm256_mullo_epi32(sum, _mm256_set1_epi32(254)), second[h]);
                if (wide) {
                    const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(s[h], step));
                    avx2_add_wide(sums[m][h], _mm256_fmadd_ps(o[h], gsum, scaled));
                } else {
                    acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(s[h], step), acc[m][h]);
                    acc[m][h] = _mm256_fmadd_ps(o[h], gsum, acc[m][h]);
                }
            }
        }
    }
    for (int64_t m = 0; m < M; m++) {
        void *row = wide ? (void *)((double *)y + m * N) : (void *)((float *)y + m * N);
        for (int h = 0; h < 2; h++) avx2_store_row(row, wide, N, tile * TILE + 8 * h, acc[m][h], sums[m][h]);
    }
}

#define DEFINE_VNNI256(NAME, BITS, G, LIMBS)                                                                     \
    VNNI256_FUNCTION void NAME(const Activations *a, const uint8_t *codes, const Scales *sc, void *y, int wide,    \
                               int64_t M, int64_t N, int64_t K, int nthreads) {                                  \
        const int64_t tiles = (N + TILE - 1) / TILE;                                                             \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static) if(nthreads > 1)")                     \
        for (int64_t tile = 0; tile < tiles; tile++) {                                                           \
            if (wide) vnni256_tile(BITS, G, LIMBS, a, codes, sc, y, 1, M, N, K, tile);                           \
            else vnni256_tile(BITS, G, LIMBS, a, codes, sc, y, 0, M, N, K, tile);                                \
        }                                                                                                        \
    }
DEFINE_VNNI256(vnni256_4bit_g32_int8, 4, 32, 1)
DEFINE_VNNI256(vnni256_4bit_g32_int16, 4, 32, 2)
DEFINE_VNNI256(vnni256_8bit_g32_int8, 8, 32, 1)
DEFINE_VNNI256(vnni256_8bit_g32_int16, 8, 32, 2)
DEFINE_VNNI256(vnni256_8bit_g16_int8, 8, 16, 1)
DEFINE_VNNI256(vnni256_8bit_g16_int16, 8, 16, 2)
DEFINE_VNNI256(vnni256_5bit_g32_int8, 5, 32, 1)
DEFINE_VNNI256(vnni256_5bit_g32_int16, 5, 32, 2)

/* x's rows (M at most CHUNK_M, already rounded into `a`) through the AVX-VNNI kernel. */
static void vnni256_gemm(int bits, int G, int limbs, const Activations *a, const uint8_t *codes, const Scales *sc,
                         void *y, int wide, int64_t M, int64_t N, int64_t K, int nthreads) {
    typedef void (*Kernel256)(const Activations *, const uint8_t *, const Scales *, void *, int, int64_t, int64_t,
                              int64_t, int);
    static const Kernel256 kernels[4][2] = {
        {vnni256_4bit_g32_int8, vnni256_4bit_g32_int16},
        {vnni256_8bit_g32_int8, vnni256_8bit_g32_int16},
        {vnni256_8bit_g16_int8, vnni256_8bit_g16_int16},
        {vnni256_5bit_g32_int8, vnni256_5bit_g32_int16},
    };
    kernels[layout_index(bits, G)][limbs - 1](a, codes, sc, y, wide, M, N, K, nthreads);
}
#else
#define HAVE_AVX2_KERNEL 0
#endif

/* Row-invariant products with 4- and 8-bit block weights for the CPU (engine/q4.py lays the weights out;
   kernels.py builds it).

   The weights are Q4_1 blocks, as a GGUF file stores them: 32 consecutive k of one output share a scale d and a
   minimum m (fp16), w = d * q + m with q in 0..15. Each row of x is quantized on entry as llama.cpp does for
   these blocks (Q8_1): per block of 32, a = round(x / e) in -127..127 with e = max |x| / 127, and t = e * sum a.
   Then y[r, n] = sum over blocks of (d * e) * sum(q * a) + m * t: the inner sums are exact integers
   (AVX512-VNNI's u8 x s8 dot product, four k a lane), and the blocks are added in k order in one fp32 lane, so
   a row's bits depend neither on the rows beside it nor on the thread count (threads split the outputs).

   Layout, per group of 32 outputs and block of 32 k (Q4_BYTES bytes): 2 halves x 4 vectors x 64 bytes of
   nibbles (half c, vector v, lane o, byte t: low nibble q[16c + o][4v + t], high nibble q[16c + o][16 + 4v + t]),
   then d[32] and m[32] as fp16.

   The lm_head's Q8_0 blocks (w = d * q, q in -127..127, as a GGUF's token embedding) use the same quantized
   rows offset by 128 (VNNI multiplies unsigned by signed bytes): sum((a + 128) * q) - 128 * sum(q), exact.
   Layout, per group of 32 outputs and block of 32 k (Q8_BYTES): 2 halves x 8 vectors x 64 bytes (half c,
   vector v, lane o, byte t: q[16c + o][4v + t]), d[32] fp16, then 128 * sum(q) [32] int32. */
#include <stdint.h>
#include <stdlib.h>

#define Q4_GROUP 32
#define Q4_BLOCK 32
#define Q4_BYTES (512 + 64 + 64)
#define Q8_BYTES (1024 + 64 + 128)
#define Q4_AHEAD 12   /* blocks q4_tile prefetches ahead: every line, into L2 */
#define Q4_ROWS 4   /* rows a register tile holds: 8 integer and 8 fp32 accumulators */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

int row_q4_available(void) { return 1; }

/* x [rows, k] bf16 -> a [rows, k] int8, e and t [rows, k / 32] (scale, scale * sum a), each block alone. */
void row_q4_quantize(const uint16_t *x, int64_t rows, int64_t x_stride, int64_t k, int8_t *a, float *e, float *t) {
    const int64_t blocks = k / Q4_BLOCK;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            const uint16_t *xb = x + r * x_stride + b * Q4_BLOCK;
            __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)xb)), 16));
            __m512 v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xb + 16))), 16));
            float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            float scale = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
            /* nearest, ties to even (the default rounding mode of the conversion) */
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
            __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(a + r * k + b * Q4_BLOCK), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(a + r * k + b * Q4_BLOCK + 16), _mm512_cvtsepi32_epi8(q1));
            e[r * blocks + b] = scale;
            t[r * blocks + b] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
}

/* A tile's fp32 sums -> its rows of y as bf16 (the padding rows dropped). */
static inline __attribute__((always_inline)) void store_tile(__m512 acc[Q4_ROWS][2], int64_t rows, const int rows_const,
                                                             uint16_t *y, int64_t y_stride) {
    for (int r = 0; r < rows_const && r < rows; ++r)
        for (int c = 0; c < 2; ++c)
            _mm256_storeu_si256((__m256i *)(y + r * y_stride + c * 16), (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
}

/* One tile: `rows` (1 to Q4_ROWS) quantized rows against group g's 32 outputs, every block. */
static inline __attribute__((always_inline)) void q4_tile(const int8_t *a, const float *e, const float *t, int64_t k,
                                                          int64_t rows, const uint8_t *w, uint16_t *y,
                                                          int64_t y_stride, const int rows_const) {
    const int64_t blocks = k / Q4_BLOCK;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[Q4_ROWS][2];
    const int8_t *ar[Q4_ROWS];
    const float *er[Q4_ROWS], *tr[Q4_ROWS];
    for (int r = 0; r < rows_const; ++r) {
        int64_t row = r < rows ? r : 0;   /* padding rows repeat row 0 */
        ar[r] = a + row * k, er[r] = e + row * blocks, tr[r] = t + row * blocks;
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *wb = w + b * Q4_BYTES;
        /* a decoder's weights come from memory every step (a stack does not stay in the caches): every line
           of a block well ahead, where one line a block left the rest to the hardware's prefetcher */
        for (int line = 0; line < Q4_BYTES; line += 64)
            _mm_prefetch((const char *)(wb + Q4_AHEAD * Q4_BYTES + line), _MM_HINT_T1);
        /* the low and high nibbles' sums apart (integers: exact in any order), two short chains a lane */
        __m512i sum[Q4_ROWS][2], high[Q4_ROWS][2];
        for (int r = 0; r < rows_const; ++r)
            sum[r][0] = sum[r][1] = high[r][0] = high[r][1] = _mm512_setzero_si512();
        for (int v = 0; v < 4; ++v) {
            __m512i lo[2], hi[2];
            for (int c = 0; c < 2; ++c) {
                __m512i raw = _mm512_loadu_si512((const void *)(wb + (c * 4 + v) * 64));
                lo[c] = _mm512_and_si512(raw, low);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
            for (int r = 0; r < rows_const; ++r) {
                const int8_t *ab = ar[r] + b * Q4_BLOCK + 4 * v;
                __m512i xlo = _mm512_set1_epi32(*(const int32_t *)ab), xhi = _mm512_set1_epi32(*(const int32_t *)(ab + 16));
                for (int c = 0; c < 2; ++c) {
                    sum[r][c] = _mm512_dpbusd_epi32(sum[r][c], lo[c], xlo);
                    high[r][c] = _mm512_dpbusd_epi32(high[r][c], hi[c], xhi);
                }
            }
        }
        for (int r = 0; r < rows_const; ++r)
            for (int c = 0; c < 2; ++c) sum[r][c] = _mm512_add_epi32(sum[r][c], high[r][c]);
        __m512 d[2], m[2];
        for (int c = 0; c < 2; ++c) {
            d[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + 512 + c * 32)));
            m[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + 576 + c * 32)));
        }
        for (int r = 0; r < rows_const; ++r) {
            __m512 er_b = _mm512_set1_ps(er[r][b]), tr_b = _mm512_set1_ps(tr[r][b]);
            for (int c = 0; c < 2; ++c) {
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][c]), _mm512_mul_ps(d[c], er_b), acc[r][c]);
                acc[r][c] = _mm512_fmadd_ps(m[c], tr_b, acc[r][c]);
            }
        }
    }
    store_tile(acc, rows, rows_const, y, y_stride);
}

/* Quantized rows (row_q4_quantize) times w laid out as above -> y [rows, n] bf16 (row stride y_stride);
   n % 32 == 0, k % 32 == 0. */
void row_q4_product(const int8_t *a, const float *e, const float *t, int64_t rows, const uint8_t *w, int64_t n,
                    int64_t k, uint16_t *y, int64_t y_stride, int threads) {
    const int64_t groups = n / Q4_GROUP, blocks = k / Q4_BLOCK;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *wg = w + g * blocks * Q4_BYTES;
        for (int64_t r = 0; r < rows; r += Q4_ROWS) {
            int64_t left = rows - r < Q4_ROWS ? rows - r : Q4_ROWS;
            const int8_t *at = a + r * k;
            const float *et = e + r * blocks, *tt = t + r * blocks;
            uint16_t *yt = y + r * y_stride + g * Q4_GROUP;
            switch (left) {   /* a constant row count per call: the tile's loops unroll into registers */
                case 1: q4_tile(at, et, tt, k, left, wg, yt, y_stride, 1); break;
                case 2: q4_tile(at, et, tt, k, left, wg, yt, y_stride, 2); break;
                case 3: q4_tile(at, et, tt, k, left, wg, yt, y_stride, 3); break;
                default: q4_tile(at, et, tt, k, left, wg, yt, y_stride, Q4_ROWS);
            }
        }
    }
}

/* x's rows quantized by row_q4_quantize into one allocation (free(q.e) releases it). */
typedef struct { int8_t *a; float *e, *t; } Quantized;

static Quantized quantized_rows(const uint16_t *x, int64_t rows, int64_t x_stride, int64_t k) {
    const int64_t scales = rows * (k / Q4_BLOCK);
    Quantized q;
    q.e = malloc(sizeof(float) * 2 * scales + (size_t)(rows * k));
    q.t = q.e + scales;
    q.a = (int8_t *)(q.t + scales);
    row_q4_quantize(x, rows, x_stride, k, q.a, q.e, q.t);
    return q;
}

/* x [rows, k] bf16 (row stride x_stride) -> y: quantized, then multiplied. */
void row_matmul_q4(const uint16_t *x, int64_t rows, int64_t x_stride, const uint8_t *w, int64_t n, int64_t k,
                   uint16_t *y, int64_t y_stride, int threads) {
    Quantized q = quantized_rows(x, rows, x_stride, k);
    row_q4_product(q.a, q.e, q.t, rows, w, n, k, y, y_stride, threads);
    free(q.e);
}

/* One tile of the Q8_0 product: offset rows (a + 128) against group g's 32 outputs, every block. */
static inline __attribute__((always_inline)) void q8_tile(const uint8_t *a, const float *e, int64_t k, int64_t rows,
                                                          const uint8_t *w, uint16_t *y, int64_t y_stride,
                                                          const int rows_const, const int streamed) {
    const int64_t blocks = k / Q4_BLOCK;
    __m512 acc[Q4_ROWS][2];
    const uint8_t *ar[Q4_ROWS];
    const float *er[Q4_ROWS];
    for (int r = 0; r < rows_const; ++r) {
        int64_t row = r < rows ? r : 0;   /* padding rows repeat row 0 */
        ar[r] = a + row * k, er[r] = e + row * blocks;
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *wb = w + b * Q8_BYTES;
        /* a weight read from memory every call (kernels.py: a large head): far ahead, into L2; one the caches
           hold: near, into L1 (far prefetches then only cost) */
        for (int line = 0; line < Q8_BYTES; line += 64) {
            if (streamed) _mm_prefetch((const char *)(wb + 8 * Q8_BYTES + line), _MM_HINT_T1);
            else _mm_prefetch((const char *)(wb + 4 * Q8_BYTES + line), _MM_HINT_T0);
        }
        /* two partial sums a lane (even and odd vectors): integers, so exact in any order, and a short
           chain where few rows leave the dot products waiting on each other */
        __m512i sum[Q4_ROWS][2], odd[Q4_ROWS][2];
        for (int r = 0; r < rows_const; ++r)
            sum[r][0] = sum[r][1] = odd[r][0] = odd[r][1] = _mm512_setzero_si512();
        for (int v = 0; v < 8; v += 2) {
            __m512i q0 = _mm512_loadu_si512((const void *)(wb + v * 64));
            __m512i q1 = _mm512_loadu_si512((const void *)(wb + (8 + v) * 64));
            __m512i p0 = _mm512_loadu_si512((const void *)(wb + (v + 1) * 64));
            __m512i p1 = _mm512_loadu_si512((const void *)(wb + (9 + v) * 64));
            for (int r = 0; r < rows_const; ++r) {
                __m512i x = _mm512_set1_epi32(*(const int32_t *)(ar[r] + b * Q4_BLOCK + 4 * v));
                __m512i z = _mm512_set1_epi32(*(const int32_t *)(ar[r] + b * Q4_BLOCK + 4 * v + 4));
                sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], x, q0);
                sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], x, q1);
                odd[r][0] = _mm512_dpbusd_epi32(odd[r][0], z, p0);
                odd[r][1] = _mm512_dpbusd_epi32(odd[r][1], z, p1);
            }
        }
        for (int r = 0; r < rows_const; ++r)
            for (int c = 0; c < 2; ++c) sum[r][c] = _mm512_add_epi32(sum[r][c], odd[r][c]);
        __m512 d[2];
        __m512i offset[2];
        for (int c = 0; c < 2; ++c) {
            d[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + 1024 + c * 32)));
            offset[c] = _mm512_loadu_si512((const void *)(wb + 1088 + c * 64));
        }
        for (int r = 0; r < rows_const; ++r) {
            __m512 er_b = _mm512_set1_ps(er[r][b]);
            for (int c = 0; c < 2; ++c)
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum[r][c], offset[c])),
                                            _mm512_mul_ps(d[c], er_b), acc[r][c]);
        }
    }
    store_tile(acc, rows, rows_const, y, y_stride);
}

/* x [rows, k] bf16 (row stride x_stride) times Q8_0 blocks laid out as above -> y [rows, n] bf16;
   n % 32 == 0, k % 32 == 0. streamed: the prefetch for a weight the caches cannot hold (q8_tile). */
static inline __attribute__((always_inline)) void q8_product(const uint16_t *x, int64_t rows, int64_t x_stride,
                                                             const uint8_t *w, int64_t n, int64_t k, uint16_t *y,
                                                             int64_t y_stride, int threads, const int streamed) {
    const int64_t groups = n / Q4_GROUP, blocks = k / Q4_BLOCK;
    Quantized q = quantized_rows(x, rows, x_stride, k);
    const float *e = q.e;
    for (int64_t i = 0; i < rows * k; ++i) q.a[i] = (int8_t)((uint8_t)q.a[i] ^ 0x80);   /* a + 128, unsigned */
    const uint8_t *u = (const uint8_t *)q.a;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *wg = w + g * blocks * Q8_BYTES;
        for (int64_t r = 0; r < rows; r += Q4_ROWS) {
            int64_t left = rows - r < Q4_ROWS ? rows - r : Q4_ROWS;
            const uint8_t *at = u + r * k;
            const float *et = e + r * blocks;
            uint16_t *yt = y + r * y_stride + g * Q4_GROUP;
            switch (left) {
                case 1: q8_tile(at, et, k, left, wg, yt, y_stride, 1, streamed); break;
                case 2: q8_tile(at, et, k, left, wg, yt, y_stride, 2, streamed); break;
                case 3: q8_tile(at, et, k, left, wg, yt, y_stride, 3, streamed); break;
                default: q8_tile(at, et, k, left, wg, yt, y_stride, Q4_ROWS, streamed);
            }
        }
    }
    free(q.e);
}

void row_matmul_q8(const uint16_t *x, int64_t rows, int64_t x_stride, const uint8_t *w, int64_t n, int64_t k,
                   uint16_t *y, int64_t y_stride, int threads) {
    q8_product(x, rows, x_stride, w, n, k, y, y_stride, threads, 0);
}

void row_matmul_q8_streamed(const uint16_t *x, int64_t rows, int64_t x_stride, const uint8_t *w, int64_t n,
                            int64_t k, uint16_t *y, int64_t y_stride, int threads) {
    q8_product(x, rows, x_stride, w, n, k, y, y_stride, threads, 1);
}

#else

int row_q4_available(void) { return 0; }

void row_matmul_q8(const uint16_t *x, int64_t rows, int64_t x_stride, const uint8_t *w, int64_t n, int64_t k,
                   uint16_t *y, int64_t y_stride, int threads) {
    (void)x; (void)rows; (void)x_stride; (void)w; (void)n; (void)k; (void)y; (void)y_stride; (void)threads;
}

void row_matmul_q8_streamed(const uint16_t *x, int64_t rows, int64_t x_stride, const uint8_t *w, int64_t n,
                            int64_t k, uint16_t *y, int64_t y_stride, int threads) {
    (void)x; (void)rows; (void)x_stride; (void)w; (void)n; (void)k; (void)y; (void)y_stride; (void)threads;
}

void row_q4_quantize(const uint16_t *x, int64_t rows, int64_t x_stride, int64_t k, int8_t *a, float *e, float *t) {
    (void)x; (void)rows; (void)x_stride; (void)k; (void)a; (void)e; (void)t;
}

void row_matmul_q4(const uint16_t *x, int64_t rows, int64_t x_stride, const uint8_t *w, int64_t n, int64_t k,
                   uint16_t *y, int64_t y_stride, int threads) {
    (void)x; (void)rows; (void)x_stride; (void)w; (void)n; (void)k; (void)y; (void)y_stride; (void)threads;
}

#endif

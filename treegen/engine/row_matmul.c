/* A row-invariant bf16 matrix product for the CPU verify forward (treegen/engine/kernels.py builds and loads it).

   y[r, n] = sum_k x[r, k] * W[n, k], W laid out once as [N/16][K/2][16][2] bf16: one 64-byte load holds two k
   of sixteen outputs, which AVX512-BF16's dot-product instruction multiplies by a broadcast pair of x and adds
   to sixteen fp32 accumulators. Every output is one accumulator that walks k in order, so a row's bits do not
   depend on how many rows the call carries, nor on the thread count (threads split the outputs, not k). */
#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

int row_matmul_available(void) { return 1; }

#define BLOCKS 4   /* 16-output blocks a register tile holds */
#define ROWS 6     /* rows a register tile holds (24 accumulators, 4 weight vectors, 1 broadcast) */

/* One tile: `rows` (1 to ROWS) rows of x against BLOCKS output blocks starting at block b. */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t x_stride, int64_t rows,
                                                       const uint16_t *w, int64_t pairs, int64_t b,
                                                       uint16_t *y, int64_t y_stride, const int rows_const) {
    __m512 acc[ROWS][BLOCKS];
    const uint32_t *xr[ROWS];
    for (int r = 0; r < rows_const; ++r) {
        xr[r] = (const uint32_t *)(x + (r < rows ? r : 0) * x_stride);   /* padding rows repeat row 0 */
        for (int c = 0; c < BLOCKS; ++c) acc[r][c] = _mm512_setzero_ps();
    }
    const uint16_t *wb[BLOCKS];
    for (int c = 0; c < BLOCKS; ++c) wb[c] = w + (b + c) * pairs * 32;
    for (int64_t p = 0; p < pairs; ++p) {
        __m512i wv[BLOCKS];
        for (int c = 0; c < BLOCKS; ++c) wv[c] = _mm512_loadu_si512((const void *)(wb[c] + p * 32));
        for (int r = 0; r < rows_const; ++r) {
            __m512i xv = _mm512_set1_epi32((int)xr[r][p]);
            for (int c = 0; c < BLOCKS; ++c)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv, (__m512bh)wv[c]);
        }
    }
    for (int r = 0; r < rows_const && r < rows; ++r)
        for (int c = 0; c < BLOCKS; ++c)
            _mm256_storeu_si256((__m256i *)(y + r * y_stride + (b + c) * 16), (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
}

/* x [rows, K] (row stride x_stride), w packed as above, y [rows, N] (row stride y_stride); N % 64 == 0,
   K % 2 == 0. */
void row_matmul_bf16(const uint16_t *x, int64_t rows, int64_t x_stride, const uint16_t *w, int64_t n, int64_t k,
                     uint16_t *y, int64_t y_stride, int threads) {
    int64_t pairs = k / 2, groups = n / (16 * BLOCKS);
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t g = 0; g < groups; ++g) {
        for (int64_t r = 0; r < rows; r += ROWS) {
            /* the rest in ONE tile of its own row count, so a small tree's rows read each weight once; every
               output is still one accumulator whatever tile computes it */
            int64_t left = rows - r < ROWS ? rows - r : ROWS;
            const uint16_t *xt = x + r * x_stride;
            uint16_t *yt = y + r * y_stride;
            switch (left) {   /* a constant row count per call: the tile's loops unroll into registers */
                case 1: tile(xt, x_stride, 1, w, pairs, g * BLOCKS, yt, y_stride, 1); break;
                case 2: tile(xt, x_stride, 2, w, pairs, g * BLOCKS, yt, y_stride, 2); break;
                case 3: tile(xt, x_stride, 3, w, pairs, g * BLOCKS, yt, y_stride, 3); break;
                case 4: tile(xt, x_stride, 4, w, pairs, g * BLOCKS, yt, y_stride, 4); break;
                case 5: tile(xt, x_stride, 5, w, pairs, g * BLOCKS, yt, y_stride, 5); break;
                default: tile(xt, x_stride, ROWS, w, pairs, g * BLOCKS, yt, y_stride, ROWS);
            }
        }
    }
}

#else

int row_matmul_available(void) { return 0; }

void row_matmul_bf16(const uint16_t *x, int64_t rows, int64_t x_stride, const uint16_t *w, int64_t n, int64_t k,
                     uint16_t *y, int64_t y_stride, int threads) {
    (void)x; (void)rows; (void)x_stride; (void)w; (void)n; (void)k; (void)y; (void)y_stride; (void)threads;
}

#endif

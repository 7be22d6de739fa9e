/* A row-invariant product with weight-only int8 weights for the CPU (treegen/engine/kernels.py builds and loads it).

   y[r, n] = scale[n] * sum_k x[r, k] * Q[n, k], Q int8 laid out once as [N/32][K][32]: the k-th weights of 32
   outputs side by side (one stream through memory), each eight widened to fp32 and multiplied by a broadcast
   x[r, k] into eight accumulators.
   Every output is one accumulator lane that walks k in order, so a row's bits do not depend on how many rows
   the call carries, nor on the thread count (threads split the outputs, not k). A token reads a quarter of
   the bytes an fp32 weight takes. Three builds of the same sums: AVX512F (16 outputs a register), AVX2+FMA
   (8), plain C. */
#include <stdint.h>

#define BLOCKS 4   /* 8-output blocks a register tile holds: a group of 32 outputs */
#define ROWS 3     /* rows a register tile holds (12 accumulators, 3 broadcasts, 1 weight vector) */
#define PREFETCH 512   /* bytes ahead of the weight stream a tile asks the cache for */

#if defined(__AVX512F__)
#include <immintrin.h>

/* The same sums 16 outputs a register: each output lane still one fp32 FMA chain over k in order, so a row's
   bits equal the AVX2 path's; wider registers hold more rows a tile, so a tree's rows widen each weight once. */
#define ROWS16 8   /* rows a tile holds: 16 accumulators, 2 weight vectors, broadcasts from memory */

int row_int8_vectorized(void) { return 2; }

static inline __attribute__((always_inline)) __m512 widen16(const int8_t *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}

static inline __attribute__((always_inline)) void tile16(const float *x, int64_t x_stride, int64_t rows,
                                                         const int8_t *q, int64_t k, int64_t g, const float *scale,
                                                         float *y, int64_t y_stride, const int rows_const) {
    __m512 acc[ROWS16][2];
    const float *xr[ROWS16];
    for (int r = 0; r < rows_const; ++r) {
        xr[r] = x + (r < rows ? r : 0) * x_stride;   /* padding rows repeat row 0 */
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    }
    const int8_t *qg = q + g * k * 32;
    for (int64_t i = 0; i < k; ++i) {
        if (!(i & 1)) _mm_prefetch((const char *)(qg + i * 32) + PREFETCH, _MM_HINT_T0);
        __m512 lo = widen16(qg + i * 32), hi = widen16(qg + i * 32 + 16);
        for (int r = 0; r < rows_const; ++r) {
            __m512 xv = _mm512_set1_ps(xr[r][i]);
            acc[r][0] = _mm512_fmadd_ps(lo, xv, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(hi, xv, acc[r][1]);
        }
    }
    __m512 s0 = _mm512_loadu_ps(scale + g * 32), s1 = _mm512_loadu_ps(scale + g * 32 + 16);
    for (int r = 0; r < rows_const && r < rows; ++r) {
        _mm512_storeu_ps(y + r * y_stride + g * 32, _mm512_mul_ps(acc[r][0], s0));
        _mm512_storeu_ps(y + r * y_stride + g * 32 + 16, _mm512_mul_ps(acc[r][1], s1));
    }
}

#define TILE16(ROWS_CONST) tile16(xt, x_stride, left, q, k, g, scale, yt, y_stride, ROWS_CONST)

void row_int8_f32(const float *x, int64_t rows, int64_t x_stride, const int8_t *q, const float *scale, int64_t n,
                  int64_t k, float *y, int64_t y_stride, int threads) {
    int64_t groups = n / 32;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t g = 0; g < groups; ++g) {
        for (int64_t r = 0; r < rows; r += ROWS16) {
            int64_t left = rows - r < ROWS16 ? rows - r : ROWS16;
            const float *xt = x + r * x_stride;
            float *yt = y + r * y_stride;
            switch (left) {   /* a constant row count per call: the tile's loops unroll into registers */
                case 1: TILE16(1); break;
                case 2: TILE16(2); break;
                case 3: TILE16(3); break;
                case 4: TILE16(4); break;
                case 5: TILE16(5); break;
                case 6: TILE16(6); break;
                case 7: TILE16(7); break;
                default: TILE16(ROWS16);
            }
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int row_int8_vectorized(void) { return 1; }

static inline __attribute__((always_inline)) __m256 widen(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

/* `rows` (<= ROWS) rows of x against the 32 outputs of group g. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, int64_t rows,
                                                       const int8_t *q, int64_t k, int64_t g, const float *scale,
                                                       float *y, int64_t y_stride, const int rows_const) {
    __m256 acc[ROWS][BLOCKS];
    const float *xr[ROWS];
    for (int r = 0; r < rows_const; ++r) {
        xr[r] = x + (r < rows ? r : 0) * x_stride;   /* padding rows repeat row 0 */
        for (int c = 0; c < BLOCKS; ++c) acc[r][c] = _mm256_setzero_ps();
    }
    const int8_t *qg = q + g * k * 8 * BLOCKS;
    for (int64_t i = 0; i < k; ++i) {
        if (!(i & 1)) _mm_prefetch((const char *)(qg + i * BLOCKS * 8) + PREFETCH, _MM_HINT_T0);
        __m256 xv[ROWS];
        for (int r = 0; r < rows_const; ++r) xv[r] = _mm256_broadcast_ss(xr[r] + i);
        for (int c = 0; c < BLOCKS; ++c) {
            __m256 wv = widen(qg + (i * BLOCKS + c) * 8);
            for (int r = 0; r < rows_const; ++r) acc[r][c] = _mm256_fmadd_ps(wv, xv[r], acc[r][c]);
        }
    }
    for (int c = 0; c < BLOCKS; ++c) {
        __m256 s = _mm256_loadu_ps(scale + (g * BLOCKS + c) * 8);
        for (int r = 0; r < rows_const && r < rows; ++r)
            _mm256_storeu_ps(y + r * y_stride + (g * BLOCKS + c) * 8, _mm256_mul_ps(acc[r][c], s));
    }
}

/* x [rows, K] fp32 (row stride x_stride), q packed as above, scale [N], y [rows, N] fp32 (row stride
   y_stride); N % 32 == 0. */
void row_int8_f32(const float *x, int64_t rows, int64_t x_stride, const int8_t *q, const float *scale, int64_t n,
                  int64_t k, float *y, int64_t y_stride, int threads) {
    int64_t groups = n / (8 * BLOCKS);
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t g = 0; g < groups; ++g) {
        for (int64_t r = 0; r < rows; r += ROWS) {
            int64_t left = rows - r < ROWS ? rows - r : ROWS;
            const float *xt = x + r * x_stride;
            float *yt = y + r * y_stride;
            if (left == 1) tile(xt, x_stride, left, q, k, g, scale, yt, y_stride, 1);
            else if (left == 2) tile(xt, x_stride, left, q, k, g, scale, yt, y_stride, 2);
            else tile(xt, x_stride, left, q, k, g, scale, yt, y_stride, ROWS);
        }
    }
}

#else

int row_int8_vectorized(void) { return 0; }

/* The same sums without vector instructions: each output one accumulator over k in order. */
void row_int8_f32(const float *x, int64_t rows, int64_t x_stride, const int8_t *q, const float *scale, int64_t n,
                  int64_t k, float *y, int64_t y_stride, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t o = 0; o < n; ++o) {
        const int8_t *w = q + (o / 32) * k * 32 + o % 32;
        for (int64_t r = 0; r < rows; ++r) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; ++i) acc += (float)w[i * 32] * x[r * x_stride + i];
            y[r * y_stride + o] = acc * scale[o];
        }
    }
}

#endif

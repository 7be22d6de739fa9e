/* Row-invariant attention for the CPU verify forward (treegen/engine/kernels.py builds and loads it).

   Each job reads only its own row's query and that row's key sequence (the committed positions, then its
   ancestors and itself, in order) and sums in a fixed order. No job reads another row's data, so a row's bits
   depend neither on how many rows the forward carries nor on the thread count. Two forms, chosen by dtype
   and shape only (never by the row count): bf16 on AVX512-BF16 with groups of 1-4 query heads per key/value
   head and 64 or 128 dims (one job per (row, key/value head)), else the general one (one job per (row, head):
   16 interleaved lanes, then the lanes by a fixed tree). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "row_common.h"

#define MAX_DIM 512

/* e^x for x <= 0: 2^(x log2 e) split into 2^k * 2^r, 2^r by its Taylor series to degree 7 (relative error
   below 2e-6); plain arithmetic, so the compiler vectorizes it and every lane gives the same bits. */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) return 0.0f;
    float t = x * 1.44269504088896341f;
    float k = floorf(t);
    float r = t - k;
    float p = 1.52527338e-5f;
    p = p * r + 1.54035304e-4f;
    p = p * r + 1.33335581e-3f;
    p = p * r + 9.61812911e-3f;
    p = p * r + 5.55041087e-2f;
    p = p * r + 2.40226507e-1f;
    p = p * r + 6.93147181e-1f;
    p = p * r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#define DEFINE_ATTEND(NAME, T, LOAD)                                                                         \
void NAME(const T *q, const T *k, const T *v, int64_t heads, int64_t kv_heads, int64_t rows, int64_t dim,     \
          int64_t q_head_stride, int64_t q_row_stride, int64_t kv_head_stride, int64_t kv_pos_stride,         \
          int64_t past, const int64_t *own, const int64_t *count, int64_t width, float scale, float *out,      \
          int threads) {                                                                                      \
    int64_t groups = heads / kv_heads, longest = 0;                                                           \
    for (int64_t i = 0; i < rows; ++i) longest = count[i] > longest ? count[i] : longest;                    \
    longest += past + LANES;                                                                                  \
    _Pragma("omp parallel num_threads(threads)")                                                             \
    {                                                                                                         \
        float *score = malloc(sizeof(float) * longest);                                                       \
        float query[MAX_DIM], acc[MAX_DIM], lanes[LANES];                                                     \
        _Pragma("omp for schedule(static)")                                                                  \
        for (int64_t job = 0; job < heads * rows; ++job) {                                                    \
            int64_t h = job / rows, i = job % rows, g = h / groups;                                           \
            const T *qi = q + h * q_head_stride + i * q_row_stride;                                           \
            const T *kg = k + g * kv_head_stride, *vg = v + g * kv_head_stride;                               \
            int64_t length = past + count[i];                                                                 \
            for (int64_t d = 0; d < dim; ++d) query[d] = LOAD(qi[d]) * scale;                                 \
            float top = -INFINITY;                                                                            \
            for (int64_t j = 0; j < length; ++j) {                                                            \
                int64_t pos = j < past ? j : past + own[i * width + (j - past)];                              \
                const T *kj = kg + pos * kv_pos_stride;                                                       \
                for (int l = 0; l < LANES; ++l) lanes[l] = 0.0f;                                              \
                for (int64_t d = 0; d < dim; d += LANES)                                                      \
                    for (int l = 0; l < LANES; ++l) lanes[l] += query[d + l] * LOAD(kj[d + l]);               \
                score[j] = lane_tree(lanes);                                                                   \
                top = score[j] > top ? score[j] : top;                                                        \
            }                                                                                                 \
            for (int64_t j = 0; j < length; ++j) score[j] = exp_nonpositive(score[j] - top);                  \
            for (int l = 0; l < LANES; ++l) lanes[l] = 0.0f;                                                  \
            int64_t j = 0;                                                                                    \
            for (; j + LANES <= length; j += LANES)                                                           \
                for (int l = 0; l < LANES; ++l) lanes[l] += score[j + l];                                     \
            for (int l = 0; j < length; ++j, ++l) lanes[l] += score[j];                                       \
            float total = lane_tree(lanes);                                                                    \
            for (int64_t d = 0; d < dim; ++d) acc[d] = 0.0f;                                                  \
            for (j = 0; j < length; ++j) {                                                                    \
                int64_t pos = j < past ? j : past + own[i * width + (j - past)];                              \
                const T *vj = vg + pos * kv_pos_stride;                                                       \
                float p = score[j];                                                                           \
                for (int64_t d = 0; d < dim; ++d) acc[d] += p * LOAD(vj[d]);                                  \
            }                                                                                                 \
            float *o = out + (i * heads + h) * dim;                                                           \
            for (int64_t d = 0; d < dim; ++d) o[d] = acc[d] / total;                                          \
        }                                                                                                     \
        free(score);                                                                                          \
    }                                                                                                         \
}

#define LOAD_F32(x) (x)
DEFINE_ATTEND(attend_f32, float, LOAD_F32)
DEFINE_ATTEND(attend_bf16_lanes, uint16_t, from_bf16)

/* bf16 on AVX512-BF16: one job per (row, key/value head) serves that head's whole query group, so each key and
   value is loaded once for the group. A score is one dot-product instruction per 32 dims (pairs of products
   into 16 fp32 lanes), its lanes summed by a fixed tree (lane l with l+8, then l+4, l+2, l+1) that 16 keys
   share; the weighted values sum key by key in fp32. Same order for every key and row: row-invariant. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define MAX_GROUP 4

/* e^x lane by lane for x <= 0, as exp_nonpositive: 2^k by scalef, 2^r by the same polynomial. */
static inline __m512 exp16(__m512 x) {
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(t, k);
    __m512 p = _mm512_set1_ps(1.52527338e-5f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.54035304e-4f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.33335581e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.61812911e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.55041087e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.40226507e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.93147181e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, k));
}

/* Sixteen vectors' lane sums as one vector (lane j: v[j]'s sum): lanes paired (l, l+8), (l, l+4), (l, l+2),
   (l, l+1), the same tree for every vector, then one permutation back to key order. */
static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int m = 0; m < 8; ++m)
        a[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0xEE));
    for (int m = 0; m < 4; ++m)
        b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xDD));
    for (int m = 0; m < 2; ++m)
        c[m] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * m], b[2 * m + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * m], b[2 * m + 1], 0xEE));
    __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, d);   /* lane 4c + t held vector c + 4t */
}

static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* One (row, key/value head) job for G query heads of C * 32 dims; score holds G * padded floats. */
static inline __attribute__((always_inline)) void group_job(
        const int G, const int C, const uint16_t *q, int64_t q_head_stride, const uint16_t *kg, const uint16_t *vg,
        int64_t kv_pos_stride, int64_t past, const int64_t *own, int64_t length, float scale, float *score,
        int64_t padded, float *out) {
    __m512i qz[MAX_GROUP][4];
    for (int h = 0; h < G; ++h)
        for (int c = 0; c < C; ++c) qz[h][c] = _mm512_loadu_si512((const void *)(q + h * q_head_stride + 32 * c));
    __m512 part[MAX_GROUP][16];
    for (int64_t b = 0; b < length; b += 16) {
        for (int kk = 0; kk < 16; ++kk) {
            int64_t j = b + kk;
            if (j >= length) {
                for (int h = 0; h < G; ++h) part[h][kk] = _mm512_setzero_ps();
                continue;
            }
            const uint16_t *kp = kg + (j < past ? j : past + own[j - past]) * kv_pos_stride;
            __m512i kz[4];
            for (int c = 0; c < C; ++c) kz[c] = _mm512_loadu_si512((const void *)(kp + 32 * c));
            for (int h = 0; h < G; ++h) {
                __m512 acc = _mm512_setzero_ps();
                for (int c = 0; c < C; ++c) acc = _mm512_dpbf16_ps(acc, (__m512bh)qz[h][c], (__m512bh)kz[c]);
                part[h][kk] = acc;
            }
        }
        for (int h = 0; h < G; ++h)
            _mm512_storeu_ps(score + h * padded + b, _mm512_mul_ps(sum16(part[h]), _mm512_set1_ps(scale)));
    }
    float total[MAX_GROUP];
    for (int h = 0; h < G; ++h) {
        float *s = score + h * padded;
        for (int64_t j = length; j < padded; ++j) s[j] = -INFINITY;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t b = 0; b < padded; b += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + b));
        __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top)), sum = _mm512_setzero_ps();
        for (int64_t b = 0; b < padded; b += 16) {
            __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + b), m));
            _mm512_storeu_ps(s + b, e);
            sum = _mm512_add_ps(sum, e);
        }
        float lanes[LANES];
        _mm512_storeu_ps(lanes, sum);
        total[h] = lane_tree(lanes);
    }
    __m512 acc[MAX_GROUP][8];
    for (int h = 0; h < G; ++h)
        for (int c = 0; c < 2 * C; ++c) acc[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < length; ++j) {
        const uint16_t *vp = vg + (j < past ? j : past + own[j - past]) * kv_pos_stride;
        __m512 vz[8];
        for (int c = 0; c < 2 * C; ++c) vz[c] = load_bf16(vp + 16 * c);
        for (int h = 0; h < G; ++h) {
            __m512 p = _mm512_set1_ps(score[h * padded + j]);
            for (int c = 0; c < 2 * C; ++c) acc[h][c] = _mm512_fmadd_ps(p, vz[c], acc[h][c]);
        }
    }
    for (int h = 0; h < G; ++h)
        for (int c = 0; c < 2 * C; ++c)
            _mm512_storeu_ps(out + h * C * 32 + 16 * c, _mm512_div_ps(acc[h][c], _mm512_set1_ps(total[h])));
}

#define GROUP_CASE(G, C) case (G) * 8 + (C): group_job(G, C, qi, q_head_stride, kg, vg, kv_pos_stride, past, \
                                                       own_i, length, scale, score, padded, o); break;

static int fast_shape(int64_t groups, int64_t dim) {
    return groups >= 1 && groups <= 4 && (dim == 64 || dim == 128);
}

void attend_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t heads, int64_t kv_heads,
                 int64_t rows, int64_t dim, int64_t q_head_stride, int64_t q_row_stride, int64_t kv_head_stride,
                 int64_t kv_pos_stride, int64_t past, const int64_t *own, const int64_t *count, int64_t width,
                 float scale, float *out, int threads) {
    int64_t groups = heads / kv_heads, longest = 0;
    if (!fast_shape(groups, dim)) {
        attend_bf16_lanes(q, k, v, heads, kv_heads, rows, dim, q_head_stride, q_row_stride, kv_head_stride,
                          kv_pos_stride, past, own, count, width, scale, out, threads);
        return;
    }
    for (int64_t i = 0; i < rows; ++i) longest = count[i] > longest ? count[i] : longest;
    int64_t padded = (past + longest + 15) / 16 * 16;
    _Pragma("omp parallel num_threads(threads)")
    {
        float *score = malloc(sizeof(float) * groups * padded);
        _Pragma("omp for schedule(static)")
        for (int64_t job = 0; job < kv_heads * rows; ++job) {
            int64_t g = job / rows, i = job % rows, length = past + count[i];
            const uint16_t *qi = q + g * groups * q_head_stride + i * q_row_stride;
            const uint16_t *kg = k + g * kv_head_stride, *vg = v + g * kv_head_stride;
            const int64_t *own_i = own + i * width;
            float *o = out + (i * heads + g * groups) * dim;
            switch (groups * 8 + dim / 32) {
                GROUP_CASE(1, 2) GROUP_CASE(2, 2) GROUP_CASE(3, 2) GROUP_CASE(4, 2)
                GROUP_CASE(1, 4) GROUP_CASE(2, 4) GROUP_CASE(3, 4) GROUP_CASE(4, 4)
            }
        }
        free(score);
    }
}

#else

void attend_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t heads, int64_t kv_heads,
                 int64_t rows, int64_t dim, int64_t q_head_stride, int64_t q_row_stride, int64_t kv_head_stride,
                 int64_t kv_pos_stride, int64_t past, const int64_t *own, const int64_t *count, int64_t width,
                 float scale, float *out, int threads) {
    attend_bf16_lanes(q, k, v, heads, kv_heads, rows, dim, q_head_stride, q_row_stride, kv_head_stride,
                      kv_pos_stride, past, own, count, width, scale, out, threads);
}

#endif

int max_dim(void) { return MAX_DIM; }
int lanes(void) { return LANES; }

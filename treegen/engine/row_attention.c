/* Row-invariant attention for the CPU verify forward (treegen/engine/kernels.py builds and loads it).

   Each (row, head) is one job that reads only its own query and its own key sequence (the committed
   positions, then its ancestors and itself, in order) and sums in a fixed order: 16 interleaved lanes,
   then the lanes by a fixed tree. No job reads another's data, so a row's bits do not depend on how many rows
   the forward carries, nor on the thread count. */
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
DEFINE_ATTEND(attend_bf16, uint16_t, from_bf16)

int max_dim(void) { return MAX_DIM; }
int lanes(void) { return LANES; }

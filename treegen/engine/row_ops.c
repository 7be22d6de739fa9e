/* Row-wise ops of the CPU verify forward in one call each (treegen/engine/kernels.py builds and loads it): the
   RMS norm and the rotary embedding, in place of the eight and seven small torch ops a layer spends on them.
   Each row is computed alone in a fixed order (16 interleaved lanes, then a fixed tree), on one thread: a
   row's bits depend neither on the rows beside it nor on the thread count. Arithmetic follows transformers'
   steps and roundings (the norm in fp32, its result in the model's dtype times the weight; the rotary terms
   each rounded to the dtype), but sums in another order, so a last bit may differ from torch's. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "row_common.h"

/* fp32 -> bf16, rounding to nearest even (as torch's .to(torch.bfloat16)). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_f32(float f) { return f; }
static inline float round_bf16(float f) { return from_bf16(to_bf16(f)); }
static inline float load_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }

/* out[r] = w * T(x[r] * rsqrt(mean(x[r]^2) + eps)); x rows `stride` apart, out contiguous; dim % 16 == 0. */
#define DEFINE_NORM(NAME, T, LOAD, STORE, ROUND)                                                              \
void NAME(const T *x, int64_t rows, int64_t stride, int64_t dim, const T *w, float eps, T *out) {             \
    for (int64_t r = 0; r < rows; ++r) {                                                                       \
        const T *xr = x + r * stride;                                                                          \
        float lanes[LANES] = {0};                                                                              \
        for (int64_t d = 0; d < dim; d += LANES)                                                               \
            for (int l = 0; l < LANES; ++l) { float v = LOAD(xr[d + l]); lanes[l] += v * v; }                  \
        float scale = 1.0f / sqrtf(lane_tree(lanes) / (float)dim + eps);                                       \
        T *o = out + r * dim;                                                                                  \
        for (int64_t d = 0; d < dim; ++d) o[d] = STORE(LOAD(w[d]) * ROUND(LOAD(xr[d]) * scale));               \
    }                                                                                                          \
}

/* x [rows, heads, dim] (rows `stride` apart, heads `dim` apart) rotated in place by its row's cos / sin
   [rows, dim]: x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype. */
#define DEFINE_ROPE(NAME, T, LOAD, STORE, ROUND)                                                              \
void NAME(T *x, int64_t rows, int64_t stride, int64_t heads, int64_t dim, const T *cos, const T *sin) {        \
    int64_t half = dim / 2;                                                                                    \
    float tmp[1024];                                                                                           \
    for (int64_t r = 0; r < rows; ++r)                                                                         \
        for (int64_t h = 0; h < heads; ++h) {                                                                  \
            T *v = x + r * stride + h * dim;                                                                   \
            const T *c = cos + r * dim, *s = sin + r * dim;                                                    \
            for (int64_t d = 0; d < dim; ++d) {                                                                \
                float rotated = d < half ? -LOAD(v[d + half]) : LOAD(v[d - half]);                             \
                tmp[d] = ROUND(ROUND(LOAD(v[d]) * LOAD(c[d])) + ROUND(rotated * LOAD(s[d])));                 \
            }                                                                                                  \
            for (int64_t d = 0; d < dim; ++d) v[d] = STORE(tmp[d]);                                            \
        }                                                                                                      \
}

DEFINE_NORM(rms_norm_f32, float, load_f32, store_f32, round_f32)
DEFINE_NORM(rms_norm_bf16, uint16_t, from_bf16, to_bf16, round_bf16)
DEFINE_ROPE(rope_f32, float, load_f32, store_f32, round_f32)
DEFINE_ROPE(rope_bf16, uint16_t, from_bf16, to_bf16, round_bf16)

/* A KV cache's compaction after a tree round, every buffer in one call: in each buffer [heads][capacity][dim]
   (heads `stride` elements apart, `item` bytes an element), row past + keep[j] moves to past + j. keep is
   ascending, so keep[j] >= j and a forward pass never overwrites a row it has yet to read. */
void compact_rows(char *const *buffers, int64_t count, int64_t heads, int64_t stride, int64_t dim, int64_t item,
                  int64_t past, const int64_t *keep, int64_t kept) {
    const int64_t row = dim * item;
    for (int64_t b = 0; b < count; ++b)
        for (int64_t h = 0; h < heads; ++h) {
            char *base = buffers[b] + (h * stride + past * dim) * item;
            for (int64_t j = 0; j < kept; ++j)
                if (keep[j] != j) memmove(base + j * row, base + keep[j] * row, (size_t)row);
        }
}

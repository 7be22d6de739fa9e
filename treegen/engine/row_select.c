/* Drafting's selections in one call each (treegen/engine/kernels.py builds and loads it, drafters/select.py
   calls it): per row the k largest values, their columns and the row's log-sum-exp (a topk and a logsumexp
   are six torch passes over the row), and the support's logits, the dot products of states with gathered
   weight rows (a row gather and a batched product in torch). Drafts are only ranked by these numbers: a
   round's exactness never depends on their bits, a draft's quality does. Every value is computed in a fixed
   order (16 interleaved lanes, then a fixed tree), so a run repeats itself. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "row_common.h"

/* e^x for x <= 0, one value: the scalar twin of row_common.h's exp_nonpositive16 (the same series, the same
   constants), for the lanes a block of 16 does not fill. */
static inline float exp_nonpositive(float x) {
    float t = (x < -87.0f ? -87.0f : x) * LOG2E;
    float n = floorf(t + 0.5f), f = (t - n) * LN2;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x < -87.0f ? 0.0f : p * scale;
}

/* Entry a ranks below entry b: a smaller value, or an equal value at a higher column. */
static inline int below(float va, int64_t ca, float vb, int64_t cb) { return va < vb || (va == vb && ca > cb); }

/* The k-entry heap (val, col) whose root ranks lowest: entry i replaced by (v, c), sifted down. */
static inline void sift(float *val, int64_t *col, int64_t k, int64_t i, float v, int64_t c) {
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= k) break;
        if (child + 1 < k && below(val[child + 1], col[child + 1], val[child], col[child])) ++child;
        if (!below(val[child], col[child], v, c)) break;
        val[i] = val[child];
        col[i] = col[child];
        i = child;
    }
    val[i] = v;
    col[i] = c;
}

/* x [rows, n] (rows `stride` apart), 1 <= k <= n -> val / col [rows, k]: each row's k largest values, largest
   first (the lower column first among equals), and lse [rows]: log(sum(exp(x))), -inf for a row of -inf. A
   heap of the k best so far; a block of 16 with no value above its lowest is passed over whole (most are). */
void top_k_lse_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t k, float *val,
                   int64_t *col, float *lse) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * stride;
        float *vr = val + r * k;
        int64_t *cr = col + r * k, j;
        for (j = 0; j < k; ++j) {   /* a heap of the first k: each sifted up from the end */
            int64_t i = j;
            while (i > 0 && below(xr[j], j, vr[(i - 1) / 2], cr[(i - 1) / 2])) {
                vr[i] = vr[(i - 1) / 2];
                cr[i] = cr[(i - 1) / 2];
                i = (i - 1) / 2;
            }
            vr[i] = xr[j];
            cr[i] = j;
        }
        /* a later column replaces the root only with a larger value (an equal one ranks below it) */
        for (; j < n && j % LANES; ++j)
            if (xr[j] > vr[0]) sift(vr, cr, k, 0, xr[j], j);
        for (; j + LANES <= n; j += LANES) {
#ifdef __AVX512F__
            unsigned above = _mm512_cmp_ps_mask(_mm512_loadu_ps(xr + j), _mm512_set1_ps(vr[0]), _CMP_GT_OQ);
            for (; above; above &= above - 1) {
                int l = __builtin_ctz(above);
                if (xr[j + l] > vr[0]) sift(vr, cr, k, 0, xr[j + l], j + l);
            }
#else
            for (int l = 0; l < LANES; ++l)
                if (xr[j + l] > vr[0]) sift(vr, cr, k, 0, xr[j + l], j + l);
#endif
        }
        for (; j < n; ++j)
            if (xr[j] > vr[0]) sift(vr, cr, k, 0, xr[j], j);
        for (int64_t end = k - 1; end > 0; --end) {   /* heap sort: the lowest goes last, so best first */
            float v = vr[end];
            int64_t c = cr[end];
            vr[end] = vr[0];
            cr[end] = cr[0];
            sift(vr, cr, end, 0, v, c);
        }
        float best = vr[0];
        if (isinf(best) && best < 0) {
            lse[r] = best;
            continue;
        }
        float lanes[LANES] = {0};
        int64_t d = 0;
#ifdef __AVX512F__
        __m512 acc = _mm512_setzero_ps(), shift = _mm512_set1_ps(best);
        for (; d + LANES <= n; d += LANES)
            acc = _mm512_add_ps(acc, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(xr + d), shift)));
        _mm512_storeu_ps(lanes, acc);
#else
        for (; d + LANES <= n; d += LANES)
            for (int l = 0; l < LANES; ++l) lanes[l] += exp_nonpositive(xr[d + l] - best);
#endif
        for (; d < n; ++d) lanes[d % LANES] += exp_nonpositive(xr[d] - best);
        lse[r] = best + logf(lane_tree(lanes));
    }
}

static inline float load_f32(float x) { return x; }

/* out[g, r, j] = dot(states[g, r], w[idx[g, j]]): states fp32 [groups, m, h] contiguous, w rows `wstride`
   apart, idx [groups, s]; h % 16 == 0 and h <= 4096. A weight row is read once (as fp32) for all m states,
   up to 8 of them side by side (independent sums); groups are split over the threads. */
#define ROWS_AT_ONCE 8
#ifdef __AVX512F__
static inline void dots(const float *x, int64_t h, int64_t rows, const float *row, float *out, int64_t gap) {
    __m512 acc[ROWS_AT_ONCE];
    for (int64_t r = 0; r < ROWS_AT_ONCE; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < h; d += LANES) {
        __m512 w = _mm512_loadu_ps(row + d);
        for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * h + d), w, acc[r]);
    }
    float lanes[LANES];
    for (int64_t r = 0; r < rows; ++r) {
        _mm512_storeu_ps(lanes, acc[r]);
        out[r * gap] = lane_tree(lanes);
    }
}
#else
static inline void dots(const float *x, int64_t h, int64_t rows, const float *row, float *out, int64_t gap) {
    for (int64_t r = 0; r < rows; ++r) {
        float lanes[LANES] = {0};
        for (int64_t d = 0; d < h; d += LANES)
            for (int l = 0; l < LANES; ++l) lanes[l] += x[r * h + d + l] * row[d + l];
        out[r * gap] = lane_tree(lanes);
    }
}
#endif

#define DEFINE_GATHERED(NAME, T, LOAD)                                                                        \
void NAME(const float *states, int64_t groups, int64_t m, int64_t h, const T *w, int64_t wstride,             \
          const int64_t *idx, int64_t s, float *out, int threads) {                                            \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                          \
    for (int64_t g = 0; g < groups; ++g) {                                                                     \
        float row[4096];                                                                                       \
        for (int64_t j = 0; j < s; ++j) {                                                                      \
            const T *wr = w + idx[g * s + j] * wstride;                                                        \
            for (int64_t d = 0; d < h; ++d) row[d] = LOAD(wr[d]);                                              \
            for (int64_t r0 = 0; r0 < m; r0 += ROWS_AT_ONCE)                                                   \
                dots(states + (g * m + r0) * h, h, m - r0 < ROWS_AT_ONCE ? m - r0 : ROWS_AT_ONCE, row,         \
                     out + (g * m + r0) * s + j, s);                                                           \
        }                                                                                                      \
    }                                                                                                          \
}

DEFINE_GATHERED(gathered_dot_f32, float, load_f32)
DEFINE_GATHERED(gathered_dot_bf16, uint16_t, from_bf16)

/* One row's value j as fp32: bf16 (its bits are an fp32's top half) or fp32. */
static inline float value_at(const void *row, int64_t j, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)row)[j]) : ((const float *)row)[j];
}

#ifdef __AVX512F__
static inline __m512 load16(const void *row, int64_t j, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)row + j);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + j));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* x [rows, n] fp32 or bf16 (rows `stride` values apart) -> out [rows]: the first index of each row's largest
   value, a NaN counted largest (the first NaN): NumPy's argmax rule, so plain decoding and every walk pick the
   same token from the same logits. Two passes: the maximum (and whether there is a NaN), then its first index. */
void argmax_rows(const void *x, int64_t rows, int64_t n, int64_t stride, int bf16, int64_t *out) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; ++r) {
        const void *row = (const char *)x + r * stride * size;
        float best = -INFINITY;
        int64_t j = 0, nan = -1;
#ifdef __AVX512F__
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (; j + LANES <= n; j += LANES) {
            __m512 v = load16(row, j, bf16);
            if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) break;   /* a NaN here: the scalar scan finds it */
            top = _mm512_max_ps(top, v);
        }
        best = _mm512_reduce_max_ps(top);
#endif
        for (int64_t i = j; i < n; ++i) {
            float v = value_at(row, i, bf16);
            if (v != v) { nan = i; break; }
            if (v > best) best = v;
        }
        if (nan >= 0) { out[r] = nan; continue; }
        int64_t first = 0;   /* the block of 16 that holds the maximum first, then its lane */
#ifdef __AVX512F__
        while (first + LANES <= n &&
               !_mm512_cmp_ps_mask(load16(row, first, bf16), _mm512_set1_ps(best), _CMP_EQ_OQ))
            first += LANES;
#endif
        while (value_at(row, first, bf16) != best) ++first;   /* best is a value of the row: found before n */
        out[r] = first;
    }
}

/* w [16]: e^(x/t - top) of the row's values j.. (count of them, 16 but at the row's end), and their sum in a
   fixed order: a whole block through the vector series, a short one value by value (row_common.h's twins). */
static inline float block_weights(const void *row, int64_t j, int64_t count, int bf16, float t, float top, float *w) {
#ifdef __AVX512F__
    if (count == LANES) {
        __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_div_ps(load16(row, j, bf16), _mm512_set1_ps(t)),
                                                   _mm512_set1_ps(top)));
        _mm512_storeu_ps(w, e);
        return _mm512_reduce_add_ps(e);
    }
#endif
    float s = 0.0f;
    for (int64_t i = 0; i < count; ++i) s += w[i] = exp_nonpositive(value_at(row, j + i, bf16) / t - top);
    return s;
}

/* x [rows, n] fp32 or bf16 (rows `stride` values apart), t > 0, u [rows] uniforms in [0, 1), blocks [ceil(n /
   16)] scratch -> out [rows]: one draw per row from softmax(x / t), by inverse CDF over the weights e^(x/t -
   max). The running sum is fixed: the blocks of 16 (block_weights' sums) added in fp64 from the first, then the
   chosen block's weights one by one; the first index where it passes u times the total is drawn (where rounding
   passes none, the last weight above 0). A zero weight is never drawn: the sum does not move there. -1
   for a row whose largest x/t is not finite (NaN, +inf, every value -inf), left to the caller's reference
   path; returns how many. */
int64_t sample_rows(const void *x, int64_t rows, int64_t n, int64_t stride, int bf16, float t, const double *u,
                    float *blocks, int64_t *out) {
    const int64_t size = bf16 ? 2 : 4, nb = (n + LANES - 1) / LANES;
    int64_t undecided = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const void *row = (const char *)x + r * stride * size;
        float top = -INFINITY, w[LANES];   /* the largest x, then x / t: division by t > 0 keeps the order */
        int nan = 0;
        int64_t j = 0;
#ifdef __AVX512F__
        __m512 vtop = _mm512_set1_ps(-INFINITY);
        for (; j + LANES <= n; j += LANES) {
            __m512 v = load16(row, j, bf16);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
            vtop = _mm512_max_ps(vtop, v);
        }
        top = _mm512_reduce_max_ps(vtop);
#endif
        for (; j < n; ++j) {
            float v = value_at(row, j, bf16);
            nan |= v != v;
            if (v > top) top = v;
        }
        top /= t;
        if (nan || !isfinite(top)) { out[r] = -1, ++undecided; continue; }
        double total = 0.0, run = 0.0;
        for (int64_t b = 0; b < nb; ++b) {
            blocks[b] = block_weights(row, b * LANES, n - b * LANES < LANES ? n - b * LANES : LANES, bf16, t, top, w);
            total += blocks[b];
        }
        const double target = u[r] * total;
        int64_t b = 0;
        while (b < nb && !(run + blocks[b] > target)) run += blocks[b++];
        const int passed = b < nb;   /* else rounding passed no block: the row's last block with mass */
        if (!passed)
            for (b = nb - 1; b > 0 && !(blocks[b] > 0.0f); --b) {}
        const int64_t count = n - b * LANES < LANES ? n - b * LANES : LANES;
        block_weights(row, b * LANES, count, bf16, t, top, w);
        int64_t pick = -1;
        for (int64_t i = 0; passed && i < count; ++i)
            if ((run += w[i]) > target) { pick = i; break; }
        if (pick < 0)   /* none passed: the block's last weight above 0 */
            for (pick = count - 1; pick > 0 && !(w[pick] > 0.0f); --pick) {}
        out[r] = b * LANES + pick;
    }
    return undecided;
}

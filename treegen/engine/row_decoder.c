/* A whole decoder stack's forward in one call, bf16 on AVX512-BF16 (treegen/engine/fused.py drives it): the
   same compiled steps the per-layer path calls one by one from Python (row_matmul.c's products, row_ops.c's
   norm and rotary embedding, row_attention.c's attention), so a step pays its layers' arithmetic and none
   of the small Python-side calls around it. Every step computes each row alone in a fixed order, so a row's
   bits depend neither on the rows beside it nor on the thread count: plain decoding and a tree's verify
   agree bit for bit.

   Rows: `context` rows (only their keys and values are made and cached: a DFlash drafter's new target
   features) then `rows` query rows (the residual stream). Keys and values go into each layer's cache buffers
   at positions past.., and the query rows attend to the first past + context positions plus their own key
   lists (own / count, offsets from past + context). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "row_attention.c"
#include "row_matmul.c"
#include "row_ops.c"
#include "row_q4.c"

typedef struct {
    const uint16_t *norm1;
    const void *qkv, *o;          /* products laid out by row_matmul_pack (bf16) or engine/q4.py (4-bit blocks) */
    const uint16_t *norm2;
    const void *gate_up, *down;
    const uint16_t *q_norm, *k_norm;                            /* per-head norms (Qwen3), or NULL */
    uint16_t *keys, *values;                                    /* cache buffers [kv_heads][capacity][dim] */
    int64_t kv_stride;                                          /* capacity * dim */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, dim, inter;
    float eps, scale;
    int threads;
    int q4;   /* the products' form: 0 bf16 (row_matmul.c), 1 4-bit blocks (row_q4.c) */
} Shape;

int decoder_available(void) { return row_matmul_available(); }
int decoder_q4_available(void) { return row_matmul_available() && row_q4_available(); }

static void product(const Shape *s, const uint16_t *x, int64_t rows, int64_t x_stride, const void *w, int64_t n,
                    int64_t k, uint16_t *y, int64_t y_stride) {
    if (s->q4) row_matmul_q4(x, rows, x_stride, (const uint8_t *)w, n, k, y, y_stride, s->threads);
    else row_matmul_bf16(x, rows, x_stride, (const uint16_t *)w, n, k, y, y_stride, s->threads);
}

/* A product's outputs from `first` on (first: whole tiles of either layout). */
static const void *outputs_from(const Shape *s, const void *w, int64_t first, int64_t k) {
    if (s->q4) return (const uint8_t *)w + first / Q4_GROUP * (k / Q4_BLOCK) * Q4_BYTES;
    return (const uint16_t *)w + first * k;
}

/* x += y, each sum rounded to bf16 (as torch's bf16 add). */
static void add_rows(uint16_t *x, const uint16_t *y, int64_t count) {
    for (int64_t i = 0; i < count; ++i) x[i] = to_bf16(from_bf16(x[i]) + from_bf16(y[i]));
}

/* act = bf16(silu(gate)) * up, rounded to bf16; a row's gate and up start `stride` values after the last
   row's (a stacked product's rows: [gate | up], gate = up + inter for TreeFlash's head). silu(x) = x * s(x) with
   e = e^-|x| (row_common.h's exp, 16 values an instruction where libm's expf is a call per value):
   s(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below. Each value alone, so neither the row count nor the
   threads (which split the values) move a bit. inter % 16 == 0 (fused.shapes_fit). */
static void silu_mul(const uint16_t *gate, const uint16_t *up, int64_t stride, int64_t rows, int64_t inter,
                     uint16_t *act, int threads) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    const int64_t chunk = 256, chunks = (inter + chunk - 1) / chunk;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t job = 0; job < rows * chunks; ++job) {
        const int64_t r = job / chunks, start = (job % chunks) * chunk;
        const int64_t end = start + chunk < inter ? start + chunk : inter;
        const uint16_t *g = gate + r * stride, *u = up + r * stride;
        for (int64_t i = start; i < end; i += 16) {
            __m512 x = load_bf16(g + i);
            __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
            __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
            __m512 top = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), negative, e);
            __m512 silu = _mm512_mul_ps(x, _mm512_div_ps(top, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            __m512 rounded = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(silu));
            _mm256_storeu_si256((__m256i *)(act + r * inter + i),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(rounded, load_bf16(u + i))));
        }
    }
#else
    (void)gate; (void)up; (void)stride; (void)rows; (void)inter; (void)act; (void)threads;   /* AVX512-BF16 only */
#endif
}

static void norm_heads(uint16_t *x, int64_t rows, int64_t stride, int64_t heads, int64_t dim, const uint16_t *w,
                       float eps) {
    for (int64_t r = 0; r < rows; ++r) rms_norm_bf16(x + r * stride, heads, dim, dim, w, eps, x + r * stride);
}

/* x_in [rows, hidden] -> out [rows, hidden] (after final_norm where given); states, if given, receive x_in then
   each layer's output [layers + 1][rows][hidden] (the last after final_norm). cos / sin [context + rows, dim]. */
void decoder_bf16(const Shape *s, int64_t layers, const Layer *w, const uint16_t *final_norm, int64_t past,
                  int64_t context, const uint16_t *ctx, int64_t rows, const uint16_t *x_in, uint16_t *states,
                  uint16_t *out, const uint16_t *cos, const uint16_t *sin, const int64_t *own,
                  const int64_t *count, int64_t width) {
    const int64_t H = s->hidden, D = s->dim, I = s->inter, q_out = s->heads * D, kv_out = s->kv_heads * D;
    const int64_t qkv_w = q_out + 2 * kv_out, all = context + rows;
    const int threads = s->threads;
    /* the context rows need only k and v: the stacked weight's last 2 * kv_out outputs, when whole tiles */
    const int kv_only = s->q4 ? q_out % Q4_GROUP == 0 && (2 * kv_out) % Q4_GROUP == 0 : (2 * kv_out) % 64 == 0;
    uint16_t *x = malloc(sizeof(uint16_t) * rows * H), *h = malloc(sizeof(uint16_t) * rows * H);
    uint16_t *qkv = malloc(sizeof(uint16_t) * all * qkv_w), *att = malloc(sizeof(uint16_t) * rows * q_out);
    uint16_t *o = malloc(sizeof(uint16_t) * rows * H), *gu = malloc(sizeof(uint16_t) * rows * 2 * I);
    uint16_t *act = malloc(sizeof(uint16_t) * rows * I);
    float *att32 = malloc(sizeof(float) * rows * q_out);
    memcpy(x, x_in, sizeof(uint16_t) * rows * H);
    if (states) memcpy(states, x_in, sizeof(uint16_t) * rows * H);
    for (int64_t l = 0; l < layers; ++l) {
        const Layer *L = w + l;
        uint16_t *qkv_rows = qkv + context * qkv_w;
        rms_norm_bf16(x, rows, H, H, L->norm1, s->eps, h);
        product(s, h, rows, H, L->qkv, qkv_w, H, qkv_rows, qkv_w);
        if (context && kv_only)
            product(s, ctx, context, H, outputs_from(s, L->qkv, q_out, H), 2 * kv_out, H, qkv + q_out, qkv_w);
        else if (context)
            product(s, ctx, context, H, L->qkv, qkv_w, H, qkv, qkv_w);
        if (L->q_norm) norm_heads(qkv_rows, rows, qkv_w, s->heads, D, L->q_norm, s->eps);
        if (L->k_norm) norm_heads(qkv + q_out, all, qkv_w, s->kv_heads, D, L->k_norm, s->eps);
        rope_bf16(qkv_rows, rows, qkv_w, s->heads, D, cos + context * D, sin + context * D);
        rope_bf16(qkv + q_out, all, qkv_w, s->kv_heads, D, cos, sin);
        for (int64_t j = 0; j < all; ++j)
            for (int64_t g = 0; g < s->kv_heads; ++g) {
                const uint16_t *kv = qkv + j * qkv_w + q_out + g * D;
                memcpy(L->keys + g * L->kv_stride + (past + j) * D, kv, sizeof(uint16_t) * D);
                memcpy(L->values + g * L->kv_stride + (past + j) * D, kv + kv_out, sizeof(uint16_t) * D);
            }
        attend_bf16(qkv_rows, L->keys, L->values, s->heads, s->kv_heads, rows, D, D, qkv_w, L->kv_stride, D,
                    past + context, own, count, width, s->scale, att32, threads);
        for (int64_t i = 0; i < rows * q_out; ++i) att[i] = to_bf16(att32[i]);
        product(s, att, rows, q_out, L->o, H, q_out, o, H);
        add_rows(x, o, rows * H);
        rms_norm_bf16(x, rows, H, H, L->norm2, s->eps, h);
        product(s, h, rows, H, L->gate_up, 2 * I, H, gu, 2 * I);
        silu_mul(gu, gu + I, 2 * I, rows, I, act, threads);
        product(s, act, rows, I, L->down, H, I, o, H);
        add_rows(x, o, rows * H);
        if (states) memcpy(states + (l + 1) * rows * H, x, sizeof(uint16_t) * rows * H);
    }
    if (final_norm) rms_norm_bf16(x, rows, H, H, final_norm, s->eps, out);
    else memcpy(out, x, sizeof(uint16_t) * rows * H);
    if (states && final_norm) memcpy(states + layers * rows * H, out, sizeof(uint16_t) * rows * H);
    free(x); free(h); free(qkv); free(att); free(o); free(gu); free(act); free(att32);
}

/* One DFlash drafting pass (drafters/dflash.py): the new context rows' target features [context, fw] through
   fc and the hidden norm (only their keys and values are made and cached), the block [anchor, mask x (rows -
   1)] from the embedding table through the stack and its final norm, then the head over block rows 1..rows-1:
   logits [rows - 1][head_n + extra_n] fp32, the head's rows first (as bf16 values: Q8_0 blocks where head_q8,
   else the stack's form), then `extra` bf16 rows [extra_n, hidden] (a fp32 dot rounded to bf16). Each step is
   the one the per-call path makes, in its order, so both give the same bits but for the extra rows' dot.
   states, if given, receive block rows 1.. before and after the final norm [2][rows - 1][hidden] (a head that
   reads both: TreeFlash's). Products in the stack's form (s->q4). */
void draft_bf16(const Shape *s, int64_t layers, const Layer *w, const uint16_t *final_norm, int64_t past,
                int64_t context, const uint16_t *features, int64_t fw, const void *fc, const uint16_t *hidden_norm,
                const uint16_t *embed, int64_t anchor, int64_t mask_id, int64_t rows, const uint16_t *cos,
                const uint16_t *sin, const int64_t *own, const int64_t *count, int64_t width, const void *head,
                int head_q8, int64_t head_n, const uint16_t *extra, int64_t extra_n, float *logits,
                uint16_t *states) {
    const int64_t H = s->hidden, depth = rows - 1, cols = head_n + extra_n;
    uint16_t *ctx = context ? malloc(sizeof(uint16_t) * context * H) : NULL;
    uint16_t *x = malloc(sizeof(uint16_t) * rows * H), *out = malloc(sizeof(uint16_t) * rows * H);
    if (context) {
        product(s, features, context, fw, fc, H, fw, ctx, H);
        rms_norm_bf16(ctx, context, H, H, hidden_norm, s->eps, ctx);
    }
    memcpy(x, embed + anchor * H, sizeof(uint16_t) * H);
    for (int64_t r = 1; r < rows; ++r) memcpy(x + r * H, embed + mask_id * H, sizeof(uint16_t) * H);
    decoder_bf16(s, layers, w, states ? NULL : final_norm, past, context, ctx, rows, x, NULL, out, cos, sin, own,
                 count, width);
    if (states) {   /* the final norm as the stack applies it, after keeping the rows before it */
        memcpy(states, out + H, sizeof(uint16_t) * depth * H);
        rms_norm_bf16(out, rows, H, H, final_norm, s->eps, out);
        memcpy(states + depth * H, out + H, sizeof(uint16_t) * depth * H);
    }
    if (depth > 0) {
        uint16_t *y = malloc(sizeof(uint16_t) * depth * head_n);
        if (head_q8) row_matmul_q8(out + H, depth, H, (const uint8_t *)head, head_n, H, y, head_n, s->threads);
        else product(s, out + H, depth, H, head, head_n, H, y, head_n);
        for (int64_t r = 0; r < depth; ++r) {
            const uint16_t *state = out + (r + 1) * H;
            for (int64_t j = 0; j < head_n; ++j) logits[r * cols + j] = from_bf16(y[r * head_n + j]);
            for (int64_t j = 0; j < extra_n; ++j) {
                float sum = 0.0f;
                for (int64_t d = 0; d < H; ++d) sum += from_bf16(state[d]) * from_bf16(extra[j * H + d]);
                logits[r * cols + head_n + j] = from_bf16(to_bf16(sum));
            }
        }
        free(y);
    }
    free(ctx); free(x); free(out);
}

/* TreeFlash's head over R rows in one call (drafters/treeflash.py `scored`): row r conditions block depth pos[r]
   on the token prev[r]. x = the token's half of the head's first product (a row of `table` [V, 2I] where given,
   else that half over the token's embedding after the head's norm) + the depth's state half [D, 2I], a bf16 add
   as torch's; act = bf16(silu(x[I:])) * x[:I]; the row's state = final_norm(hidden[pos] + d(act)) (hidden: the
   block's rows 1.. before the final norm, [D, H]); then its logits over the depth's support [D, n_support]:
   the fp32 dot of the state with each support token's lm_head row [V, H], plus outside [D, n_support] (0 or
   -inf; NULL: none). Products in the stack's form (s->q4); each row alone, in a fixed order. */
void treeflash_head_bf16(const Shape *s, int64_t R, const int64_t *pos, const int64_t *prev, const uint16_t *table,
                         const uint16_t *embed, const uint16_t *head_norm, const void *ug_token,
                         const uint16_t *state_half, const void *d, const uint16_t *hidden,
                         const uint16_t *final_norm, const int64_t *support, int64_t n_support,
                         const uint16_t *lm_head, const float *outside, float *logits) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    const int64_t H = s->hidden, I = s->inter, W = 2 * I;
    uint16_t *x = malloc(sizeof(uint16_t) * R * W), *act = malloc(sizeof(uint16_t) * R * I);
    uint16_t *state = malloc(sizeof(uint16_t) * R * H);
    if (table) {
        for (int64_t r = 0; r < R; ++r) memcpy(x + r * W, table + prev[r] * W, sizeof(uint16_t) * W);
    } else {
        uint16_t *e = malloc(sizeof(uint16_t) * R * H);
        for (int64_t r = 0; r < R; ++r) memcpy(e + r * H, embed + prev[r] * H, sizeof(uint16_t) * H);
        rms_norm_bf16(e, R, H, H, head_norm, s->eps, e);
        product(s, e, R, H, ug_token, W, H, x, W);
        free(e);
    }
    for (int64_t r = 0; r < R; ++r) add_rows(x + r * W, state_half + pos[r] * W, W);
    silu_mul(x + I, x, W, R, I, act, s->threads);
    product(s, act, R, I, d, H, I, state, H);
    for (int64_t r = 0; r < R; ++r) add_rows(state + r * H, hidden + pos[r] * H, H);   /* delta + hidden */
    rms_norm_bf16(state, R, H, H, final_norm, s->eps, state);
    _Pragma("omp parallel for schedule(static) num_threads(s->threads)")
    for (int64_t job = 0; job < R * n_support; ++job) {
        const int64_t r = job / n_support, j = job % n_support, at = pos[r] * n_support + j;
        const uint16_t *w = lm_head + support[at] * H, *v = state + r * H;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) acc = _mm512_fmadd_ps(load_bf16(v + i), load_bf16(w + i), acc);
        float lanes[LANES];
        _mm512_storeu_ps(lanes, acc);
        logits[job] = lane_tree(lanes) + (outside ? outside[at] : 0.0f);
    }
    free(x); free(act); free(state);
#else
    (void)s; (void)R; (void)pos; (void)prev; (void)table; (void)embed; (void)head_norm; (void)ug_token;
    (void)state_half; (void)d; (void)hidden; (void)final_norm; (void)support; (void)n_support; (void)lm_head;
    (void)outside; (void)logits;
#endif
}

/* What the compiled row kernels share (treegen/engine/kernels.py hashes it into each build's name). */
#ifndef TREEGEN_ROW_COMMON_H
#define TREEGEN_ROW_COMMON_H
#include <stdint.h>
#include <string.h>

#define LANES 16

static inline float from_bf16(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The lanes added pairwise, halves first: a fixed tree of depth 4, not a chain of 16 (the next sum need not
   wait for this one's). */
static inline float lane_tree(const float *lanes) {
    float half[LANES / 2], quarter[LANES / 4];
    for (int l = 0; l < LANES / 2; ++l) half[l] = lanes[l] + lanes[l + LANES / 2];
    for (int l = 0; l < LANES / 4; ++l) quarter[l] = half[l] + half[l + LANES / 4];
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

/* e^x for x <= 0, 16 at a time (libm's expf is a call per value), relative error below 2e-7: 2^n times a
   degree-6 series of 2^f, f in [-0.5, 0.5]; 0 below -87. */
#define LOG2E 1.44269504088896341f
#define LN2 0.69314718055994531f
#ifdef __AVX512F__
#include <immintrin.h>
static inline __m512 exp_nonpositive16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 live = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    __m512 t = _mm512_mul_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(LOG2E));
    __m512 n = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(LN2));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    const float c[6] = {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(live, _mm512_mul_ps(p, _mm512_castsi512_ps(bits)));
}
#endif

#endif

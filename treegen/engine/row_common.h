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

#endif

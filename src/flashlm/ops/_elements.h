/* Element types of flashlm's C operators: each converted to float as it is read. */
#ifndef FLASHLM_ELEMENTS_H
#define FLASHLM_ELEMENTS_H
#include <stdint.h>

static inline float bf16_to_float(uint16_t v) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)v << 16;
    return x.f;
}
static inline float f16_to_float(_Float16 v) { return (float)v; }
static inline float f32_to_float(float v) { return v; }

#endif

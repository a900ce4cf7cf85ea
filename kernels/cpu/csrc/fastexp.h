/* exp(x) for x <= 0 that the compiler vectorises: 2^n * p(r), r = x - n ln2, |r| <= ln2 / 2, with
 * Cephes' expf polynomial; relative error below 1e-7 on [-87, 0], and exp(-87) below that (fp32
 * underflows there anyway). libm's expf would be a scalar call per element without -ffast-math. */
#ifndef PAGEDKV_FASTEXP_H
#define PAGEDKV_FASTEXP_H
#include <math.h>
#include <stdint.h>

static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* n = round(x / ln2) by the 1.5 * 2^23 trick: floorf() is a libm call unless -ffast-math,
     * which would keep the loop scalar; adding and subtracting the constant vectorises. */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two_n;
    two_n.i = ((int32_t)n + 127) << 23;
    return p * two_n.f;
}
#endif

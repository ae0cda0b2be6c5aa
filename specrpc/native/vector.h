// The 16-lane float vector the native sources share (decode.cpp, bandwidth.cpp, multiply.cpp): one AVX-512 register,
// two AVX2 ones; its load and its fused multiply-add, rounded once and the same on every path.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstring>

typedef float v16 __attribute__((vector_size(64)));  // 16 lanes: one AVX-512 register, two AVX2 ones

static inline v16 load16(const float* p) {
    v16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

static inline v16 fma16(v16 a, v16 b, v16 c) {  // a * b + c, rounded once, the same on every path
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    __m256 a2[2], b2[2], c2[2];
    std::memcpy(a2, &a, sizeof a);
    std::memcpy(b2, &b, sizeof b);
    std::memcpy(c2, &c, sizeof c);
    c2[0] = _mm256_fmadd_ps(a2[0], b2[0], c2[0]);
    c2[1] = _mm256_fmadd_ps(a2[1], b2[1], c2[1]);
    std::memcpy(&c, c2, sizeof c);
    return c;
#else
    for (int i = 0; i < 16; ++i) c[i] = std::fma(a[i], b[i], c[i]);
    return c;
#endif
}

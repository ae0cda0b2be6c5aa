// The 16-lane float vector the native sources share (decode.cpp, bandwidth.cpp, multiply.cpp), the few operations
// on it that depend on how it is held, and AVX2's byte multiply-add (`dot_bytes`). The vector is one AVX-512 register
// (GCC's 64-byte vector type), or, with AVX2 and no AVX-512, a pair of 8-lane registers: GCC keeps a 64-byte vector
// type in memory where the CPU has no 64-byte registers, so every operation on it there goes through the stack (16
// lanes of fused multiply-adds ran 12× below the CPU's rate on an AVX2 EPYC); the pair stays in registers. Both give
// the same bits: every lane is computed on its own, and the horizontal sums use one fixed tree.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)

// 16 lanes as two 8-lane AVX2 registers: lanes 0..7 in lo, 8..15 in hi.
struct v16 {
    __m256 lo, hi;
    float operator[](int i) const {  // lane i
        float lanes[16];
        std::memcpy(lanes, this, sizeof lanes);
        return lanes[i];
    }
};
struct m16 {  // a lane mask (all bits set where true), as a comparison of two v16 gives it
    __m256 lo, hi;
};

static inline v16 operator+(v16 a, v16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline v16 operator-(v16 a, v16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline v16 operator*(v16 a, v16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline v16 operator/(v16 a, v16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
static inline v16 operator-(v16 a) {  // the sign flipped (-0 from +0, as GCC's vector negation)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return {_mm256_xor_ps(a.lo, sign), _mm256_xor_ps(a.hi, sign)};
}
static inline v16& operator+=(v16& a, v16 b) { return a = a + b; }
static inline m16 operator<(v16 a, v16 b) {
    return {_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ)};
}
static inline m16 operator==(v16 a, v16 b) {
    return {_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ)};
}

static inline v16 select16(m16 m, v16 a, v16 b) {  // a where m, else b (GCC's vector `m ? a : b`)
    return {_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi)};
}

static inline v16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }

static inline v16 splat(float x) {  // x in every lane
    const __m256 v = _mm256_set1_ps(x);
    return {v, v};
}

static inline v16 fma16(v16 a, v16 b, v16 c) {  // a * b + c, rounded once, the same on every path
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

static inline v16 vmax16(v16 a, v16 b) {  // a > b ? a : b lane by lane (b where either is NaN, as MAXPS)
    return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
}

static inline v16 widen16(__m128i q) {  // 16 int8 values as floats (exact)
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
}

// acc + the sums of 4 neighbouring byte products a lane: |w| (unsigned bytes) × x with w's sign, = w x. vpmaddubsw
// multiplies unsigned by signed bytes and adds neighbours into 16 bits with saturation, which the weights' offset
// form (w + 128, up to 255, × up to 127) would overflow; with |w| at most 128 and |x| at most 127 each pair stays
// under 2^15, exact; vpmaddwd by ones adds the pairs into 32 bits. The int8 products' multiply-add on AVX2, as
// vpdpbusd is VNNI's (decode.cpp's products; multiply.cpp times it).
static inline __m256i dot_bytes(__m256i acc, __m256i w_abs, __m256i x, __m256i w) {
    const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// AVX2 CPUs with AVX-VNNI (Intel's since Alder Lake, without AVX-512) multiply int8 products with vpdpbusd on 8-lane
// registers (`dpbusd8`), one instruction where `dot_bytes` takes three. SPECRPC_AVXVNNI_EMULATE: that instruction as
// AVX2 code with its documented semantics, for tests of the path on CPUs without AVX-VNNI (slower, never for serving).
#if defined(__AVXVNNI__) || defined(SPECRPC_AVXVNNI_EMULATE)
#define SPECRPC_AVX_VNNI 1

// acc + the sums of 4 neighbouring byte products a lane, unsigned u × signed s, exact (no saturation): vpdpbusd.
static inline __m256i dpbusd8(__m256i acc, __m256i u, __m256i s) {
#if defined(SPECRPC_AVXVNNI_EMULATE)
    // bytes 0, 2 and 1, 3 of each lane widened to 16 bits: each product fits (|255 × -128| < 2^15), vpmaddwd adds
    // a lane's two of each into 32 bits
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi16(0x00FF);
    const __m256i even = _mm256_mullo_epi16(_mm256_and_si256(u, low), _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8));
    const __m256i odd = _mm256_mullo_epi16(_mm256_srli_epi16(u, 8), _mm256_srai_epi16(s, 8));
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(even, ones), _mm256_madd_epi16(odd, ones)));
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#else
#define SPECRPC_AVX_VNNI 0
#endif

static inline v16 exp2i16(v16 n) {  // 2^n lane by lane for whole numbers n in -126 .. 127
    const __m256i one = _mm256_set1_epi32(127);
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n.lo), one), 23)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n.hi), one), 23))};
}

// The reductions below add each vector's lanes in one fixed tree, T(x) = (((x0+x8)+(x4+x12))+((x2+x10)+(x6+x14)))
// + (((x1+x9)+(x5+x13))+((x3+x11)+(x7+x15))): the halves first (lane j + lane j + 8), then j + 4, j + 2, j + 1.

static inline float hsum16(v16 x) {  // T(x)
    __m256 s = _mm256_add_ps(x.lo, x.hi);                     // s_j = x_j + x_{j+8}
    s = _mm256_add_ps(s, _mm256_permute2f128_ps(s, s, 0x01));  // + s_{j^4}
    s = _mm256_add_ps(s, _mm256_permute_ps(s, 0x4E));         // + (j^2)
    s = _mm256_add_ps(s, _mm256_permute_ps(s, 0xB1));         // + (j^1)
    return _mm256_cvtss_f32(s);
}

static inline float hmax16(v16 x) {  // the largest of x's 16 lanes
    __m256 s = _mm256_max_ps(x.lo, x.hi);
    s = _mm256_max_ps(s, _mm256_permute2f128_ps(s, s, 0x01));
    s = _mm256_max_ps(s, _mm256_permute_ps(s, 0x4E));
    s = _mm256_max_ps(s, _mm256_permute_ps(s, 0xB1));
    return _mm256_cvtss_f32(s);
}

// Lane i of the result = T(a[i]). Per vector s_i = lo + hi; pairs of s's are split at 4 lanes (permute2f128) and
// added, then quartets at 2 lanes and octets at 1 (shufflevector within 128-bit lanes), which leaves the sums in the
// order 0 2 4 6 1 3 5 7 of each 8, put back in order by one permutation. Each half of the tree is its own: `reduce8`
// of a[0 .. 7] and of a[8 .. 15], then `join16` (here the two halves side by side), the same operations in either way.
static inline __m256 reduce8(const v16* a) {  // lanes 0..7 of T(a[0]) .. T(a[7]), in the half's order (see join16)
    __m256 s[8], t[4], u[2];
    for (int i = 0; i < 8; ++i) s[i] = _mm256_add_ps(a[i].lo, a[i].hi);
    for (int m = 0; m < 4; ++m)  // [t_{2m} (lanes 0..3), t_{2m+1} (0..3)]: s_j + s_{j+4}
        t[m] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * m], s[2 * m + 1], 0x20),
                             _mm256_permute2f128_ps(s[2 * m], s[2 * m + 1], 0x31));
    for (int m = 0; m < 2; ++m)  // [u_{4m} u_{4m+2} | u_{4m+1} u_{4m+3}], two lanes each: t_j + t_{j+2}
        u[m] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * m], t[2 * m + 1], 0x44),
                             _mm256_shuffle_ps(t[2 * m], t[2 * m + 1], 0xEE));
    // [r_0 r_2 r_4 r_6 | r_1 ...]: u_0 + u_1, put in order
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline v16 join16(__m256 lo, __m256 hi) { return {lo, hi}; }

static inline v16 reduce16(const v16* a) { return join16(reduce8(a), reduce8(a + 8)); }

#else

typedef float v16 __attribute__((vector_size(64)));  // 16 lanes: one AVX-512 register
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef vi16 m16;  // a lane mask, as a comparison of two v16 gives it

static inline v16 select16(m16 m, v16 a, v16 b) { return m ? a : b; }  // a where m, else b

static inline v16 load16(const float* p) {
    v16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

static inline v16 splat(float x) {  // x in every lane
#if defined(__AVX512F__)
    return (v16)_mm512_set1_ps(x);
#else
    v16 v;
    for (int i = 0; i < 16; ++i) v[i] = x;
    return v;
#endif
}

static inline v16 fma16(v16 a, v16 b, v16 c) {  // a * b + c, rounded once, the same on every path
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    for (int i = 0; i < 16; ++i) c[i] = std::fma(a[i], b[i], c[i]);
    return c;
#endif
}

static inline v16 vmax16(v16 a, v16 b) { return a > b ? a : b; }

static inline v16 widen16(__m128i q) {  // 16 int8 values as floats (exact)
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
    v16 v;
    std::memcpy(&v, &f, sizeof v);
    return v;
#else
    int8_t b[16];
    std::memcpy(b, &q, sizeof b);
    v16 v;
    for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(b[i]);
    return v;
#endif
}

static inline v16 exp2i16(v16 n) {  // 2^n lane by lane for whole numbers n in -126 .. 127
    const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
    v16 v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
}

// Lane i of the result = the sum of a[i]'s 16 lanes, in one fixed tree for every i:
// (((0+8)+(4+12))+((2+10)+(6+14)))+(((1+9)+(5+13))+((3+11)+(7+15))).
static inline v16 fold(v16 x, v16 y, vi16 lo, vi16 hi) {  // lanes `lo` of x:y plus lanes `hi`
    return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

// Each half of the tree is its own: `reduce8` of a[0 .. 7] and of a[8 .. 15], then `join16`.
static inline v16 reduce8(const v16* a) {  // 8 vectors of 16 partial sums → one of 8 × 2 (reduce16's third level)
    v16 b[4], c[2];
    for (int m = 0; m < 4; ++m)  // → 4 of 2 × 8
        b[m] = fold(a[2 * m], a[2 * m + 1], vi16{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                    vi16{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int m = 0; m < 2; ++m)  // → 2 of 4 × 4
        c[m] = fold(b[2 * m], b[2 * m + 1], vi16{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                    vi16{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
    return fold(c[0], c[1], vi16{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},  // → 8 × 2
                vi16{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
}

static inline v16 join16(v16 lo, v16 hi) {  // two halves' `reduce8` → 16 sums, in order
    return fold(lo, hi, vi16{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
                vi16{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

static inline v16 reduce16(const v16* a) { return join16(reduce8(a), reduce8(a + 8)); }

// The sum of x's 16 lanes, in reduce16's tree (x plus x with its halves swapped, then quarters, pairs, neighbours).
static inline float hsum16(v16 x) {
    x = x + __builtin_shuffle(x, vi16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x = x + __builtin_shuffle(x, vi16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x = x + __builtin_shuffle(x, vi16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x = x + __builtin_shuffle(x, vi16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return x[0];
}

static inline float hmax16(v16 x) {  // the largest of x's 16 lanes
    x = vmax16(x, __builtin_shuffle(x, vi16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    x = vmax16(x, __builtin_shuffle(x, vi16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
    x = vmax16(x, __builtin_shuffle(x, vi16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
    x = vmax16(x, __builtin_shuffle(x, vi16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
    return x[0];
}

#endif

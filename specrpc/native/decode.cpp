// Forward of a few tokens (a decode step, a verify, a draft's catch-up) through a Llama-family model (RMSNorm, gated
// SiLU MLP, RoPE, GQA, optional biases, Qwen3's q/k norms, sliding windows) in float32, as one OpenMP parallel
// region: the matrix products split their output rows across the threads, everything else runs between them without
// leaving the region. Built and loaded by specrpc/native/__init__.py (ctypes; torch's own OpenMP runtime), called by
// specrpc/models/backends/native.py. Weights are packed in panels of 16 output rows ([N / 16, K, 16], `Weight`); each
// panel is read from memory once per forward and multiplied into every token's outputs as a sum of outer products,
// each output summed over the columns in order: a token's logits are bit for bit the same decoded alone or verified
// among others, so greedy speculation through this step equals greedy decoding through it exactly.
#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "vector.h"

struct Layer {  // projections: float [N, K], or int8 [N, K] with float scales [N] (the *_scale, null for float)
    const float* attn_norm;  // [d]
    const void* qkv;         // [(hq + 2 hkv) dh, d]
    const float* qkv_scale;
    const float* qkv_bias;   // [(hq + 2 hkv) dh] or null
    const float* qk_norm;    // [hq + hkv, dh] or null
    const void* o;           // [d, hq dh]
    const float* o_scale;
    const float* o_bias;     // [d] or null
    const float* mlp_norm;   // [d]
    const void* up;          // [2 ffn, d]: gate rows, then up rows
    const float* up_scale;
    const float* up_bias;    // [2 ffn] or null
    const void* down;        // [d, ffn]
    const float* down_scale;
    const float* down_bias;  // [d] or null
    int64_t window;          // sliding window, 0 = full causal attention
};

struct Model {
    int64_t d, hq, hkv, dh, ffn, vocab, layers;
    int64_t slots, capacity;  // KV cache [L, slots, hkv, capacity, dh]
    int64_t max_tokens;       // tokens per forward the work buffers hold
    int64_t prefetch;         // how the products prefetch their weight panels (`Prefetch`), chosen per model at load
    float eps;
    const float* embed;       // [vocab, d]
    const float* norm;        // [d]
    const void* head;         // [vocab, d], float or int8
    const float* head_scale;  // [vocab] or null
    const float* cos;         // [capacity, dh]
    const float* sin;         // [capacity, dh], sign folded: rope(x) = x cos + roll(x, dh/2) sin
    const Layer* layer;       // [layers]
    float* k_cache;
    float* v_cache;
    float* x;                 // [T, d] work buffers
    float* h;                 // [T, d]
    float* qkv;               // [T, (hq + 2 hkv) dh]
    float* att;               // [T, hq dh]
    float* up;                // [T, 2 ffn]
    float* scores;            // [T, hq, capacity]
    int8_t* xq;               // [T, kq]: a product's activations quantized (`SPECRPC_INT8_DOT` products, `quantize`)
    float* xs;                // [T, kq / 32]: their scales per block of 32 columns
    int32_t* xsum;            // [T, kq / 32]: the sums of their quantized values per block
    int64_t kq;               // the widest product's columns, rounded up to a multiple of 32
    int64_t prefetch_ahead;   // bytes ahead of the column being read that a panel's prefetch asks for (0: 2048)
    int64_t amx_from;         // int8 products of at least this many tokens run on AMX tiles (`gemm_amx`); 0: never
    const int64_t* pass_tokens;  // [max_tokens + 1]: by a product's tokens, the most one pass over its weights takes
                                 // (`tiles`, measured at load); null or 0: the built-in choice
};

// The cap on tokens a pass of a product over T tokens (`Model::pass_tokens`; 0: none).
static inline int64_t pass_cap(const Model* m, int64_t T) {
    return m->pass_tokens == nullptr ? 0 : m->pass_tokens[T < m->max_tokens ? T : m->max_tokens];
}

// How a product prefetches its weight panels, a hint only (the arithmetic and its order are the same in every mode, so
// are the results): NONE leaves it to the hardware prefetchers; NON_TEMPORAL reads the weights past the caches
// (locality 0: a model larger than the last-level cache then does not evict a smaller one's, the draft's, on every
// step; what won on a 2-core AMD EPYC whose 32 MB L3 the target exceeds); TEMPORAL keeps them (locality 3: where
// the last-level cache holds the whole model, as a 260 MB L3 does, non-temporal prefetches make every step read it
// from memory again); OUTER fetches them to the outer caches and not the L1 (locality 2: the L1's few miss buffers
// stay for the loads; a verify of 5 tokens through a 0.5B model's 496 MB of int8 weights on a Zen 4 took 0.78-0.82x
// the time of the best of the others, where the multiplies between the reads leave fewer of them in flight). Which
// is fastest depends on the CPU and the model: specrpc measures them at load.
enum Prefetch : int64_t { NONE = 0, NON_TEMPORAL = 1, TEMPORAL = 2, OUTER = 3 };

template <int PF>
static inline void prefetch(const void* p) {
    if constexpr (PF == NON_TEMPORAL) __builtin_prefetch(p, 0, 0);
    else if constexpr (PF == TEMPORAL) __builtin_prefetch(p, 0, 3);
    else if constexpr (PF == OUTER) __builtin_prefetch(p, 0, 2);
}

static inline int64_t prefetch_ahead(const Model* m) { return m->prefetch_ahead > 0 ? m->prefetch_ahead : 2048; }

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

static inline v16 load16(const int8_t* p) {  // 16 int8 weights as floats (exact), widened in registers
    return widen16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

constexpr int64_t LANES = 16;  // output rows per panel: one 16-lane vector
#if defined(__AVX512F__)
constexpr int REGS = 32;  // 16-lane vectors the registers hold
#else
constexpr int REGS = 8;  // AVX2: two 8-lane registers per vector, 16 of them
#endif

// A projection's weight packed in panels of LANES output rows: [ceil(N / 16), K, 16] float, or int8 with a float scale
// per row [N] (null for float). Panel b holds rows 16 b .. 16 b + 15 column by column, so one column of a panel is
// one vector, and a product is a sum of outer products: no horizontal sums, and every output's sum runs over the
// columns in order whatever the number of tokens or panels taken at once.
struct Weight {
    const void* w;
    const float* scale;
};

// R panels (rows n0 ..) × TT tokens (activation rows x, stride ldx >= cols): acc[r][t] accumulates W[row, k] x[t, k]
// over k = 0 .. cols - 1 in that order, one fused multiply-add each, so a token's outputs are the same bits whatever
// shares the forward with it. Each panel column is loaded once for all TT tokens.
template <int R, int TT, int PF, typename W>
static inline void panels(const W* __restrict w, const float* __restrict scale, const float* __restrict b,
                          const float* __restrict x, int64_t ldx, float* __restrict y, int64_t rows, int64_t cols,
                          int64_t n0, bool add, int64_t ahead) {
    constexpr int64_t every = 64 / (LANES * sizeof(W));  // columns per cache line of a panel
    v16 acc[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = v16{};
    for (int64_t k = 0; k < cols; ++k) {
        v16 wr[R];
        for (int r = 0; r < R; ++r) {
            const W* col = w + (r * cols + k) * LANES;
            if (PF != NONE && k % every == 0) prefetch<PF>(col + ahead / (int64_t)sizeof(W));
            wr[r] = load16(col);
        }
        for (int t = 0; t < TT; ++t) {
            const v16 xb = splat(x[t * ldx + k]);
            for (int r = 0; r < R; ++r) acc[r][t] = fma16(wr[r], xb, acc[r][t]);
        }
    }
    for (int r = 0; r < R; ++r) {
        const int64_t n = n0 + r * LANES, valid = rows - n < LANES ? rows - n : LANES;
        for (int t = 0; t < TT; ++t) {
            float v[LANES];
            std::memcpy(v, &acc[r][t], sizeof v);
            float* out = y + t * rows + n;
            for (int64_t j = 0; j < valid; ++j) {
                const float value = (scale ? v[j] * scale[n + j] : v[j]) + (b ? b[n + j] : 0.0f);
                out[j] = add ? out[j] + value : value;
            }
        }
    }
}

// `panels` for R panels and tt (1..8) tokens, tt chosen at run time.
template <int R, int PF, typename W>
static inline void panels_tt(int64_t tt, const W* w, const float* scale, const float* b, const float* x, int64_t ldx,
                             float* y, int64_t rows, int64_t cols, int64_t n0, bool add, int64_t ahead) {
    switch (tt) {
#define SPECRPC_TT(N) \
    case N: \
        if constexpr (R * N + R <= REGS) panels<R, N, PF>(w, scale, b, x, ldx, y, rows, cols, n0, add, ahead); \
        else __builtin_trap(); /* gemm_rows never asks for more than the registers hold */ \
        return;
        SPECRPC_TT(1) SPECRPC_TT(2) SPECRPC_TT(3) SPECRPC_TT(4) SPECRPC_TT(5) SPECRPC_TT(6) SPECRPC_TT(7) SPECRPC_TT(8)
#undef SPECRPC_TT
    }
}

struct Pass {
    int64_t tokens;  // tokens a pass over the weights takes
    int panels;      // panels computed at a time (R)
};

// `tiles`' pass for T tokens, by what the registers hold (TWICE: two accumulators a panel and token) and the cap
// `most` measured at load.
template <bool TWICE>
static inline Pass pass_shape(int64_t T, int64_t most) {
    if constexpr (REGS == 32) {  // AVX-512: up to 8 tokens a pass (a larger model is bound by reading the weights)
        int64_t tokens = TWICE ? (T <= 2 ? 2 : T <= 4 ? 4 : T <= 6 ? 6 : 8) : (T <= 2 ? 2 : T <= 4 ? 4 : 8);
        if (most > 0 && tokens > most && tokens > 2)  // the largest pass of at most `most`
            tokens = most >= 6 && TWICE ? 6 : most >= 4 ? 4 : 2;
        if constexpr (TWICE) return {tokens, tokens == 2 ? 6 : tokens == 4 ? 3 : tokens == 6 ? 2 : 1};
        return {tokens, tokens == 2 ? 8 : tokens == 4 ? 6 : 3};
    } else if constexpr (TWICE) {
#if SPECRPC_AVX_VNNI  // AVX-VNNI's integer products: up to 6 tokens (a 5-token verify reads the weights once), 2 panels
                      // for one (two tokens over 2 panels took 1.2x one token's time, over one panel 1.0x, on a Zen 4
                      // with the same products EVEX-encoded)
        int64_t tokens = T <= 6 ? T : T <= 8 ? 4 : 6;
        if (most > 0 && tokens > most && tokens > 2) tokens = most >= 4 ? 4 : 2;
        return {tokens, tokens == 1 ? 2 : 1};
#else  // AVX2's integer products: at most 4 tokens, 2 panels for one
        int64_t tokens = T <= 4 ? T : T <= 6 ? 3 : 4;
        if (most > 0 && tokens > most && tokens > 2) tokens = 2;
        return {tokens, tokens == 1 ? 2 : 1};
#endif
    } else {
        // AVX2's float products: passes of 3 tokens over 2 panels, but a verify of 5 to 7 tokens in one pass of one
        // panel at a time (0.85-1.00x the time at 5 tokens, 0.79-0.85x at 7, 1.03-1.18x at 3 on a Zen 3, three rounds)
        const int64_t tokens = T <= 2 ? T : T >= 5 && T <= 7 ? T : 3;
        return {tokens, tokens == 1 ? 4 : tokens >= 5 ? 1 : 2};
    }
}

// The schedule of a product over T tokens and `rows` output rows (call inside the parallel region; it ends in a
// barrier): the panels split into one contiguous range a thread, of equal counts (± 1: groups of R, as a loop over
// them would deal out, leave one thread up to R - 1 panels more, a fifth of o's and down's at one token), each panel
// read from memory once for up to `tokens` tokens, R panels at a time so that R × tokens accumulators and R panel
// columns fit the registers, a range's remainder in the largest smaller group. tile(R, tt, p, t0) computes panels
// p .. p + R - 1 for tokens t0 .. t0 + tt - 1 (R an std::integral_constant). Each output is summed the same way
// whatever group its panel is in, so the split never changes a result.
// `most` (> 0) caps the tokens a pass takes (`Model::pass_tokens`, measured at load): fewer tokens a pass take more
// panels at a time, and read each panel again for the next tokens (from the L1 or L2 cache, the panels just read).
template <bool TWICE = false, typename Tile>
static inline void tiles(int64_t T, int64_t rows, int64_t most, Tile tile) {  // TWICE: two accumulators a panel, token
    const int64_t n_panels = (rows + LANES - 1) / LANES;
    const Pass pass = pass_shape<TWICE>(T, most);
    const int64_t tokens = pass.tokens;
    const int R = pass.panels;
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t end = n_panels * (me + 1) / threads;
    for (int64_t p0 = n_panels * me / threads; p0 < end; p0 += R) {
        const int64_t here = end - p0 < R ? end - p0 : R;  // R panels, or the range's remainder
        for (int64_t t0 = 0; t0 < T; t0 += tokens) {
            const int64_t tt = T - t0 < tokens ? T - t0 : tokens;
            for (int64_t p = p0; p < p0 + here;) {  // the largest group the remainder fills (R, or one of 6 4 3 2 1)
                const int64_t left = p0 + here - p;
                if (left >= 8 && R >= 8) tile(std::integral_constant<int, 8>{}, tt, p, t0), p += 8;
                else if (left >= 6 && R >= 6) tile(std::integral_constant<int, 6>{}, tt, p, t0), p += 6;
                else if (left >= 4 && R >= 4) tile(std::integral_constant<int, 4>{}, tt, p, t0), p += 4;
                else if (left >= 3 && R >= 3) tile(std::integral_constant<int, 3>{}, tt, p, t0), p += 3;
                else if (left >= 2 && R >= 2) tile(std::integral_constant<int, 2>{}, tt, p, t0), p += 2;
                else tile(std::integral_constant<int, 1>{}, tt, p, t0), p += 1;
            }
        }
    }
#pragma omp barrier
}

// How int8 products multiply int8 activations: 1, VNNI's vpdpbusd (AVX-512); 2, AVX2's byte multiply-adds on a CPU
// without AVX-512 (vpmaddubsw, as llama.cpp's q8_0 products there); 3, AVX-VNNI's vpdpbusd on AVX2's registers
// (`dpbusd8`); 0, not at all (the weights widened to float).
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define SPECRPC_INT8_DOT 1
#elif defined(__AVX2__) && !defined(__AVX512F__) && SPECRPC_AVX_VNNI
#define SPECRPC_INT8_DOT 3
#elif defined(__AVX2__) && !defined(__AVX512F__)
#define SPECRPC_INT8_DOT 2
#else
#define SPECRPC_INT8_DOT 0
#endif

#if SPECRPC_INT8_DOT
constexpr bool INT8_DOT = true;
constexpr int INT8_GROUP = 4;  // int8 products multiply int8 activations: weights in groups of 4 columns
constexpr int64_t QBLOCK = 32;  // activation columns per quantization scale, as llama.cpp's q8_0 (two vectors)

// Token t's activations x [cols] quantized to int8 per block of QBLOCK columns (scale max |x| / 127 over the block,
// round to nearest even), as llama.cpp quantizes a q8_0 product's activations; the row padded with zeros to kq
// columns; xs / xsum [kq / QBLOCK]: each block's scale and the sum of its quantized values. A token's quantized row
// depends on its own activations alone, so its products are the same bits whatever shares the forward.
#if SPECRPC_INT8_DOT == 1
static inline void quantize(const float* __restrict x, int64_t cols, int8_t* __restrict q, float* __restrict xs,
                            int32_t* __restrict xsum, int64_t kq) {
    for (int64_t b0 = 0; b0 < kq; b0 += QBLOCK) {
        alignas(64) float block[QBLOCK] = {};  // the block's activations, zeros past the row's end
        const int64_t n = cols - b0 < QBLOCK ? (cols > b0 ? cols - b0 : 0) : QBLOCK;
        std::memcpy(block, x + b0, n * sizeof(float));
        const __m512 lo = _mm512_load_ps(block), hi = _mm512_load_ps(block + 16);
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const __m512 inv = _mm512_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
        const __m512i qlo = _mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i qhi = _mm512_cvt_roundps_epi32(_mm512_mul_ps(hi, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b0), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b0 + 16), _mm512_cvtsepi32_epi8(qhi));
        xs[b0 / QBLOCK] = mx / 127.0f;
        xsum[b0 / QBLOCK] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
}
#else
// (AVX2: the same values, 8 lanes at a time; the conversion rounds by MXCSR, to nearest even as the AVX-512 one.)
static inline void quantize(const float* __restrict x, int64_t cols, int8_t* __restrict q, float* __restrict xs,
                            int32_t* __restrict xsum, int64_t kq) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b0 = 0; b0 < kq; b0 += QBLOCK) {
        alignas(32) float block[QBLOCK] = {};  // the block's activations, zeros past the row's end
        const int64_t n = cols - b0 < QBLOCK ? (cols > b0 ? cols - b0 : 0) : QBLOCK;
        std::memcpy(block, x + b0, n * sizeof(float));
        __m256 v[4];
        for (int i = 0; i < 4; ++i) v[i] = _mm256_load_ps(block + 8 * i);
        const float mx = hmax16({_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))});
        const __m256 inv = _mm256_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
        __m256i qi[4];
        for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        // packs interleave 128-bit lanes: the dwords come out as columns 0-3, 8-11, 16-19, 24-27, 4-7, ...
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b0),
                            _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        xs[b0 / QBLOCK] = mx / 127.0f;
        const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        int32_t lanes[8];
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), sum);
        xsum[b0 / QBLOCK] = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
    }
}
#endif

// R panels × TT tokens of an int8 product with int8 activations: the panels hold the weights + 128 as uint8 in groups
// of 4 columns ([K / 4, 16, 4] per panel, K padded to QBLOCK), so one VNNI instruction adds 4 products per lane for a
// token. Each block's integer sums start from the offset's correction (-128 × the block's sum of activations) and are
// exact in any order; they are scaled by the block's activation scale and accumulated in float, block after block in
// order; the row's weight scale is applied once at the end.
#if SPECRPC_INT8_DOT == 1
constexpr int QREGS = 32;  // registers the integer products hold their weights and sums in
template <int R, int TT>
constexpr bool q_fits = 2 * R * TT + R + 2 <= QREGS;  // integer and float sums, a group of each panel, activations

template <int R, int TT, int PF>
static inline void panels_q(const uint8_t* __restrict w, const float* __restrict scale, const float* __restrict b,
                            const int8_t* __restrict xq, const float* __restrict xs, const int32_t* __restrict xsum,
                            int64_t kq, float* __restrict y, int64_t rows, int64_t groups, int64_t n0, bool add,
                            int64_t ahead) {
    constexpr int64_t per_block = QBLOCK / INT8_GROUP;
    const int64_t nb = kq / QBLOCK;
    __m512 facc[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) facc[r][t] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < groups; k0 += per_block) {
        const int64_t blk = k0 / per_block;
        __m512i acc[R][TT];  // from the offset's correction (- 128 × the block's sum of activations): exact integers
        for (int t = 0; t < TT; ++t) {
            const __m512i offset = _mm512_set1_epi32(-128 * xsum[t * nb + blk]);
            for (int r = 0; r < R; ++r) acc[r][t] = offset;
        }
        for (int64_t k = k0; k < k0 + per_block; ++k) {
            __m512i wr[R];
            for (int r = 0; r < R; ++r) {
                const uint8_t* col = w + (r * groups + k) * LANES * INT8_GROUP;
                prefetch<PF>(col + ahead);
                wr[r] = _mm512_loadu_si512(col);
            }
            for (int t = 0; t < TT; ++t) {
                int32_t four;
                std::memcpy(&four, xq + t * kq + k * INT8_GROUP, sizeof four);
                const __m512i xb = _mm512_set1_epi32(four);
                for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], wr[r], xb);
            }
        }
        for (int t = 0; t < TT; ++t) {
            const __m512 sx = _mm512_set1_ps(xs[t * nb + blk]);
            for (int r = 0; r < R; ++r) facc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), sx, facc[r][t]);
        }
    }
    for (int r = 0; r < R; ++r) {
        const int64_t n = n0 + r * LANES, valid = rows - n < LANES ? rows - n : LANES;
        for (int t = 0; t < TT; ++t) {
            float v[LANES];
            _mm512_storeu_ps(v, facc[r][t]);
            float* out = y + t * rows + n;
            for (int64_t j = 0; j < valid; ++j) {
                const float value = v[j] * scale[n + j] + (b ? b[n + j] : 0.0f);
                out[j] = add ? out[j] + value : value;
            }
        }
    }
}

#else
// (AVX2, 16 registers of 8 lanes: a panel's 16 rows in two halves of 8.) With AVX-VNNI (SPECRPC_INT8_DOT 3) the
// products above on these registers: vpdpbusd (`dpbusd8`) on the weights as stored, each block's sums from the offset's
// correction. Without it the weights go back to signed (w + 128 with its top bit flipped) and `dot_bytes` multiplies
// their absolute values by the activations carrying their sign: each lane one row's exact sum over a group of 4
// columns, as VNNI's. Either way the block's sums are the same exact integers as VNNI's, and are scaled and accumulated
// in float as there: the same bits.
constexpr int QREGS = 16;
template <int R, int TT>
constexpr bool q_fits = SPECRPC_INT8_DOT == 3 ? 2 * R * TT + 2 * R + 1 <= QREGS  // sums; each panel's group; x
                                              : 2 * R * TT + 4 * R + 3 <= QREGS;  // signed and absolute; constants

template <int R, int TT, int PF>
static inline void panels_q(const uint8_t* __restrict w, const float* __restrict scale, const float* __restrict b,
                            const int8_t* __restrict xq, const float* __restrict xs, const int32_t* __restrict xsum,
                            int64_t kq, float* __restrict y, int64_t rows, int64_t groups, int64_t n0, bool add,
                            int64_t ahead) {
    constexpr int64_t per_block = QBLOCK / INT8_GROUP;
    const int64_t nb = kq / QBLOCK;
#if SPECRPC_INT8_DOT != 3
    (void)xsum;  // signed weights need no offset's correction
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#endif
    __m256 facc[R][TT][2];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) facc[r][t][0] = facc[r][t][1] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < groups; k0 += per_block) {
        const int64_t blk = k0 / per_block;
        __m256i acc[R][TT][2];  // the block's exact integer sums, rows 0-7 and 8-15
        for (int t = 0; t < TT; ++t) {
#if SPECRPC_INT8_DOT == 3
            const __m256i start = _mm256_set1_epi32(-128 * xsum[t * nb + blk]);  // the offset's correction
#else
            const __m256i start = _mm256_setzero_si256();
#endif
            for (int r = 0; r < R; ++r) acc[r][t][0] = acc[r][t][1] = start;
        }
        for (int64_t k = k0; k < k0 + per_block; ++k) {
            __m256i ws[R][2];  // the group's weights: as stored (AVX-VNNI), else signed
#if SPECRPC_INT8_DOT != 3
            __m256i wa[R][2];  // and absolute
#endif
            for (int r = 0; r < R; ++r) {
                const uint8_t* col = w + (r * groups + k) * LANES * INT8_GROUP;
                prefetch<PF>(col + ahead);
                for (int h = 0; h < 2; ++h) {
                    ws[r][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + 32 * h));
#if SPECRPC_INT8_DOT != 3
                    ws[r][h] = _mm256_xor_si256(ws[r][h], flip);
                    wa[r][h] = _mm256_abs_epi8(ws[r][h]);
#endif
                }
            }
            for (int t = 0; t < TT; ++t) {
                int32_t four;
                std::memcpy(&four, xq + t * kq + k * INT8_GROUP, sizeof four);
                const __m256i xb = _mm256_set1_epi32(four);
                for (int r = 0; r < R; ++r)
                    for (int h = 0; h < 2; ++h) {
#if SPECRPC_INT8_DOT == 3
                        acc[r][t][h] = dpbusd8(acc[r][t][h], ws[r][h], xb);
#else
                        acc[r][t][h] = dot_bytes(acc[r][t][h], wa[r][h], xb, ws[r][h]);
#endif
                    }
            }
        }
        for (int t = 0; t < TT; ++t) {
            const __m256 sx = _mm256_set1_ps(xs[t * nb + blk]);
            for (int r = 0; r < R; ++r)
                for (int h = 0; h < 2; ++h)
                    facc[r][t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][t][h]), sx, facc[r][t][h]);
        }
    }
    for (int r = 0; r < R; ++r) {
        const int64_t n = n0 + r * LANES, valid = rows - n < LANES ? rows - n : LANES;
        for (int t = 0; t < TT; ++t) {
            float v[LANES];
            _mm256_storeu_ps(v, facc[r][t][0]);
            _mm256_storeu_ps(v + 8, facc[r][t][1]);
            float* out = y + t * rows + n;
            for (int64_t j = 0; j < valid; ++j) {
                const float value = v[j] * scale[n + j] + (b ? b[n + j] : 0.0f);
                out[j] = add ? out[j] + value : value;
            }
        }
    }
}
#endif

template <int R, int PF>
static inline void panels_q_tt(int64_t tt, const uint8_t* w, const float* scale, const float* b, const int8_t* xq,
                               const float* xs, const int32_t* xsum, int64_t kq, float* y, int64_t rows,
                               int64_t groups, int64_t n0, bool add, int64_t ahead) {
    switch (tt) {
#define SPECRPC_TT(N) \
    case N: \
        if constexpr (q_fits<R, N>) \
            panels_q<R, N, PF>(w, scale, b, xq, xs, xsum, kq, y, rows, groups, n0, add, ahead); \
        else __builtin_trap(); /* `tiles` never asks for more than the registers hold */ \
        return;
        SPECRPC_TT(1) SPECRPC_TT(2) SPECRPC_TT(3) SPECRPC_TT(4) SPECRPC_TT(5) SPECRPC_TT(6) SPECRPC_TT(7) SPECRPC_TT(8)
#undef SPECRPC_TT
    }
}

// y = x W^T for int8 W through integer products (`panels_q`), its T activation rows already quantized into the
// model's xq / xs / xsum by the loop that produced them (`quantize_cols`).
template <int PF>
static inline void gemm_dot(const Model* m, Weight w, const float* __restrict b, float* __restrict y, int64_t T,
                            int64_t rows, int64_t cols, bool add) {
    const int64_t kq = (cols + QBLOCK - 1) / QBLOCK * QBLOCK, groups = kq / INT8_GROUP, nb = kq / QBLOCK;
    const uint8_t* q = static_cast<const uint8_t*>(w.w);
    tiles<true>(T, rows, pass_cap(m, T), [&](auto r, int64_t tt, int64_t p, int64_t t0) {
        panels_q_tt<decltype(r)::value, PF>(tt, q + p * groups * LANES * INT8_GROUP, w.scale, b,
                                             m->xq + t0 * kq, m->xs + t0 * nb, m->xsum + t0 * nb, kq,
                                             y + t0 * rows, rows, groups, p * LANES, add, prefetch_ahead(m));
    });
}

// AMX: a verify's int8 products on the tile unit (Intel Sapphire Rapids and later), the same bits as `panels_q`. VNNI
// multiplies 64 weight bytes by one token's activations an instruction, so a product over T tokens does T times one
// token's multiplies (at most one dpbusd a cycle per core; `specrpc bench floor` measures the rate); one TDPBSUD
// multiplies a block of 32 columns of 16 panel rows by all T tokens at once. Each block's integer sums are exact in
// any order, so the tile's sums are `panels_q`'s; they are turned into floats block after block in the same order
// (offset's correction, scale by the block's activation scale, one fused multiply-add), so every output is the same
// bits as through VNNI: which path runs is a speed choice (`amx_from`, measured at load), never a numerical one.
// SPECRPC_AMX_EMULATE: the tile instructions as scalar code with their documented semantics (Intel SDM: LDTILECFG,
// TILEZERO, TILELOADD, TILESTORED, TDPBSUD), so the kernel is tested on CPUs without AMX. SPECRPC_NO_AMX: none (the
// build's fallback where the assembler does not know the tile instructions).
#if SPECRPC_INT8_DOT != 1
#define SPECRPC_AMX 0
#elif defined(SPECRPC_AMX_EMULATE)
#define SPECRPC_AMX 1
#define SPECRPC_AMX_TARGET
#elif defined(__linux__) && defined(__x86_64__) && !defined(SPECRPC_NO_AMX) && (__GNUC__ >= 11 || __clang_major__ >= 12)
#define SPECRPC_AMX 1
#define SPECRPC_AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
#else
#define SPECRPC_AMX 0
#endif

#if SPECRPC_AMX
struct alignas(64) TileConfig {  // LDTILECFG's 64-byte operand, palette 1
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];  // bytes a row of each tile
    uint8_t rows[16];
};

constexpr int AMX_PANELS = 3;  // panels a pass: C tiles 0 .. 2 (int32 [T, 16]), A tile 3 (int8 [T, 32]), B tiles 4 .. 6

#if defined(SPECRPC_AMX_EMULATE)
static thread_local TileConfig tile_cfg;
static thread_local uint8_t tile_data[8][16][64];  // 8 tiles of at most 16 rows × 64 bytes

static inline void tile_config(const TileConfig* c) { tile_cfg = *c; std::memset(tile_data, 0, sizeof tile_data); }
static inline void tile_release() {}
template <int N>
static inline void tile_zero() { std::memset(tile_data[N], 0, sizeof tile_data[N]); }
template <int N>
static inline void tile_load(const void* base, int64_t stride) {  // the configured rows × colsb, the rest zeroed
    std::memset(tile_data[N], 0, sizeof tile_data[N]);
    for (int r = 0; r < tile_cfg.rows[N]; ++r)
        std::memcpy(tile_data[N][r], static_cast<const uint8_t*>(base) + r * stride, tile_cfg.colsb[N]);
}
template <int N>
static inline void tile_store(void* base, int64_t stride) {
    for (int r = 0; r < tile_cfg.rows[N]; ++r)
        std::memcpy(static_cast<uint8_t*>(base) + r * stride, tile_data[N][r], tile_cfg.colsb[N]);
}
template <int C, int A, int B>
static inline void tile_dpbsud() {  // C[m][n] += sum over k, i < 4 of int8 A[m][4 k + i] * uint8 B[k][4 n + i]
    for (int mrow = 0; mrow < tile_cfg.rows[C]; ++mrow)
        for (int n = 0; n < tile_cfg.colsb[C] / 4; ++n) {
            int32_t acc;
            std::memcpy(&acc, tile_data[C][mrow] + 4 * n, 4);
            for (int k = 0; k < tile_cfg.colsb[A] / 4; ++k)
                for (int i = 0; i < 4; ++i)
                    acc += static_cast<int32_t>(static_cast<int8_t>(tile_data[A][mrow][4 * k + i])) *
                           static_cast<int32_t>(tile_data[B][k][4 * n + i]);
            std::memcpy(tile_data[C][mrow] + 4 * n, &acc, 4);
        }
}
#else  // the intrinsics name their tiles by literal numbers (GCC pastes them into the instruction)
SPECRPC_AMX_TARGET static inline void tile_config(const TileConfig* c) { _tile_loadconfig(c); }
SPECRPC_AMX_TARGET static inline void tile_release() { _tile_release(); }
template <int N>
SPECRPC_AMX_TARGET static inline void tile_zero() {
    static_assert(N >= 0 && N < AMX_PANELS, "C tiles");
    if constexpr (N == 0) _tile_zero(0);
    else if constexpr (N == 1) _tile_zero(1);
    else _tile_zero(2);
}
template <int N>
SPECRPC_AMX_TARGET static inline void tile_load(const void* base, int64_t stride) {
    static_assert(N >= AMX_PANELS && N <= 2 * AMX_PANELS, "A and B tiles");
    if constexpr (N == 3) _tile_loadd(3, base, stride);
    else if constexpr (N == 4) _tile_loadd(4, base, stride);
    else if constexpr (N == 5) _tile_loadd(5, base, stride);
    else _tile_loadd(6, base, stride);
}
template <int N>
SPECRPC_AMX_TARGET static inline void tile_store(void* base, int64_t stride) {
    static_assert(N >= 0 && N < AMX_PANELS, "C tiles");
    if constexpr (N == 0) _tile_stored(0, base, stride);
    else if constexpr (N == 1) _tile_stored(1, base, stride);
    else _tile_stored(2, base, stride);
}
template <int C, int A, int B>
SPECRPC_AMX_TARGET static inline void tile_dpbsud() {
    static_assert(A == AMX_PANELS && B == C + AMX_PANELS + 1, "C tile c multiplies A by B tile c + 4");
    if constexpr (C == 0) _tile_dpbsud(0, 3, 4);
    else if constexpr (C == 1) _tile_dpbsud(1, 3, 5);
    else _tile_dpbsud(2, 3, 6);
}
#endif

// Whether this process may use the tiles: 1 where the CPU has AMX-TILE and AMX-INT8 and Linux grants the tile data
// state (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16 and later; always under SPECRPC_AMX_EMULATE), 0 where the CPU has
// no AMX, -1 where Linux refuses it (an older kernel, a signal stack too small for the tiles' state). Asked once.
static int amx_permitted() {
#if defined(SPECRPC_AMX_EMULATE)
    return 1;
#else
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return 0;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
#endif
}

static bool amx_ready = false;  // set by specrpc_amx_enable

// y = x W^T for int8 W through AMX, for tokens t0 .. t0 + T - 1, T <= 16 (their activations quantized in the model's
// xq / xs / xsum, as for `gemm_dot`): the panels split across the threads as `tiles` splits them, AMX_PANELS at a
// time, all T tokens at once; per block of 32 columns one TDPBSUD a panel, its int32 sums [T, 16] then scaled and
// accumulated in float as `panels_q` accumulates them. Call inside the parallel region; it ends in a barrier.
template <int PF>
SPECRPC_AMX_TARGET static void gemm_amx(const Model* m, Weight w, const float* __restrict b, float* __restrict y,
                                        int64_t t0, int64_t T, int64_t rows, int64_t cols, bool add) {
    const int64_t kq = (cols + QBLOCK - 1) / QBLOCK * QBLOCK, groups = kq / INT8_GROUP, nb = kq / QBLOCK;
    constexpr int64_t per_block = QBLOCK / INT8_GROUP;  // a block's groups: B's rows
    constexpr int64_t panel_block = per_block * LANES * INT8_GROUP;  // a block's bytes of one panel (512)
    const uint8_t* q = static_cast<const uint8_t*>(w.w);
    TileConfig cfg = {};
    cfg.palette = 1;
    for (int c = 0; c < AMX_PANELS; ++c) cfg.colsb[c] = LANES * 4, cfg.rows[c] = static_cast<uint8_t>(T);
    cfg.colsb[AMX_PANELS] = QBLOCK, cfg.rows[AMX_PANELS] = static_cast<uint8_t>(T);
    for (int c = AMX_PANELS + 1; c <= 2 * AMX_PANELS; ++c) cfg.colsb[c] = LANES * 4, cfg.rows[c] = per_block;
    tile_config(&cfg);
    const int64_t n_panels = (rows + LANES - 1) / LANES, ahead = prefetch_ahead(m);
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t end = n_panels * (me + 1) / threads;
    alignas(64) int32_t sums[AMX_PANELS][16][LANES];  // a block's tile sums [panel][token][row]
    __m512 facc[AMX_PANELS][16];
    for (int64_t p0 = n_panels * me / threads; p0 < end; p0 += AMX_PANELS) {
        const int here = end - p0 < AMX_PANELS ? static_cast<int>(end - p0) : AMX_PANELS;
        const uint8_t* panel = q + p0 * groups * LANES * INT8_GROUP;
        const int64_t panel_bytes = groups * LANES * INT8_GROUP;
        for (int r = 0; r < AMX_PANELS; ++r)
            for (int64_t t = 0; t < T; ++t) facc[r][t] = _mm512_setzero_ps();
        for (int64_t blk = 0; blk < nb; ++blk) {
            if (PF != NONE)
                for (int r = 0; r < here; ++r)
                    for (int64_t i = 0; i < panel_block; i += 64)
                        prefetch<PF>(panel + r * panel_bytes + blk * panel_block + i + ahead);
            tile_load<AMX_PANELS>(m->xq + t0 * kq + blk * QBLOCK, kq);  // A: the tokens' int8 activations of the block
            tile_zero<0>();
            tile_load<AMX_PANELS + 1>(panel + blk * panel_block, LANES * INT8_GROUP);
            tile_dpbsud<0, AMX_PANELS, AMX_PANELS + 1>();
            if (here > 1) {
                tile_zero<1>();
                tile_load<AMX_PANELS + 2>(panel + panel_bytes + blk * panel_block, LANES * INT8_GROUP);
                tile_dpbsud<1, AMX_PANELS, AMX_PANELS + 2>();
            }
            if (here > 2) {
                tile_zero<2>();
                tile_load<AMX_PANELS + 3>(panel + 2 * panel_bytes + blk * panel_block, LANES * INT8_GROUP);
                tile_dpbsud<2, AMX_PANELS, AMX_PANELS + 3>();
            }
            tile_store<0>(sums[0], LANES * 4);
            if (here > 1) tile_store<1>(sums[1], LANES * 4);
            if (here > 2) tile_store<2>(sums[2], LANES * 4);
            for (int64_t t = 0; t < T; ++t) {
                const __m512i offset = _mm512_set1_epi32(-128 * m->xsum[(t0 + t) * nb + blk]);
                const __m512 sx = _mm512_set1_ps(m->xs[(t0 + t) * nb + blk]);
                for (int r = 0; r < here; ++r) {
                    const __m512i acc = _mm512_add_epi32(_mm512_load_si512(sums[r][t]), offset);
                    facc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), sx, facc[r][t]);
                }
            }
        }
        for (int r = 0; r < here; ++r) {
            const int64_t n = (p0 + r) * LANES, valid = rows - n < LANES ? rows - n : LANES;
            for (int64_t t = 0; t < T; ++t) {
                float v[LANES];
                _mm512_storeu_ps(v, facc[r][t]);
                float* out = y + (t0 + t) * rows + n;
                for (int64_t j = 0; j < valid; ++j) {
                    const float value = v[j] * w.scale[n + j] + (b ? b[n + j] : 0.0f);
                    out[j] = add ? out[j] + value : value;
                }
            }
        }
    }
    tile_release();
#pragma omp barrier
}
#endif

// An int8 product: through AMX from `amx_from` tokens where this process may use it, else VNNI or AVX2 (the same bits).
template <int PF>
static inline void gemm_q(const Model* m, Weight w, const float* __restrict b, float* __restrict y, int64_t T,
                          int64_t rows, int64_t cols, bool add) {
#if SPECRPC_AMX
    if (amx_ready && m->amx_from > 0 && T >= m->amx_from) {  // the tiles take 16 tokens at a time
        for (int64_t t0 = 0; t0 < T; t0 += 16) gemm_amx<PF>(m, w, b, y, t0, T - t0 < 16 ? T - t0 : 16, rows, cols, add);
        return;
    }
#endif
    gemm_dot<PF>(m, w, b, y, T, rows, cols, add);
}
#else
constexpr bool INT8_DOT = false;
constexpr int INT8_GROUP = 1;  // int8 weights widened to float in registers, one column at a time
constexpr int64_t QBLOCK = 1;  // no activation blocks: activations stay float
#endif

// Whether a product with weight w multiplies int8 activations (int8 weights, `INT8_DOT`): then the loop that produces
// its activations also quantizes them (`quantize_cols`), each token's where it is written, so that no loop of the
// product's own (and no barrier) comes between.
static inline bool quantizes(Weight w) { return INT8_DOT && w.scale != nullptr; }

// Columns c0 .. c0 + n - 1 of token t's activations x (x points at column c0) for a product of `cols` columns into the
// model's xq / xs / xsum (`quantize`): c0 a multiple of QBLOCK, and n one too unless the columns reach the row's end.
static inline void quantize_cols(const Model* m, const float* x, int64_t cols, int64_t t, int64_t c0, int64_t n) {
#if SPECRPC_INT8_DOT
    const int64_t kq = (cols + QBLOCK - 1) / QBLOCK * QBLOCK, nb = kq / QBLOCK;
    quantize(x, n, m->xq + t * kq + c0, m->xs + t * nb + c0 / QBLOCK, m->xsum + t * nb + c0 / QBLOCK,
             (n + QBLOCK - 1) / QBLOCK * QBLOCK);
#else
    (void)m, (void)x, (void)cols, (void)t, (void)c0, (void)n;  // never called: `quantizes` is false
#endif
}

// y[t, n] = (add ? y[t, n] : 0) + W[n, :] x[t, :] (· scale[n]) + b[n] for t < T (call inside the parallel region);
// x's rows ldx floats apart.
template <int PF, typename W>
static inline void gemm_rows(const W* __restrict w, const float* __restrict scale, const float* __restrict b,
                             const float* __restrict x, int64_t ldx, float* __restrict y, int64_t T, int64_t rows,
                             int64_t cols, bool add, int64_t ahead, int64_t most) {
    tiles(T, rows, most, [&](auto r, int64_t tt, int64_t p, int64_t t0) {
        panels_tt<decltype(r)::value, PF>(tt, w + p * cols * LANES, scale, b, x + t0 * ldx, ldx, y + t0 * rows, rows,
                                          cols, p * LANES, add, ahead);
    });
}

template <int PF>
static inline void gemm_pf(const Model* m, Weight w, const float* __restrict b, const float* __restrict x, int64_t ldx,
                           float* __restrict y, int64_t T, int64_t rows, int64_t cols, bool add) {
    if (w.scale) {
#if SPECRPC_INT8_DOT
        (void)x, (void)ldx;  // the activations were quantized where they were written (`quantizes`)
        gemm_q<PF>(m, w, b, y, T, rows, cols, add);
#else
        gemm_rows<PF>(static_cast<const int8_t*>(w.w), w.scale, b, x, ldx, y, T, rows, cols, add, prefetch_ahead(m),
                      pass_cap(m, T));
#endif
    } else {
        gemm_rows<PF>(static_cast<const float*>(w.w), nullptr, b, x, ldx, y, T, rows, cols, add, prefetch_ahead(m),
                      pass_cap(m, T));
    }
}

// A product through the model's prefetch mode (`Prefetch`; an unknown value prefetches nothing): y [T, rows] from the
// activations x [T, cols] (rows ldx floats apart), or from their quantized copy where `quantizes(w)`.
static inline void gemm(const Model* m, Weight w, const float* __restrict b, const float* __restrict x, int64_t ldx,
                        float* __restrict y, int64_t T, int64_t rows, int64_t cols, bool add) {
    switch (m->prefetch) {
        case NON_TEMPORAL: return gemm_pf<NON_TEMPORAL>(m, w, b, x, ldx, y, T, rows, cols, add);
        case TEMPORAL: return gemm_pf<TEMPORAL>(m, w, b, x, ldx, y, T, rows, cols, add);
        case OUTER: return gemm_pf<OUTER>(m, w, b, x, ldx, y, T, rows, cols, add);
        default: return gemm_pf<NONE>(m, w, b, x, ldx, y, T, rows, cols, add);
    }
}

// out = x / rms(x) * w (out may be x).
static inline void rms_norm(const float* x, const float* __restrict w, float* out, int64_t n, float eps) {
    const float ss = dot(x, x, n);
    const float r = 1.0f / std::sqrt(ss / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * (w ? w[i] : 1.0f);
}

// Row x normalised (`rms_norm`, weights w) into the model's h as its row t, the input of `product`, and quantized there
// too where that product multiplies int8 activations (`quantizes`).
static inline void norm_input(const Model* m, const float* x, const float* __restrict w, int64_t t, Weight product) {
    float* h = m->h + t * m->d;
    rms_norm(x, w, h, m->d, m->eps);
    if (quantizes(product)) quantize_cols(m, h, m->d, t, 0, m->d);
}

// rope(x) at one position, in place, for one head of dh values: x[i] c[i] + x[partner] s[i], the partner half a head
// away; the product with s rounded first, then one fused multiply-add. Two loops (first half, second half) with no
// division in them, so both vectorise.
static inline void rope(float* __restrict x, const float* __restrict c, const float* __restrict s, int64_t dh) {
    const int64_t half = dh / 2;
    float tmp[1024];
    for (int64_t i = 0; i < dh; ++i) tmp[i] = x[i];
    for (int64_t i = 0; i < half; ++i) x[i] = std::fma(tmp[i], c[i], tmp[i + half] * s[i]);
    for (int64_t i = half; i < dh; ++i) x[i] = std::fma(tmp[i], c[i], tmp[i - half] * s[i]);
}

// exp(x) lane by lane for x <= 0 (a softmax's shifted scores), within 2 ulp: x = n ln 2 + r, |r| <= ln 2 / 2,
// exp(r) by Cephes' polynomial, times 2^n through the exponent bits; below -87 (where exp underflows towards 0) it
// gives 2^-126. Each lane's result depends on that lane alone.
static inline v16 exp16(v16 x) {
    const v16 floor_x = splat(-87.0f);
    x = select16(x < floor_x, floor_x, x);
    const v16 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    const v16 n = (x * splat(1.44269504088896341f) + magic) - magic;
    const v16 r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
    v16 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    return p * exp2i16(n);
}

// silu(g) u lane by lane: g sigmoid(g), the sigmoid from exp(-|g|) (`exp16`, an argument <= 0), 1 / (1 + e) for g >= 0
// and e / (1 + e) below.
static inline v16 silu16(v16 g, v16 u) {
    const m16 negative = g < v16{};
    const v16 one = splat(1.0f), e = exp16(select16(negative, g, -g));
    return g * (select16(negative, e, one) / (one + e)) * u;
}

// The gated SiLU of columns i0 .. i0 + n - 1 (n <= 16) of a token's up row [2 ffn] (gate, then up), in place over the
// gate half: row[i] = silu(row[i]) row[ffn + i]. A partial vector is padded, so a column's value is the same bits in
// any group.
static inline void silu_gate(float* row, int64_t ffn, int64_t i0, int64_t n) {
    if (n == 16) {
        const v16 y = silu16(load16(row + i0), load16(row + ffn + i0));
        std::memcpy(row + i0, &y, sizeof y);
        return;
    }
    float g[16] = {}, u[16] = {};
    std::memcpy(g, row + i0, n * sizeof(float));
    std::memcpy(u, row + ffn + i0, n * sizeof(float));
    const v16 y = silu16(load16(g), load16(u));
    std::memcpy(row + i0, &y, n * sizeof(float));
}

// The scores of NQ queries q[0 .. NQ - 1] against a whole block of 16 key rows at `k`, dh = 16 DC known when compiled
// (64 and 128, the common head sizes: each key row is one base address plus a constant, where 16 row addresses of a
// run-time stride spilled the general-purpose registers in the inner loop), into e[0 .. NQ - 1]: each key chunk
// loaded once for the NQ queries, each score the 16-lane products over the DC chunks in order from zero, summed by
// `reduce16`, so a query's scores are the same bits whatever else shares the call.
template <int NQ, int DC>
static inline void dots16_full(const float* const* q, const float* __restrict k, v16* e) {
    constexpr int KEYS = (REGS == 32 ? 16 : 4) / NQ;  // key rows whose NQ sums the registers hold at once
    // where a pass holds a half of the block or more, each half's sums fold (`reduce8`) as soon as they are complete,
    // so that no more than a pass's sums are live at once; else the passes' sums are kept for `reduce16`
    constexpr bool HALVES = KEYS >= 8;
    v16 a[NQ][HALVES ? 1 : 16];
    v16 half[NQ][HALVES ? 2 : 1];
#pragma GCC unroll 4
    for (int i0 = 0; i0 < 16; i0 += KEYS) {
        v16 g[NQ][KEYS];
#pragma GCC unroll 2
        for (int n = 0; n < NQ; ++n)
#pragma GCC unroll 16
            for (int i = 0; i < KEYS; ++i) g[n][i] = v16{};
#pragma GCC unroll 8
        for (int c = 0; c < DC; ++c) {
            v16 qd[NQ];
#pragma GCC unroll 2
            for (int n = 0; n < NQ; ++n) qd[n] = load16(q[n] + 16 * c);
#pragma GCC unroll 16
            for (int i = 0; i < KEYS; ++i) {
                const v16 kr = load16(k + (i0 + i) * DC * 16 + 16 * c);
#pragma GCC unroll 2
                for (int n = 0; n < NQ; ++n) g[n][i] = fma16(qd[n], kr, g[n][i]);
            }
        }
#pragma GCC unroll 2
        for (int n = 0; n < NQ; ++n) {
            if constexpr (HALVES) {
#pragma GCC unroll 2
                for (int h = 0; h < KEYS / 8; ++h) half[n][i0 / 8 + h] = reduce8(g[n] + 8 * h);
            } else {
#pragma GCC unroll 16
                for (int i = 0; i < KEYS; ++i) a[n][i0 + i] = g[n][i];
            }
        }
    }
#pragma GCC unroll 2
    for (int n = 0; n < NQ; ++n) {
        if constexpr (HALVES) e[n] = join16(half[n][0], half[n][1]);
        else e[n] = reduce16(a[n]);
    }
}

// q . k[i] for the key rows i in [first, count) of a block of 16 at `k` (stride dh; the other lanes are 0): each the
// 16-lane products over dh in 16-column chunks in order (the last chunk zero-padded), summed by `reduce16`. A row's
// score is the same bits whichever rows share its block. FULL: first = 0 and count = 16 (unrolled, in registers);
// with DC > 0 (dh = 16 DC), `dots16_full` for this query alone.
template <bool FULL, int DC = 0>
static inline v16 dots16(const float* __restrict q, const float* __restrict k, int64_t dh, int64_t first,
                         int64_t count) {
    if constexpr (FULL && DC > 0) {
        const float* const one[1] = {q};
        v16 e;
        dots16_full<1, DC>(one, k, &e);
        return e;
    }
    if (FULL) first = 0, count = 16;
    v16 a[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) a[i] = v16{};
    int64_t d = 0;
    for (; d + 16 <= dh; d += 16) {
        const v16 qd = load16(q + d);
#pragma GCC unroll 16
        for (int64_t i = first; i < count; ++i) a[i] = fma16(qd, load16(k + i * dh + d), a[i]);
    }
    if (d < dh) {
        float qt[16] = {}, kt[16] = {};
        std::memcpy(qt, q + d, (dh - d) * sizeof(float));
        for (int64_t i = first; i < count; ++i) {
            std::memcpy(kt, k + i * dh + d, (dh - d) * sizeof(float));
            a[i] = fma16(load16(qt), load16(kt), a[i]);
        }
    }
    return reduce16(a);
}

// Whether the 16 positions from p0 all lie in [lo, hi).
static inline bool full_block(int64_t p0, int64_t lo, int64_t hi) { return p0 >= lo && p0 + 16 <= hi; }

// The 16 values at s + p0 with the positions outside [lo, hi) replaced by `fill` (a block at a range's edge: nothing
// outside the range is read).
static inline v16 edge_load(const float* s, int64_t p0, int64_t lo, int64_t hi, float fill) {
    float block[16];
    for (int64_t i = 0; i < 16; ++i) block[i] = p0 + i >= lo && p0 + i < hi ? s[p0 + i] : fill;
    return load16(block);
}

static inline void edge_store(float* s, int64_t p0, int64_t lo, int64_t hi, v16 v) {
    float block[16];
    std::memcpy(block, &v, sizeof block);
    for (int64_t i = 0; i < 16; ++i)
        if (p0 + i >= lo && p0 + i < hi) s[p0 + i] = block[i];
}

// The scores s[lo .. hi) become their softmax, in place, 16 positions a vector in blocks aligned to multiples of 16
// positions: each position's lane, and so every rounding, depends on the range alone, not on what else is attended.
// The sum is lane-wise block after block, then one fixed tree; each weight is its exp divided by that sum.
static inline void softmax(float* s, int64_t lo, int64_t hi) {
    const int64_t a0 = lo / 16 * 16;
    v16 m = splat(-INFINITY);
    for (int64_t p0 = a0; p0 < hi; p0 += 16)
        m = vmax16(m, full_block(p0, lo, hi) ? load16(s + p0) : edge_load(s, p0, lo, hi, -INFINITY));
    const v16 mx = splat(hmax16(m)), zero = v16{};
    v16 acc = zero;
    for (int64_t p0 = a0; p0 < hi; p0 += 16) {
        if (full_block(p0, lo, hi)) {
            const v16 e = exp16(load16(s + p0) - mx);
            std::memcpy(s + p0, &e, sizeof e);
            acc += e;
        } else {
            const v16 x = edge_load(s, p0, lo, hi, -INFINITY);
            const v16 e = select16(x == splat(-INFINITY), zero, exp16(x - mx));  // outside the range: no weight
            edge_store(s, p0, lo, hi, e);
            acc += e;
        }
    }
    const v16 sum = splat(hsum16(acc));
    for (int64_t p0 = a0; p0 < hi; p0 += 16) {
        if (full_block(p0, lo, hi)) {
            const v16 w = load16(s + p0) / sum;
            std::memcpy(s + p0, &w, sizeof w);
        } else {
            edge_store(s, p0, lo, hi, edge_load(s, p0, lo, hi, 0.0f) / sum);
        }
    }
}

constexpr int64_t QUERIES = 16;  // queries a job attends together: each key and value row read from memory once for all
// Queries whose weighted sums the registers hold at once, DC vectors each: 24 sums (the value row's chunks are
// operands of the multiply-adds, read from the L1 cache), so six queries at dh = 64 and three at dh = 128. (Four at
// dh = 64 took a 5-token verify's 10 queries a job in three passes over each value tile instead of two: its attention
// 1.14x the time at 1,900 positions on a Zen 4, one thread, `attend` alone.)
constexpr int held_queries(int dc) { return REGS != 32 ? 1 : 24 / dc > 6 ? 6 : 24 / dc < 1 ? 1 : 24 / dc; }
constexpr int64_t VALUE_TILE = 64;   // value rows a tile: 16 KB at dh = 64, read from the L1 cache by each group

// acc[j] += w[j][p] v[p] for the NJ queries j and the positions p in [a, b), which each of them attends: one fused
// multiply-add per position in order, no range checks.
template <int NJ, int DC>
static inline void weigh_all(const float* __restrict vh, float* const* w, v16 (&acc)[held_queries(DC)][DC], int64_t a,
                             int64_t b) {
    for (int64_t p = a; p < b; ++p) {
        const float* v = vh + p * DC * 16;
        v16 vr[DC];
        for (int c = 0; c < DC; ++c) vr[c] = load16(v + c * 16);
        for (int j = 0; j < NJ; ++j) {
            const v16 wj = splat(w[j][p]);
            for (int c = 0; c < DC; ++c) acc[j][c] = fma16(wj, vr[c], acc[j][c]);
        }
    }
}

// `weigh_all` for nj (1 .. NJ) queries, nj chosen at run time.
template <int DC, int NJ = held_queries(DC)>
static inline void weigh_some(int64_t nj, const float* __restrict vh, float* const* w,
                              v16 (&acc)[held_queries(DC)][DC], int64_t a, int64_t b) {
    if constexpr (NJ > 1)
        if (nj < NJ) return weigh_some<DC, NJ - 1>(nj, vh, w, acc, a, b);
    weigh_all<NJ, DC>(vh, w, acc, a, b);
}

// out[j] (DC vectors) = sum of w[j][p] v[p] for the queries j < n over positions p in [lo_all, hi_all), each query only
// within its own [lo[j], hi[j]): one fused multiply-add per position in order, so the same bits whatever else is
// attended. Tiles of VALUE_TILE rows are read once from the outer caches for all n queries, `held_queries` at a time
// (their sums carried in `out` from tile to tile); the positions all of them attend without range checks.
template <int DC>
static inline void weigh_values(const float* __restrict vh, float* const* w, float* const* out, const int64_t* lo,
                                const int64_t* hi, int64_t n, int64_t lo_all, int64_t hi_all) {
    constexpr int64_t HELD = held_queries(DC);
    for (int64_t j = 0; j < n; ++j) std::memset(out[j], 0, DC * sizeof(v16));
    for (int64_t p0 = lo_all; p0 < hi_all; p0 += VALUE_TILE) {
        const int64_t p1 = hi_all - p0 < VALUE_TILE ? hi_all : p0 + VALUE_TILE;
        for (int64_t j0 = 0; j0 < n; j0 += HELD) {
            const int64_t nj = n - j0 < HELD ? n - j0 : HELD;
            v16 acc[HELD][DC];
            for (int64_t j = 0; j < nj; ++j) std::memcpy(acc[j], out[j0 + j], sizeof acc[j]);
            int64_t a = p0, b = p1;  // [a, b): the positions of the tile every query of the group attends
            for (int64_t j = j0; j < j0 + nj; ++j) {
                a = lo[j] > a ? lo[j] : a;
                b = hi[j] < b ? hi[j] : b;
            }
            if (a >= b) a = b = p1;
            auto checked = [&](int64_t from, int64_t to) {  // positions some query of the group may not attend
                for (int64_t p = from; p < to; ++p) {
                    const float* v = vh + p * DC * 16;
                    v16 vr[DC];
                    for (int c = 0; c < DC; ++c) vr[c] = load16(v + c * 16);
                    for (int j = 0; j < HELD; ++j) {
                        if (j >= nj || p < lo[j0 + j] || p >= hi[j0 + j]) continue;
                        const v16 wj = splat(w[j0 + j][p]);
                        for (int c = 0; c < DC; ++c) acc[j][c] = fma16(wj, vr[c], acc[j][c]);
                    }
                }
            };
            checked(p0, a);
            weigh_some<DC>(nj, vh, w + j0, acc, a, b);
            checked(b, p1);
            for (int64_t j = 0; j < nj; ++j) std::memcpy(out[j0 + j], acc[j], sizeof acc[j]);
        }
    }
}

// Share `chunk` of `chunks` (equal ± 1, at most QUERIES) of the queries of the row of tokens t0 .. t1 - 1 (one slot,
// consecutive positions) on KV head g of layer l: query j is token t0 + j / rep's head g * rep + j % rep (the heads
// sharing g). Each query attends causally to its slot's positions up to its own (within the layer's window) exactly
// as it would alone: its scores, softmax and weighted sum of values are formed in the same order whatever else is
// attended in the same pass.
// quantized: each query's output also quantized for the o product (`quantize_cols`; dh a multiple of QBLOCK).
static void attend(const Model* m, const Layer& L, int64_t l, const int64_t* pos_of, const int64_t* slot_of, int64_t t0,
                   int64_t t1, int64_t g, int64_t chunk, int64_t chunks, float scale, bool quantized) {
    const int64_t hq = m->hq, hkv = m->hkv, dh = m->dh, cap = m->capacity, rep = hq / hkv;
    const int64_t nqkv = (hq + 2 * hkv) * dh;
    const int64_t first = (t1 - t0) * rep * chunk / chunks, last = (t1 - t0) * rep * (chunk + 1) / chunks;
    if (first >= last) return;
    const int64_t n = last - first;
    const float* kh = m->k_cache + (((l * m->slots + slot_of[t0]) * hkv) + g) * cap * dh;  // [cap, dh]
    const float* vh = m->v_cache + (((l * m->slots + slot_of[t0]) * hkv) + g) * cap * dh;
    const float* q[QUERIES];
    float* sc[QUERIES];
    float* out[QUERIES];
    int64_t lo[QUERIES], hi[QUERIES], lo_all = INT64_MAX, hi_all = 0;
    for (int64_t j = 0; j < n; ++j) {
        const int64_t t = t0 + (first + j) / rep, h = g * rep + (first + j) % rep, pos = pos_of[t];
        q[j] = m->qkv + t * nqkv + h * dh;
        sc[j] = m->scores + (t * hq + h) * cap;
        out[j] = m->att + t * hq * dh + h * dh;
        lo[j] = L.window > 0 && pos + 1 > L.window ? pos + 1 - L.window : 0;
        hi[j] = pos + 1;
        lo_all = lo[j] < lo_all ? lo[j] : lo_all;
        hi_all = hi[j] > hi_all ? hi[j] : hi_all;
    }
    for (int64_t p0 = lo_all / 16 * 16; p0 < hi_all; p0 += 16) {  // scores, 16 key rows at a time for all queries
        // (the block read from memory by the first query, from L1 by the rest)
        const int64_t first = lo_all - p0 > 0 ? lo_all - p0 : 0, count = hi_all - p0 < 16 ? hi_all - p0 : 16;
        int64_t j = 0;
        if (first == 0 && count == 16 && (dh == 64 || dh == 128))  // pairs of queries that attend the whole block
            for (; j + 1 < n && full_block(p0, lo[j], hi[j]) && full_block(p0, lo[j + 1], hi[j + 1]); j += 2) {
                v16 e[2];
                if (dh == 64) dots16_full<2, 4>(q + j, kh + p0 * dh, e);
                else dots16_full<2, 8>(q + j, kh + p0 * dh, e);
                for (int i = 0; i < 2; ++i) {
                    e[i] = e[i] * splat(scale);
                    std::memcpy(sc[j + i] + p0, &e[i], sizeof e[i]);
                }
            }
        for (; j < n; ++j) {
            if (p0 + 16 <= lo[j] || p0 >= hi[j]) continue;
            const v16 e = (first != 0 || count != 16 ? dots16<false>(q[j], kh + p0 * dh, dh, first, count)
                           : dh == 64                ? dots16<true, 4>(q[j], kh + p0 * dh, dh, 0, 16)
                           : dh == 128               ? dots16<true, 8>(q[j], kh + p0 * dh, dh, 0, 16)
                                                     : dots16<true>(q[j], kh + p0 * dh, dh, 0, 16)) *
                          splat(scale);
            if (full_block(p0, lo[j], hi[j])) std::memcpy(sc[j] + p0, &e, sizeof e);  // (first = 0, count = 16)
            else edge_store(sc[j], p0, lo[j], hi[j], e);
        }
    }
    for (int64_t j = 0; j < n; ++j) softmax(sc[j], lo[j], hi[j]);
    if (dh == 64) weigh_values<4>(vh, sc, out, lo, hi, n, lo_all, hi_all);  // each value row once for all the queries
    else if (dh == 128) weigh_values<8>(vh, sc, out, lo, hi, n, lo_all, hi_all);
    else {
        for (int64_t j = 0; j < n; ++j)
            for (int64_t i = 0; i < dh; ++i) out[j][i] = 0.0f;
        for (int64_t p = lo_all; p < hi_all; ++p) {
            const float* v = vh + p * dh;
            for (int64_t j = 0; j < n; ++j) {
                if (p < lo[j] || p >= hi[j]) continue;
                const float w = sc[j][p];
                float* o = out[j];
                for (int64_t i = 0; i < dh; ++i) o[i] = std::fma(w, v[i], o[i]);
            }
        }
    }
    if (quantized)
        for (int64_t j = 0; j < n; ++j)
            quantize_cols(m, out[j], hq * dh, t0 + (first + j) / rep, (g * rep + (first + j) % rep) * dh, dh);
}

constexpr int64_t SILU_COLUMNS = 64;  // a token's gate columns one job of the SiLU loop takes: whole vectors and blocks
static_assert(SILU_COLUMNS % 16 == 0 && SILU_COLUMNS % QBLOCK == 0, "a SiLU piece is whole vectors and blocks");

enum Skip : int { SKIP_ATTENTION = 1, SKIP_PRODUCTS = 2 };  // parts `forward` leaves out (`specrpc_forward_row`)

// The T tokens `tokens`, token t at position pos[t] of KV slot slot[t] (a batch of rows: each row consecutive
// positions of its own slot, the slots distinct): writes their K/V there first, then each token attends causally to
// its slot's positions up to its own; leaves float32 logits of the tokens `rows` lists in `logits` [n_logits, vocab].
// Returns 0, or -1 when an argument is out of range (nothing written). `skip` (`SKIP_ATTENTION`, `SKIP_PRODUCTS`)
// leaves those parts out, for timing alone (`specrpc_forward_row`): the logits are then meaningless.
static int forward(const Model* m, const int64_t* tokens, const int64_t* pos_of, const int64_t* slot_of, int64_t T,
                   const int64_t* rows, int64_t n_logits, float* logits, int threads, int skip = 0) {
    if (T < 1 || T > m->max_tokens || T > 64 || n_logits < 1 || n_logits > T || m->dh > 1024 || m->dh % 2) return -1;
    for (int64_t t = 0; t < T; ++t)
        if (tokens[t] < 0 || tokens[t] >= m->vocab || pos_of[t] < 0 || pos_of[t] >= m->capacity || slot_of[t] < 0 ||
            slot_of[t] >= m->slots)
            return -1;
    for (int64_t i = 0; i < n_logits; ++i)
        if (rows[i] < 0 || rows[i] >= T) return -1;
    const int64_t d = m->d, hq = m->hq, hkv = m->hkv, dh = m->dh, ffn = m->ffn, cap = m->capacity;
    const int64_t rep = hq / hkv, nqkv = (hq + 2 * hkv) * dh, nheads = hq + 2 * hkv;
    const float scale = 1.0f / std::sqrt((float)dh);
    for (int64_t t = 0; t < T; ++t) std::memcpy(m->x + t * d, m->embed + tokens[t] * d, d * sizeof(float));
    int64_t row_start[64], row_end[64], n_rows = 0;  // the batch's rows: runs of tokens on one slot
    for (int64_t t = 0; t < T; ++t)
        if (t == 0 || slot_of[t] != slot_of[t - 1]) row_start[n_rows++] = t;
    for (int64_t r = 0; r < n_rows; ++r) row_end[r] = r + 1 < n_rows ? row_start[r + 1] : T;
    int64_t longest = 0;
    for (int64_t r = 0; r < n_rows; ++r) longest = row_end[r] - row_start[r] > longest ? row_end[r] - row_start[r] : longest;
    // attention's jobs: a row's queries on one KV head in equal shares of at most QUERIES, and at least one job a
    // thread (a draft's one KV head at one token: 4 queries, in 2 jobs for 2 threads rather than 1); each query is
    // attended the same way in any share
    int64_t chunks = (longest * rep + QUERIES - 1) / QUERIES;
    if (n_rows * hkv * chunks < threads) chunks = (threads + n_rows * hkv - 1) / (n_rows * hkv);
    if (chunks > longest * rep) chunks = longest * rep;
    const int64_t n_jobs = n_rows * hkv * chunks;
    const int64_t silu_pieces = (ffn + SILU_COLUMNS - 1) / SILU_COLUMNS;  // per token
    // a product, or where `skip` leaves products out only the barrier it ends in
    auto product = [&](Weight w, const float* b, const float* x, int64_t ldx, float* y, int64_t n, int64_t rows_out,
                       int64_t cols, bool add) {
        if (skip & SKIP_PRODUCTS) {
#pragma omp barrier
        } else {
            gemm(m, w, b, x, ldx, y, n, rows_out, cols, add);
        }
    };
#pragma omp parallel num_threads(threads)
    {
        for (int64_t l = 0; l < m->layers; ++l) {
            const Layer& L = m->layer[l];
            const Weight qkv{L.qkv, L.qkv_scale}, o{L.o, L.o_scale}, up{L.up, L.up_scale}, down{L.down, L.down_scale};
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; ++t) norm_input(m, m->x + t * d, L.attn_norm, t, qkv);
            product(qkv, L.qkv_bias, m->h, d, m->qkv, T, nqkv, d, false);
#pragma omp for schedule(static)
            for (int64_t tj = 0; tj < T * nheads; ++tj) {  // q and k heads: norm, rotary; k and v into the cache
                const int64_t t = tj / nheads, j = tj % nheads, pos = pos_of[t];
                float* kc = m->k_cache + ((l * m->slots + slot_of[t]) * hkv) * cap * dh;  // [hkv, cap, dh]
                float* vc = m->v_cache + ((l * m->slots + slot_of[t]) * hkv) * cap * dh;
                float* head = m->qkv + t * nqkv + j * dh;
                if (j < hq + hkv) {
                    if (L.qk_norm) rms_norm(head, L.qk_norm + j * dh, head, dh, m->eps);
                    rope(head, m->cos + pos * dh, m->sin + pos * dh, dh);
                }
                if (j >= hq) {
                    const int64_t g = (j - hq) % hkv;
                    float* cache = (j < hq + hkv ? kc : vc) + (g * cap + pos) * dh;
                    std::memcpy(cache, head, dh * sizeof(float));
                }
            }
#pragma omp for schedule(dynamic)
            for (int64_t job = 0; job < n_jobs; ++job)  // a share of a row's queries on one KV head
                if (!(skip & SKIP_ATTENTION))
                    attend(m, L, l, pos_of, slot_of, row_start[job / (hkv * chunks)], row_end[job / (hkv * chunks)],
                           job / chunks % hkv, job % chunks, chunks, scale, quantizes(o) && dh % QBLOCK == 0);
            if (quantizes(o) && dh % QBLOCK != 0) {  // a head's output ends inside a block: the whole rows after it
#pragma omp for schedule(static)
                for (int64_t t = 0; t < T; ++t) quantize_cols(m, m->att + t * hq * dh, hq * dh, t, 0, hq * dh);
            }
            product(o, L.o_bias, m->att, hq * dh, m->x, T, d, hq * dh, true);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; ++t) norm_input(m, m->x + t * d, L.mlp_norm, t, up);
            product(up, L.up_bias, m->h, d, m->up, T, 2 * ffn, d, false);
            // the gated SiLU in place over each row's gate half, which down reads (rows 2 ffn apart), in pieces of
            // SILU_COLUMNS columns (whole quantization blocks), each quantized where it is written
#pragma omp for schedule(static)
            for (int64_t tb = 0; tb < T * silu_pieces; ++tb) {
                const int64_t t = tb / silu_pieces, i0 = tb % silu_pieces * SILU_COLUMNS;
                const int64_t n = ffn - i0 < SILU_COLUMNS ? ffn - i0 : SILU_COLUMNS;
                float* row = m->up + t * 2 * ffn;
                for (int64_t i = i0; i < i0 + n; i += 16) silu_gate(row, ffn, i, i0 + n - i < 16 ? i0 + n - i : 16);
                if (quantizes(down)) quantize_cols(m, row + i0, ffn, t, i0, n);
            }
            product(down, L.down_bias, m->up, 2 * ffn, m->x, T, d, ffn, true);
        }
        const Weight head{m->head, m->head_scale};
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_logits; ++i) norm_input(m, m->x + rows[i] * d, m->norm, i, head);
        product(head, nullptr, m->h, d, logits, n_logits, m->vocab, d, false);
    }
    return 0;
}

// Columns per group of an int8 panel (`pack_int8_groups`): 4 where int8 products multiply int8 activations (VNNI,
// AVX2), else 1.
extern "C" int specrpc_int8_group() { return INT8_GROUP; }

// What int8 products multiply with in this build (SPECRPC_INT8_DOT): 1 AVX-512 VNNI, 2 AVX2's byte multiply-adds, 3
// AVX-VNNI, 0 none (the weights widened to float).
extern "C" int specrpc_int8_dot() { return SPECRPC_INT8_DOT; }

// Columns an int8 panel's rows are padded to a multiple of (`pack_int8_groups`): the activation block, else 1.
extern "C" int specrpc_int8_block() { return QBLOCK; }

// Whether int8 products may run on AMX tiles in this process (`gemm_amx`; asks Linux for the tile state once): 1, or
// 0 (no AMX here) or -1 (Linux refused it), as `amx_permitted`. Where it is 1, a model's `amx_from` picks the products
// that do.
extern "C" int specrpc_amx_enable() {
#if SPECRPC_AMX && defined(__AVX512VNNI__) && defined(__AVX512F__)
    static const int permitted = amx_permitted();
    amx_ready = permitted == 1;
    return permitted;
#else
    return 0;
#endif
}

// A check of the AMX products against VNNI's on made-up weights and activations, for 1 .. 40 tokens (more than 16 take
// the tiles 16 tokens at a time) on `threads` threads, with rows that do not fill a panel and a bias: 0 where every
// output is the same bits, the first token count that differs otherwise, -1 where AMX cannot run here. Run by `python
// -m specrpc.native --amx-check` in a process of its own before a server relies on the tiles (a fault there costs that
// process, not the server).
extern "C" int specrpc_amx_check(int threads) {
#if SPECRPC_AMX && defined(__AVX512VNNI__) && defined(__AVX512F__)
    if (specrpc_amx_enable() != 1) return -1;
    constexpr int64_t rows = 5 * LANES + 7, cols = 8 * QBLOCK + 5;  // 6 panels (the last partial), 9 blocks
    constexpr int64_t kq = (cols + QBLOCK - 1) / QBLOCK * QBLOCK, nb = kq / QBLOCK;
    constexpr int64_t n_panels = (rows + LANES - 1) / LANES;
    static uint8_t w[n_panels * kq * LANES];
    constexpr int64_t most = 40;
    static float scale[rows], bias[rows], y_vnni[most * rows], y_amx[most * rows], xs[most * nb];
    static int8_t xq[most * kq];
    static int32_t xsum[most * nb];
    uint32_t state = 12345;
    auto next = [&state]() { return state = state * 1664525u + 1013904223u; };
    for (auto& v : w) v = static_cast<uint8_t>(next() >> 24);
    for (int64_t n = 0; n < rows; ++n) scale[n] = 1e-3f * (1 + next() % 97), bias[n] = 1e-2f * (int(next() % 41) - 20);
    for (int64_t t = 0; t < most; ++t) {
        for (int64_t k = 0; k < kq; ++k) xq[t * kq + k] = k < cols ? static_cast<int8_t>(next() >> 24) : 0;
        for (int64_t blk = 0; blk < nb; ++blk) {
            xs[t * nb + blk] = 1e-2f * (1 + next() % 89);
            int32_t sum = 0;
            for (int64_t k = blk * QBLOCK; k < (blk + 1) * QBLOCK; ++k) sum += xq[t * kq + k];
            xsum[t * nb + blk] = sum;
        }
    }
    Model m{};
    m.xq = xq, m.xs = xs, m.xsum = xsum, m.kq = kq;
    const Weight weight{w, scale};
    for (int64_t T = 1; T <= most; ++T) {
        for (int64_t i = 0; i < T * rows; ++i) y_vnni[i] = y_amx[i] = 0.5f * i;  // `add` onto the same values
        m.amx_from = 0;
#pragma omp parallel num_threads(threads)
        gemm_q<NONE>(&m, weight, bias, y_vnni, T, rows, cols, true);
        m.amx_from = 1;
#pragma omp parallel num_threads(threads)
        gemm_q<NONE>(&m, weight, bias, y_amx, T, rows, cols, true);
        if (std::memcmp(y_vnni, y_amx, T * rows * sizeof(float)) != 0) return static_cast<int>(T);
    }
    return 0;
#else
    (void)threads;
    return -1;
#endif
}

extern "C" int specrpc_forward(const Model* m, const int64_t* tokens, const int64_t* positions, const int64_t* slots,
                               int64_t T, const int64_t* rows, int64_t n_logits, float* logits, int threads) {
    return forward(m, tokens, positions, slots, T, rows, n_logits, logits, threads);
}

// `forward` of one row: the T tokens `tokens` at positions start.. of `slot`, logits of its last n_logits tokens.
// `skip` (`Skip`; 0 for every forward that serves) leaves parts out, for `specrpc bench floor`'s account of where a
// forward's time goes: its logits are then meaningless, and so are the K/V it writes where the products are left out.
extern "C" int specrpc_forward_row(const Model* m, const int64_t* tokens, int64_t T, int64_t start, int64_t slot,
                                   int64_t n_logits, float* logits, int threads, int skip) {
    int64_t positions[64], slots[64], rows[64];
    if (T < 1 || T > 64 || n_logits < 1 || n_logits > T) return -1;
    for (int64_t t = 0; t < T; ++t) {
        positions[t] = start + t;
        slots[t] = slot;
    }
    for (int64_t i = 0; i < n_logits; ++i) rows[i] = T - n_logits + i;
    return forward(m, tokens, positions, slots, T, rows, n_logits, logits, threads, skip);
}

// The index of the first of equal maxima, as torch's argmax.
static int64_t argmax(const float* logits, int64_t n) {
    int64_t best = 0;
    for (int64_t v = 1; v < n; ++v)
        if (logits[v] > logits[best]) best = v;
    return best;
}

struct Controls;  // transform.cpp's
extern "C" int specrpc_transform(const Controls* c, const float* logits, float* out, int64_t rows, int64_t vocab,
                                 int64_t first, const int64_t* window_ids, const int64_t* window_counts,
                                 int64_t n_window, const int64_t* drafted, const int64_t* gone,
                                 const int64_t* gone_end, int64_t banned);

// The logits transform of a greedy draft (native.DraftTransform): transform.cpp's, at each drafted position, from
// the committed window's counts and the tokens drafted before it, so the argmax is the transformed one.
struct DraftTransform {
    const Controls* controls;
    const int64_t* window_ids;     // [n_window] the committed window's tokens
    const int64_t* window_counts;  // [n_window] and their counts
    int64_t n_window;
    const int64_t* gone;           // what slides out of a last-N window, position by position (all committed)
    const int64_t* gone_end;       // [steps + 1] gone[gone_end[p - 1] .. gone_end[p]) leaves at position p
    int64_t banned;                // leading positions with end-of-text banned
    float* scratch;                // [vocab]
};

// The argmax of the logits [vocab] at drafted position i (transformed where `t` is given, after drafted[0 .. i)),
// or -1 where the transform refuses a token id.
static int64_t pick(const Model* m, const DraftTransform* t, const float* logits, const int64_t* drafted, int64_t i) {
    if (t == nullptr) return argmax(logits, m->vocab);
    if (specrpc_transform(t->controls, logits, t->scratch, 1, m->vocab, i, t->window_ids, t->window_counts,
                          t->n_window, drafted, t->gone, t->gone_end, i < t->banned ? 1 : 0) != 0)
        return -1;
    return argmax(t->scratch, m->vocab);
}

// A greedy draft: the `n_feed` tokens `feed` at positions start.. of `slot` (a catch-up on what the draft has not
// seen), then `steps` more one-token forwards, each fed the argmax of the one before: out [steps + 1] holds the
// argmax after the feed and each step's, of the logits as `transform` leaves them where it is given (nullptr: as
// they are). `logits` [vocab] is scratch. Returns 0, or -1 as `forward` does (the positions written before it stay
// written) or where the transform refuses a token id.
extern "C" int specrpc_greedy(const Model* m, const int64_t* feed, int64_t n_feed, int64_t start, int64_t slot,
                              int64_t steps, int64_t* out, float* logits, int threads, const DraftTransform* transform) {
    if (n_feed < 1 || n_feed > m->max_tokens) return -1;
    int64_t positions[64], slots[64];
    if (m->max_tokens > 64) return -1;
    for (int64_t t = 0; t < n_feed; ++t) {
        positions[t] = start + t;
        slots[t] = slot;
    }
    const int64_t last = n_feed - 1, row = 0;
    if (forward(m, feed, positions, slots, n_feed, &last, 1, logits, threads) != 0) return -1;
    if ((out[0] = pick(m, transform, logits, out, 0)) < 0) return -1;
    for (int64_t i = 0; i < steps; ++i) {
        const int64_t pos = start + n_feed + i;
        if (forward(m, out + i, &pos, &slot, 1, &row, 1, logits, threads) != 0) return -1;
        if ((out[i + 1] = pick(m, transform, logits, out, i + 1)) < 0) return -1;
    }
    return 0;
}

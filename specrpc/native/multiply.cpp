// The multiply rate of `specrpc bench floor` (specrpc/bench/floor.py): the instruction the native step's products
// multiply with, run from registers on every thread with more independent accumulators than its latency needs, so
// that only its throughput sets the pace. A forward's multiply-adds ÷ this rate bound its time from below, as its
// weight bytes ÷ the read rate do: a verify of several tokens reads the weights once but multiplies each token. Float
// products: 16-lane fused multiply-adds (one AVX-512 register, two AVX2 ones); int8 products with VNNI: vpdpbusd, 64
// multiply-adds an instruction; on AVX2: AVX-VNNI's vpdpbusd (`dpbusd8`), else `dot_bytes`, 32. Built into the same
// library as decode.cpp (specrpc/native/__init__.py).
#include <omp.h>

#include <cstdint>

#include "vector.h"

constexpr int CHAINS = 10;  // accumulators in flight: latency 4-5 × up to 2 issued a cycle, with room

// `rounds` × CHAINS float multiply-adds of 16 lanes on each of `threads` threads: the multiply-adds done (the values
// summed into `sink` so that none is left out).
extern "C" double specrpc_multiply_float(int64_t rounds, int threads, double* sink) {
    double total = 0.0, done = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total, done)
    {
        float lanes[16];
        for (int i = 0; i < 16; ++i) lanes[i] = 1e-3f * static_cast<float>(omp_get_thread_num() + i);
        const v16 a = splat(0.999f), b = load16(lanes);
        v16 acc[CHAINS];
        for (int c = 0; c < CHAINS; ++c) acc[c] = b + splat(static_cast<float>(c));  // distinct chains: none folded
        for (int64_t r = 0; r < rounds; ++r) {
            for (int c = 0; c < CHAINS; ++c) acc[c] = fma16(acc[c], a, b);  // each round on the one before
        }
        for (int c = 0; c < CHAINS; ++c)
            for (int i = 0; i < 16; ++i) total += acc[c][i];
        done += static_cast<double>(rounds) * CHAINS * 16;
    }
    *sink = total;
    return done;
}

// As `specrpc_multiply_float` for the instructions the int8 products multiply with, 64 multiply-adds a chain and
// round: VNNI's vpdpbusd; on AVX2 without AVX-512, AVX-VNNI's (`dpbusd8`) or else `dot_bytes` on two halves of 32
// (its sign taken from the chain's own sums, so that no step can be hoisted out of the loop). 0 where this build's
// int8 products do not multiply int8 activations (AVX-512 without VNNI: they widen the weights to float, the float
// rate).
extern "C" double specrpc_multiply_int8(int64_t rounds, int threads, double* sink) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    double total = 0.0, done = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total, done)
    {
        __m256i acc[CHAINS][2];
        const __m256i wa = _mm256_set1_epi32(0x01020304);
        const __m256i x = _mm256_set1_epi32(0x01010101 * (omp_get_thread_num() + 1));
        for (int c = 0; c < CHAINS; ++c) acc[c][0] = acc[c][1] = _mm256_set1_epi32(c - 5);
        for (int64_t r = 0; r < rounds; ++r) {
            for (int c = 0; c < CHAINS; ++c)
                for (int h = 0; h < 2; ++h) {
#if SPECRPC_AVX_VNNI
                    acc[c][h] = dpbusd8(acc[c][h], wa, x);
#else
                    acc[c][h] = dot_bytes(acc[c][h], wa, x, acc[c][h]);
#endif
                }
        }
        for (int c = 0; c < CHAINS; ++c)
            for (int h = 0; h < 2; ++h) {
                int32_t lanes[8];
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), acc[c][h]);
                for (int32_t v : lanes) total += v;
            }
        done += static_cast<double>(rounds) * CHAINS * 64;
    }
    *sink = total;
    return done;
#elif defined(__AVX512VNNI__) && defined(__AVX512F__)
    double total = 0.0, done = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total, done)
    {
        __m512i acc[CHAINS];
        __m512i w = _mm512_set1_epi32(0x01020304), x = _mm512_set1_epi32(0x01010101 * (omp_get_thread_num() + 1));
        for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_set1_epi32(c);
        for (int64_t r = 0; r < rounds; ++r) {
            for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], w, x);
        }
        for (int c = 0; c < CHAINS; ++c) total += _mm512_reduce_add_epi32(acc[c]);
        done += static_cast<double>(rounds) * CHAINS * 64;
    }
    *sink = total;
    return done;
#else
    (void)rounds, (void)threads;
    *sink = 0.0;
    return 0.0;
#endif
}

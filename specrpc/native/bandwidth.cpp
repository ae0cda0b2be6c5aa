// The read bandwidth of `specrpc bench floor` (specrpc/bench/floor.py): a float32 buffer read the way the native
// decode step reads its weights, so that its rate bounds the step's. The threads split the buffer in the same
// contiguous shares on every pass (a share stays in its thread's own caches where it fits, as a model's panels do from
// step to step), each read with 16-lane vector loads into several independent accumulators and prefetched ahead as
// decode.cpp's temporal mode does. A torch sum reads a large buffer at well under this rate (its reduction kernel, no
// prefetch): as a bound it put the decode step "faster than its floor". Built into the same library as decode.cpp
// (specrpc/native/__init__.py).
#include <omp.h>

#include <cstdint>

#include "vector.h"

// Enough independent adds in flight that the loads, not the adds, set the pace: 8 registers of 16 lanes with AVX-512,
// 4 of them (8 registers of 8) with AVX2, whose 16 registers would otherwise spill.
#if defined(__AVX512F__)
constexpr int ACCUMULATORS = 8;
#else
constexpr int ACCUMULATORS = 4;
#endif
constexpr int64_t BLOCK = 16 * ACCUMULATORS;  // floats a step of the loop reads, a cache line's worth per accumulator
constexpr int64_t AHEAD = 512;                // floats ahead of the block being read that its prefetches ask for (2 KB)

// The sum of x[lo, hi) in float32 lanes (summed in double at the end).
static double sum_share(const float* x, int64_t lo, int64_t hi) {
    v16 acc[ACCUMULATORS] = {};
    int64_t i = lo;
    for (; i + BLOCK <= hi; i += BLOCK) {
        for (int a = 0; a < ACCUMULATORS; ++a) {
            __builtin_prefetch(x + i + AHEAD + 16 * a, 0, 3);
            acc[a] += load16(x + i + 16 * a);
        }
    }
    double total = 0.0;
    for (int a = 0; a < ACCUMULATORS; ++a)
        for (int lane = 0; lane < 16; ++lane) total += acc[a][lane];
    for (; i < hi; ++i) total += x[i];
    return total;
}

// x[0 .. n) read `passes` times on `threads` threads, each thread its own contiguous share (whole blocks; the last
// thread also takes the tail) on every pass: the sum of all the values read, returned so that no read is left out.
extern "C" double specrpc_read(const float* x, int64_t n, int64_t passes, int threads) {
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num(), blocks = n / BLOCK;
        const int64_t lo = me * blocks / parts * BLOCK;
        const int64_t hi = me + 1 == parts ? n : (me + 1) * blocks / parts * BLOCK;
        for (int64_t p = 0; p < passes; ++p) {
            __asm__ __volatile__("" ::: "memory");  // every pass reads the buffer again: no pass is folded into another
            total += sum_share(x, lo, hi);
        }
    }
    return total;
}

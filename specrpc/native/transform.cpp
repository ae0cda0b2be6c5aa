// The per-position logits transform (specrpc/engine/logits_transform.py: logit_bias, repetition / frequency /
// presence penalties with each row's own counts, end-of-text bans), min-p (specrpc/engine/sampling.py) and a
// grammar's bitmask (specrpc/engine/constraint.py), each one single-threaded pass over the rows: a verify's [k+1, V] costs a few tens of microseconds here, where a dozen small
// torch ops cost ten times that. Built into the same library as decode.cpp (specrpc/native/__init__.py).
//
// The values are the torch path's bits: every element goes through the same float32 operations in the same order,
// each rounded on its own. This file is compiled without contracting a * b - c into one fused multiply-add (the
// pragmas below), which would round once where torch rounds twice.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

// Which penalties apply (Controls::penalties), as SamplingParams turns them on.
enum Penalty : int64_t { REPETITION = 1, FREQUENCY = 2, PRESENCE = 4 };

struct Controls {  // one generation's controls on logits of one vocabulary size (native.Controls)
    const int64_t* bias_ids;   // [B] distinct, each < vocab
    const float* bias_values;  // [B] added to their logits
    int64_t n_bias;
    const int64_t* ends;       // [E] end-of-text ids, each < vocab
    int64_t n_ends;
    int64_t penalties;         // `Penalty` bits
    float repetition;          // a seen token's logit divided by it (multiplied when not positive)
    float frequency;           // subtracted once per occurrence
    float presence;            // subtracted once from a seen token's logit
};

// One logit under the penalties with its token's count at this position (logits_transform._penalized).
static inline float penalized(const Controls* c, float v, int32_t count) {
    const float n = static_cast<float>(count);
    const bool seen = n > 0.0f;
    if ((c->penalties & REPETITION) && seen) v = v > 0.0f ? v / c->repetition : v * c->repetition;
    if (c->penalties & FREQUENCY) {
        const float f = c->frequency * n;
        v = v - f;
    }
    if (c->penalties & PRESENCE) {
        const float p = c->presence * (seen ? 1.0f : 0.0f);
        v = v - p;
    }
    return v;
}

// The transform of logits [rows, vocab] at positions first .. first + rows - 1 along a drafted path into out (row r:
// after the committed context and drafted[0 .. first + r)): logit_bias, then the penalties on the tokens counted
// (the window's `window_ids` with `window_counts` at position 0, each drafted token counted from the position after
// it, the tokens gone[gone_end[p - 1] .. gone_end[p]) no longer counted from position p on, as they slide out of a
// last-N window), then end-of-text banned on the first `banned` rows. The penalties touch every token the window or
// a drafted token (of drafted[0 .. first + rows - 1)) names, as the torch path's columns. Returns 0, or -1 where a
// token id is outside the vocabulary (nothing written then).
extern "C" int specrpc_transform(const Controls* c, const float* logits, float* out, int64_t rows, int64_t vocab,
                                 int64_t first, const int64_t* window_ids, const int64_t* window_counts,
                                 int64_t n_window, const int64_t* drafted, const int64_t* gone,
                                 const int64_t* gone_end, int64_t banned) {
    const int64_t steps = first + rows - 1;  // drafted tokens before the last row
    std::vector<int64_t> listed;             // the tokens the penalties touch
    std::vector<int32_t> count;              // [vocab] each listed token's count at the current position, else -1
    if (c->penalties) {
        count.assign(vocab, -1);
        listed.reserve(n_window + steps);
        for (int64_t i = 0; i < n_window; ++i) {
            const int64_t t = window_ids[i];
            if (t < 0 || t >= vocab) return -1;
            if (count[t] < 0) listed.push_back(t);
            count[t] = static_cast<int32_t>(window_counts[i]);
        }
        for (int64_t i = 0; i < steps; ++i) {
            const int64_t t = drafted[i];
            if (t < 0 || t >= vocab) return -1;
            if (count[t] < 0) {
                count[t] = 0;
                listed.push_back(t);
            }
        }
        for (int64_t i = 0; i < gone_end[steps]; ++i)  // what slides out was counted: the window's or a draft's
            if (gone[i] < 0 || gone[i] >= vocab || count[gone[i]] < 0) return -1;
    }
    const float ban = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p <= steps; ++p) {
        if (p > 0 && c->penalties) {
            ++count[drafted[p - 1]];
            for (int64_t i = gone_end[p - 1]; i < gone_end[p]; ++i) --count[gone[i]];
        }
        if (p < first) continue;
        const int64_t r = p - first;
        float* o = out + r * vocab;
        std::memcpy(o, logits + r * vocab, vocab * sizeof(float));
        for (int64_t i = 0; i < c->n_bias; ++i) {
            const int64_t t = c->bias_ids[i];
            o[t] = o[t] + c->bias_values[i];
        }
        for (const int64_t t : listed) o[t] = penalized(c, o[t], count[t]);
        if (r < banned)
            for (int64_t i = 0; i < c->n_ends; ++i) o[c->ends[i]] = ban;
    }
    return 0;
}

typedef float f16v __attribute__((vector_size(64)));    // 16 lanes
typedef int32_t i16v __attribute__((vector_size(64)));  // their comparison masks

// The largest of x[0 .. n) (-inf for none), and whether any is NaN (torch's max is NaN then).
static float row_max(const float* x, int64_t n, bool* nan) {
    float top = -std::numeric_limits<float>::infinity();
    bool bad = false;
    int64_t v = 0;
    if (n >= 16) {
        f16v m;
        std::memcpy(&m, x, sizeof m);
        i16v b = m != m;
        for (v = 16; v + 16 <= n; v += 16) {
            f16v y;
            std::memcpy(&y, x + v, sizeof y);
            b |= y != y;
            m = y > m ? y : m;
        }
        for (int i = 0; i < 16; ++i) {
            bad |= b[i] != 0;
            top = m[i] > top ? m[i] : top;
        }
    }
    for (; v < n; ++v) {
        bad |= x[v] != x[v];
        top = x[v] > top ? x[v] : top;
    }
    *nan = bad;
    return top;
}

// Min-p in place on tempered logits [rows, vocab] (sampling._min_p): -inf where a logit is below the row's largest
// plus log(min_p), the threshold lowered to the keep-th largest logit when keep > 1. A row holding a NaN is left as
// it is (torch's threshold is NaN there, and nothing compares below it).
extern "C" void specrpc_min_p(float* scaled, int64_t rows, int64_t vocab, float log_min_p, int64_t keep) {
    const float drop = -std::numeric_limits<float>::infinity();
    std::vector<float> sorted;  // a row's copy, for its keep-th largest
    keep = std::min(keep, vocab);
    for (int64_t r = 0; r < rows; ++r) {
        float* x = scaled + r * vocab;
        bool nan = false;
        const float top = row_max(x, vocab, &nan);
        if (nan) continue;
        float threshold = top + log_min_p;
        if (keep > 1) {
            sorted.assign(x, x + vocab);
            std::nth_element(sorted.begin(), sorted.begin() + (keep - 1), sorted.end(), std::greater<float>());
            threshold = std::min(threshold, sorted[keep - 1]);
        }
        for (int64_t v = 0; v < vocab; ++v) x[v] = x[v] < threshold ? drop : x[v];
    }
}

// A grammar's bitmask on logits [rows, vocab], written to out (which may be logits itself), as sampling.mask_logits
// of constraint.unpack_mask: row r keeps the logits of the tokens its mask allows (the n_words int32 words at
// words + index[r] * n_words, bit t % 32 of word t / 32 for token t) and is -inf elsewhere; ids from mask_vocab
// (<= 32 n_words) on are forbidden. Each logit is copied or replaced, never computed: the torch path's bits.
extern "C" void specrpc_mask(const float* logits, float* out, int64_t rows, int64_t vocab, const int32_t* words,
                             const int64_t* index, int64_t n_words, int64_t mask_vocab) {
    const float ban = -std::numeric_limits<float>::infinity();
    const int64_t masked = std::min(vocab, mask_vocab);  // tokens the mask speaks for
    for (int64_t r = 0; r < rows; ++r) {
        const float* x = logits + r * vocab;
        float* o = out + r * vocab;
        const int32_t* m = words + index[r] * n_words;
        int64_t v = 0;
        for (; v + 32 <= masked; v += 32) {
            const uint32_t bits = static_cast<uint32_t>(m[v / 32]);
            for (int j = 0; j < 32; ++j) o[v + j] = (bits >> j) & 1u ? x[v + j] : ban;
        }
        for (; v < masked; ++v) o[v] = (static_cast<uint32_t>(m[v / 32]) >> (v % 32)) & 1u ? x[v] : ban;
        for (; v < vocab; ++v) o[v] = ban;
    }
}

// One-token decode step of a Llama-family model (RMSNorm, gated SiLU MLP, RoPE, GQA, optional biases, Qwen3's
// q/k norms, sliding windows) in float32, as one OpenMP parallel region: the matrix-vector products split their
// output rows across the threads, everything else runs between them without leaving the region. Built and loaded by
// specrpc/native/__init__.py (ctypes; torch's own OpenMP runtime), called by specrpc/models/llama.py for one-token
// forwards. Weights are row-major [N, K] (the checkpoint's layout): each output is a dot product over a contiguous
// row, the weights are read once, in order.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

extern "C" {

struct Layer {
    const float* attn_norm;  // [d]
    const float* qkv;        // [(hq + 2 hkv) dh, d]
    const float* qkv_bias;   // [(hq + 2 hkv) dh] or null
    const float* qk_norm;    // [hq + hkv, dh] or null
    const float* o;          // [d, hq dh]
    const float* o_bias;     // [d] or null
    const float* mlp_norm;   // [d]
    const float* up;         // [2 ffn, d]: gate rows, then up rows
    const float* up_bias;    // [2 ffn] or null
    const float* down;       // [d, ffn]
    const float* down_bias;  // [d] or null
    int64_t window;          // sliding window, 0 = full causal attention
};

struct Model {
    int64_t d, hq, hkv, dh, ffn, vocab, layers;
    int64_t slots, capacity;  // KV cache [L, slots, hkv, capacity, dh]
    float eps;
    const float* embed;       // [vocab, d]
    const float* norm;        // [d]
    const float* head;        // [vocab, d]
    const float* cos;         // [capacity, dh]
    const float* sin;         // [capacity, dh], sign folded: rope(x) = x cos + roll(x, dh/2) sin
    const Layer* layer;       // [layers]
    float* k_cache;
    float* v_cache;
    float* x;                 // [d] work buffers
    float* h;                 // [d]
    float* qkv;               // [(hq + 2 hkv) dh]
    float* att;               // [hq dh]
    float* up;                // [2 ffn]
    float* scores;            // [hq, capacity]
};

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

static inline void gemv(const float* __restrict w, const float* __restrict b, const float* __restrict x,
                        float* __restrict y, int64_t rows, int64_t cols, bool add) {
#pragma omp for schedule(static)
    for (int64_t n = 0; n < rows; ++n) {
        float v = dot(w + n * cols, x, cols) + (b ? b[n] : 0.0f);
        y[n] = add ? y[n] + v : v;
    }
}

static inline void rms_norm(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t n,
                            float eps) {
    float ss = dot(x, x, n);
    float r = 1.0f / std::sqrt(ss / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * (w ? w[i] : 1.0f);
}

// rope(x) at position pos, in place, for one head of dh values.
static inline void rope(float* __restrict x, const float* __restrict c, const float* __restrict s, int64_t dh) {
    const int64_t half = dh / 2;
    float tmp[1024];
    for (int64_t i = 0; i < dh; ++i) tmp[i] = x[i];
    for (int64_t i = 0; i < dh; ++i) x[i] = tmp[i] * c[i] + tmp[(i + half) % dh] * s[i];
}

// The token `token` at position `pos` of KV slot `slot`: writes its K/V there, leaves float32 logits [vocab] in
// `logits`. Returns 0, or -1 when the arguments are out of range (nothing written).
int specrpc_decode(const Model* m, int64_t token, int64_t pos, int64_t slot, float* logits, int threads) {
    if (token < 0 || token >= m->vocab || pos < 0 || pos >= m->capacity || slot < 0 || slot >= m->slots ||
        m->dh > 1024 || m->dh % 2)
        return -1;
    const int64_t d = m->d, hq = m->hq, hkv = m->hkv, dh = m->dh, ffn = m->ffn, cap = m->capacity;
    const int64_t rep = hq / hkv, nqkv = (hq + 2 * hkv) * dh;
    const float scale = 1.0f / std::sqrt((float)dh);
    const float* cs = m->cos + pos * dh;
    const float* sn = m->sin + pos * dh;
    std::memcpy(m->x, m->embed + token * d, d * sizeof(float));
#pragma omp parallel num_threads(threads)
    {
        for (int64_t l = 0; l < m->layers; ++l) {
            const Layer& L = m->layer[l];
            const int64_t lo = L.window > 0 && pos + 1 > L.window ? pos + 1 - L.window : 0;
            float* kc = m->k_cache + ((l * m->slots + slot) * hkv) * cap * dh;  // [hkv, cap, dh]
            float* vc = m->v_cache + ((l * m->slots + slot) * hkv) * cap * dh;
#pragma omp single
            rms_norm(m->x, L.attn_norm, m->h, d, m->eps);
            gemv(L.qkv, L.qkv_bias, m->h, m->qkv, nqkv, d, false);
#pragma omp for schedule(static)
            for (int64_t j = 0; j < hq + 2 * hkv; ++j) {  // q and k heads: norm, rotary; k and v into the cache
                float* head = m->qkv + j * dh;
                if (j < hq + hkv) {
                    if (L.qk_norm) rms_norm(head, L.qk_norm + j * dh, head, dh, m->eps);
                    rope(head, cs, sn, dh);
                }
                if (j >= hq) {
                    const int64_t g = (j - hq) % hkv;
                    float* cache = (j < hq + hkv ? kc : vc) + (g * cap + pos) * dh;
                    std::memcpy(cache, head, dh * sizeof(float));
                }
            }
#pragma omp for schedule(static)
            for (int64_t h = 0; h < hq; ++h) {  // attention of query head h on its KV head
                const float* q = m->qkv + h * dh;
                const float* kh = kc + (h / rep) * cap * dh;
                const float* vh = vc + (h / rep) * cap * dh;
                float* sc = m->scores + h * cap;
                float mx = -INFINITY;
                for (int64_t t = lo; t <= pos; ++t) {
                    sc[t] = dot(q, kh + t * dh, dh) * scale;
                    mx = sc[t] > mx ? sc[t] : mx;
                }
                float sum = 0.0f;
                for (int64_t t = lo; t <= pos; ++t) {
                    sc[t] = std::exp(sc[t] - mx);
                    sum += sc[t];
                }
                float* out = m->att + h * dh;
                for (int64_t i = 0; i < dh; ++i) out[i] = 0.0f;
                for (int64_t t = lo; t <= pos; ++t) {
                    const float p = sc[t] / sum;
                    const float* v = vh + t * dh;
#pragma omp simd
                    for (int64_t i = 0; i < dh; ++i) out[i] += p * v[i];
                }
            }
            gemv(L.o, L.o_bias, m->att, m->x, d, hq * dh, true);
#pragma omp single
            rms_norm(m->x, L.mlp_norm, m->h, d, m->eps);
            gemv(L.up, L.up_bias, m->h, m->up, 2 * ffn, d, false);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < ffn; ++i) {
                const float g = m->up[i];
                m->up[i] = g / (1.0f + std::exp(-g)) * m->up[ffn + i];
            }
            gemv(L.down, L.down_bias, m->up, m->x, d, ffn, true);
        }
#pragma omp single
        rms_norm(m->x, m->norm, m->h, d, m->eps);
        gemv(m->head, nullptr, m->h, logits, m->vocab, d, false);
    }
    return 0;
}

}  // extern "C"

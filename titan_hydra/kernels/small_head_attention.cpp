// Causal attention for head_dim 16 on CPU, forward and backward, fp32 arithmetic.
//
// Why: torch's CPU flash-attention kernel runs its q.k and p.v products as small GEMMs over
// blocks of 256 queries x 512 keys. At head_dim 16 every score costs only 16 multiply-adds, so
// the GEMM calls, the softmax passes over each block and the diagonal blocks it computes in full
// and then masks dominate. Here one 16-wide vector is one head row (or 16 keys' worth of one
// feature), the causal triangle is walked exactly in blocks of 8 (AVX2: 4) queries x 16 keys, and each
// product is a run of vector multiply-adds with a broadcast scalar. One head row is one 16-float
// vector: a GCC generic vector on AVX-512, and on AVX2 a pair of 8-float vectors (GCC keeps a
// 64-byte generic vector it has no register for in memory, op by op: ~9x slower than the pair).
//
// Layouts (per batch*head slice): q, k, v, out, grad tensors are [S, 16] fp32 rows; K^T and V^T
// are rebuilt per slice as 16-key chunks of 16 x 16 floats (one contiguous KiB per chunk, so the
// 16 feature rows of a chunk never compete for the same L1 set).
// ATen and the op registry only: torch/extension.h (pybind11 and the C++ frontend) doubles the build time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

namespace {

constexpr int D = 16;  // head dim: one vector
constexpr int C = 16;  // keys per chunk

// exp(x) for x <= 0, 0 below -87 (masked scores arrive as -inf): 2^n * 2^f, n = round(x log2 e),
// |f| <= 1/2, Taylor polynomial of 2^f to degree 6 (relative error ~2e-7, below fp32's epsilon).
template <typename F, typename I>
inline F exp_lanes(F x) {
  const F lo = F{} - 87.f;
  const F xc = x > lo ? x : lo;
  const F t = xc * 1.44269504088896341f;
  const I n = __builtin_convertvector(t - 0.5f, I);  // truncation: round-to-nearest for t <= 0
  const F f = t - __builtin_convertvector(n, F);
  F p = F{} + 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.618129107628477e-3f;
  p = p * f + 5.550410866482158e-2f;
  p = p * f + 2.402265069591007e-1f;
  p = p * f + 6.931471805599453e-1f;
  p = p * f + 1.0f;
  const I bits = (n + 127) << 23;
  F two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < lo ? F{} : p * two_n;
}

// lanes of x whose key index (first + lane) is past `query` replaced by `fill`
template <typename F, typename I>
inline F causal_lanes(F x, I lane, int64_t first, int64_t query, float fill) {
  return lane <= (int)(query - first) ? x : F{} + fill;
}

#ifdef __AVX512F__
constexpr int R = 8;   // queries per block
typedef float vec __attribute__((vector_size(64)));
typedef int ivec __attribute__((vector_size(64)));
const ivec LANES = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline vec splat(float x) { return vec{} + x; }
inline vec vmax(vec a, vec b) { return a > b ? a : b; }
inline float hsum(vec x) { float s = 0.f; for (int i = 0; i < 16; ++i) s += x[i]; return s; }
inline float hmax(vec x) { float s = x[0]; for (int i = 1; i < 16; ++i) s = std::max(s, x[i]); return s; }
inline vec vexp(vec x) { return exp_lanes<vec, ivec>(x); }
inline vec causal(vec x, int64_t first, int64_t query, float fill) { return causal_lanes(x, LANES, first, query, fill); }
inline vec load(const float* p) { vec r; std::memcpy(&r, p, sizeof r); return r; }
inline void store(float* p, vec x) { std::memcpy(p, &x, sizeof x); }
#else
constexpr int R = 4;   // queries per block: 4 accumulator pairs leave AVX2 registers for the rest
typedef float half __attribute__((vector_size(32)));
typedef int ihalf __attribute__((vector_size(32)));
const ihalf LO_LANES = {0, 1, 2, 3, 4, 5, 6, 7}, HI_LANES = {8, 9, 10, 11, 12, 13, 14, 15};

// a 16-float row as two 8-float registers, lane order lo then hi (its memory layout is the row's)
struct vec {
  half lo, hi;
  friend vec operator+(vec a, vec b) { return {a.lo + b.lo, a.hi + b.hi}; }
  friend vec operator-(vec a, vec b) { return {a.lo - b.lo, a.hi - b.hi}; }
  friend vec operator*(vec a, vec b) { return {a.lo * b.lo, a.hi * b.hi}; }
  friend vec operator-(vec a, float b) { return {a.lo - b, a.hi - b}; }
  friend vec operator*(vec a, float b) { return {a.lo * b, a.hi * b}; }
  friend vec operator*(float a, vec b) { return {a * b.lo, a * b.hi}; }
  vec& operator+=(vec b) { lo += b.lo; hi += b.hi; return *this; }
};

inline vec splat(float x) { return {half{} + x, half{} + x}; }
inline vec vmax(vec a, vec b) { return {a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi}; }
inline float hsum(vec x) { const half h = x.lo + x.hi; float s = 0.f; for (int i = 0; i < 8; ++i) s += h[i]; return s; }
inline float hmax(vec x) {
  const half h = x.lo > x.hi ? x.lo : x.hi;
  float s = h[0];
  for (int i = 1; i < 8; ++i) s = std::max(s, h[i]);
  return s;
}
inline vec vexp(vec x) { return {exp_lanes<half, ihalf>(x.lo), exp_lanes<half, ihalf>(x.hi)}; }
inline vec causal(vec x, int64_t first, int64_t query, float fill) {
  return {causal_lanes(x.lo, LO_LANES, first, query, fill), causal_lanes(x.hi, HI_LANES, first, query, fill)};
}
// half by half: one 64-byte copy through the stack would stall every load on store forwarding
inline vec load(const float* p) {
  vec r;
  std::memcpy(&r.lo, p, sizeof r.lo);
  std::memcpy(&r.hi, p + 8, sizeof r.hi);
  return r;
}
inline void store(float* p, vec x) {
  std::memcpy(p, &x.lo, sizeof x.lo);
  std::memcpy(p + 8, &x.hi, sizeof x.hi);
}
#endif
static_assert(sizeof(vec) == D * sizeof(float), "a vec is one head row");

// rows [S, 16] (fp32 or bf16) -> chunks of 16 rows transposed: dst[(j/16)*256 + d*16 + j%16],
// zero-padded; also an fp32 copy of the rows when `rows` is given
template <typename T>
void transpose_chunks(const T* src, int64_t S, int64_t Sp, float* dst, float* rows = nullptr) {
  for (int64_t j = 0; j < Sp; ++j)
    for (int d = 0; d < D; ++d) {
      const float x = j < S ? static_cast<float>(src[j * D + d]) : 0.f;
      dst[(j / C) * C * D + d * C + j % C] = x;
      if (rows != nullptr && j < S) rows[j * D + d] = x;
    }
}

template <typename T>
inline void store_row(T* dst, vec x) {
  if constexpr (std::is_same_v<T, float>) {
    store(dst, x);
  } else {
    float row[D];
    store(row, x);
    for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(row[d]);
  }
}

// s[r] = sum_d rows[r*16 + d] * chunk[d*16 .. d*16+15]: 16 keys' scores for each of R rows
inline void chunk_products(const float* rows, const float* chunk, vec* s) {
  for (int r = 0; r < R; ++r) s[r] = splat(0.f);
#pragma GCC unroll 16
  for (int d = 0; d < D; ++d) {
    const vec kd = load(chunk + d * C);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) s[r] += rows[r * D + d] * kd;
  }
}

// load R rows starting at i0 (rows past S are zero) as fp32, times `mul`
template <typename T>
inline void load_rows(const T* src, int64_t i0, int rows, float mul, float* dst) {
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < D; ++d) dst[r * D + d] = r < rows ? static_cast<float>(src[(i0 + r) * D + d]) * mul : 0.f;
}

}  // namespace

// q, k, v: [BH, S, 16] contiguous, fp32 or bf16 (computed in fp32). Returns out [BH, S, 16] in
// the inputs' dtype and the fp32 logsumexp [BH, S] of the scaled scores (what backward needs).
template <typename T>
void forward_impl(const T* Q, const T* K, const T* V, T* O, float* L, int64_t BH, int64_t S, float scale) {
  const int64_t Sp = (S + C - 1) / C * C;
  at::parallel_for(0, BH, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> kt(D * Sp), vrows(D * S), scores(R * Sp), qrows(R * D), pexp(R * C);
    for (int64_t bh = b0; bh < b1; ++bh) {
      const T* q_ = Q + bh * S * D;
      T* o_ = O + bh * S * D;
      float* l_ = L + bh * S;
      transpose_chunks(K + bh * S * D, S, Sp, kt.data());
      for (int64_t i = 0; i < S * D; ++i) vrows[i] = static_cast<float>(V[bh * S * D + i]);
      const float* v_ = vrows.data();
      for (int64_t i0 = 0; i0 < S; i0 += R) {
        const int rows = (int)std::min<int64_t>(R, S - i0);
        const int64_t nk = i0 + rows, nkp = (nk + C - 1) / C * C;  // keys any row of the block sees
        load_rows(q_, i0, rows, scale, qrows.data());
        vec mx[R], s[R];
        for (int r = 0; r < R; ++r) mx[r] = splat(-INFINITY);
        for (int64_t j = 0; j < nkp; j += C) {  // pass 1: scaled scores and their row maxima
          chunk_products(qrows.data(), kt.data() + j * D, s);
          if (j + C > i0)
            for (int r = 0; r < R; ++r) s[r] = causal(s[r], j, i0 + r, -INFINITY);
          for (int r = 0; r < R; ++r) { store(scores.data() + j * R + r * C, s[r]); mx[r] = vmax(mx[r], s[r]); }
        }
        float m[R];
        vec sum[R], acc[R];
        for (int r = 0; r < R; ++r) { m[r] = hmax(mx[r]); sum[r] = splat(0.f); acc[r] = splat(0.f); }
        for (int64_t j = 0; j < nkp; j += C) {  // pass 2: probabilities times values
          for (int r = 0; r < R; ++r) {
            const vec e = vexp(load(scores.data() + j * R + r * C) - m[r]);
            sum[r] += e;
            store(pexp.data() + r * C, e);
          }
          const int keys = (int)std::min<int64_t>(C, nk - j);
          for (int jj = 0; jj < keys; ++jj) {
            const vec vj = load(v_ + (j + jj) * D);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) acc[r] += pexp[r * C + jj] * vj;
          }
        }
        for (int r = 0; r < rows; ++r) {
          const float total = hsum(sum[r]);
          store_row(o_ + (i0 + r) * D, acc[r] * (1.f / total));
          l_[i0 + r] = m[r] + std::log(total);
        }
      }
    }
  });
}

void check_inputs(std::initializer_list<at::Tensor> ts) {
  const auto& first = *ts.begin();
  for (const auto& t : ts)
    TORCH_CHECK(t.dim() == 3 && t.size(2) == D && t.is_contiguous() && t.sizes() == first.sizes()
                && t.scalar_type() == first.scalar_type()
                && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
                "small_head_attention: expected contiguous fp32 or bf16 [BH, S, 16] tensors of one shape and dtype");
}

std::vector<at::Tensor> forward(at::Tensor q, at::Tensor k, at::Tensor v, double scale) {
  check_inputs({q, k, v});
  const int64_t BH = q.size(0), S = q.size(1);
  auto out = at::empty_like(q);
  auto lse = at::empty({BH, S}, q.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kFloat)
    forward_impl(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
                 lse.data_ptr<float>(), BH, S, (float)scale);
  else
    forward_impl(q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(),
                 out.data_ptr<at::BFloat16>(), lse.data_ptr<float>(), BH, S, (float)scale);
  return {out, lse};
}

// Gradients of forward's out w.r.t. q, k, v given grad_out, with P = exp(scores - lse) rebuilt
// chunk by chunk and delta = rowsum(grad_out * out). dk/dv accumulate in fp32 per slice.
template <typename T>
void backward_impl(const T* G, const T* Q, const T* K, const T* V, const T* O, const float* L,
                   T* DQ, T* DK, T* DV, int64_t BH, int64_t S, float scale) {
  const int64_t Sp = (S + C - 1) / C * C;
  at::parallel_for(0, BH, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> kt(D * Sp), vt(D * Sp), krows(D * S), dk(D * S), dv(D * S), qrows(R * D), grows(R * D),
        orows(R * D), ptmp(R * C), dstmp(R * C);
    for (int64_t bh = b0; bh < b1; ++bh) {
      const int64_t off = bh * S * D;
      const T *q_ = Q + off, *g_ = G + off, *o_ = O + off;
      const float* l_ = L + bh * S;
      transpose_chunks(K + off, S, Sp, kt.data(), krows.data());
      transpose_chunks(V + off, S, Sp, vt.data());
      std::fill(dk.begin(), dk.end(), 0.f);
      std::fill(dv.begin(), dv.end(), 0.f);
      const float* k_ = krows.data();
      for (int64_t i0 = 0; i0 < S; i0 += R) {
        const int rows = (int)std::min<int64_t>(R, S - i0);
        const int64_t nk = i0 + rows, nkp = (nk + C - 1) / C * C;
        load_rows(q_, i0, rows, scale, qrows.data());
        load_rows(g_, i0, rows, 1.f, grows.data());
        load_rows(o_, i0, rows, 1.f, orows.data());
        vec qv[R], gv[R], acc[R];
        float lse_r[R], delta_r[R];
        for (int r = 0; r < R; ++r) {
          qv[r] = load(qrows.data() + r * D);
          gv[r] = load(grows.data() + r * D);
          acc[r] = splat(0.f);
          lse_r[r] = r < rows ? l_[i0 + r] : INFINITY;  // padded rows: P = 0
          delta_r[r] = hsum(gv[r] * load(orows.data() + r * D));
        }
        vec s[R], dp[R];
        for (int64_t j = 0; j < nkp; j += C) {
          chunk_products(qrows.data(), kt.data() + j * D, s);
          chunk_products(grows.data(), vt.data() + j * D, dp);
          const bool diagonal = j + C > i0;
          for (int r = 0; r < R; ++r) {
            vec p = vexp(s[r] - lse_r[r]);
            if (diagonal) p = causal(p, j, i0 + r, 0.f);
            store(ptmp.data() + r * C, p);
            store(dstmp.data() + r * C, p * (dp[r] - delta_r[r]));
          }
          const int keys = (int)std::min<int64_t>(C, nk - j);
          for (int jj = 0; jj < keys; ++jj) {
            const int64_t key = j + jj;
            const vec kj = load(k_ + key * D);
            vec dkj = load(dk.data() + key * D), dvj = load(dv.data() + key * D);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const float ds = dstmp[r * C + jj];
              acc[r] += ds * kj;
              dkj += ds * qv[r];
              dvj += ptmp[r * C + jj] * gv[r];
            }
            store(dk.data() + key * D, dkj);
            store(dv.data() + key * D, dvj);
          }
        }
        for (int r = 0; r < rows; ++r) store_row(DQ + off + (i0 + r) * D, acc[r] * scale);
      }
      for (int64_t key = 0; key < S; ++key) {
        store_row(DK + off + key * D, load(dk.data() + key * D));
        store_row(DV + off + key * D, load(dv.data() + key * D));
      }
    }
  });
}

std::vector<at::Tensor> backward(at::Tensor grad_out, at::Tensor q, at::Tensor k, at::Tensor v,
                                    at::Tensor out, at::Tensor lse, double scale) {
  check_inputs({grad_out, q, k, v, out});
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat, "small_head_attention: lse must be contiguous fp32");
  const int64_t BH = q.size(0), S = q.size(1);
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  if (q.scalar_type() == at::kFloat)
    backward_impl(grad_out.data_ptr<float>(), q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                  out.data_ptr<float>(), lse.data_ptr<float>(), dq.data_ptr<float>(), dk.data_ptr<float>(),
                  dv.data_ptr<float>(), BH, S, (float)scale);
  else
    backward_impl(grad_out.data_ptr<at::BFloat16>(), q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(),
                  v.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), lse.data_ptr<float>(),
                  dq.data_ptr<at::BFloat16>(), dk.data_ptr<at::BFloat16>(), dv.data_ptr<at::BFloat16>(), BH, S,
                  (float)scale);
  return {dq, dk, dv};
}

// torch.ops.<TH_OPS>: the namespace is the build's library name (load() passes -DTH_OPS=...);
// TORCH_LIBRARY pastes its argument, so a second macro expands TH_OPS first.
#ifndef TH_OPS
#define TH_OPS titan_hydra_small_head_attention
#endif
#define TH_REGISTER_OPS(ns, m) TORCH_LIBRARY(ns, m)
TH_REGISTER_OPS(TH_OPS, m) {
  m.def("forward", &forward);   // causal attention, head_dim 16, fp32 or bf16 in, fp32 math: [out, logsumexp]
  m.def("backward", &backward);  // [dq, dk, dv] of forward
}

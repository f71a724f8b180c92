"""kvscope's C++ CPU kernels (torch_ops.py defines the ops), one extension built with torch.utils.cpp_extension
and registered for the CPU dispatch key, so the model's torch path calls them through the dispatcher:

- `kvscope::decode_attention`: the KV store and the paged decode attention in one function.
- `kvscope::int4_linear`: int4 weights (kvscope's byte layout, w = q * scale + min per group) times activations
  quantized inside the kernel per 32-block to int8 and the remainder to a second int8 code, llama.cpp's Q4_1 x Q8_1
  dot twice (AVX2 maddubs / madd, one FMA a block); a scalar build does the same integer math. From 8 activation
  rows (5 with zero rows padding a group) the AVX2 build lays 8 rows in a vector's int32 lanes and broadcasts each
  weight quad to them, half the multiplies a weight and row of the register tiles.
- `kvscope::decode_layer`: one Llama decoder layer's decode step for single-token sequences on fp32 rows with int4
  projections: RMSNorm, q/k/v, RoPE, the KV store and the attention, o, the residual adds, RMSNorm, gate/up,
  SiLU-and-mul, down, one call a layer (the two kernels above called as C++ functions, the elementwise work
  between them in plain vector loops), so a decode step's layer costs no Python or dispatcher work in between.

The build takes about half a minute, once per machine, and never holds up a request: an engine on the CPU loads the
built kernels at start (`prepare`) or, where they are not built yet, builds them in a background process and runs the
torch implementations until the build is done (`poll`, once a step). `load` builds in the calling process.

One build per machine kind: the build directory (~/.cache/kvscope/torch_extensions unless TORCH_EXTENSIONS_DIR is
set) is keyed on the torch version and the vector ISA the build targets (AVX2 + FMA + F16C where torch reports
AVX2 or AVX-512, else the compiler's portable default), never on -march=native. Without a compiler or ninja the
ops keep their torch implementations and one line says why.
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kV = Vec::size();
static_assert(kV == 8, "built for 8-float vectors (AVX2 or the portable default)");
constexpr float kFp8Max = 448.f;

struct Fp8Table {
  float v[256];
  Fp8Table() { for (int i = 0; i < 256; ++i) v[i] = c10::detail::fp8e4m3fn_to_fp32_value(static_cast<uint8_t>(i)); }
};
const Fp8Table& fp8_table() { static const Fp8Table t; return t; }

// One row of D elements of any supported type -> floats (float rows are read in place).
template <typename T>
inline const float* row_as_float(const T* p, float* buf, int64_t D) {
  if constexpr (std::is_same_v<T, float>) {
    return p;
  } else if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
    const float* lut = fp8_table().v;
    const uint8_t* b = reinterpret_cast<const uint8_t*>(p);
    for (int64_t d = 0; d < D; ++d) buf[d] = lut[b[d]];
    return buf;
  } else {
    for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(p[d]);
    return buf;
  }
}

template <typename T>
inline T from_float(float x) {
  if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
    return T(std::min(std::max(x, -kFp8Max), kFp8Max));   // saturated, as torch_ops.kv_encode
  } else {
    return static_cast<T>(x);
  }
}

inline float dot(const float* a, const float* b, int64_t D) {
  Vec acc0(0.f), acc1(0.f);
  int64_t d = 0;
  for (; d + 2 * kV <= D; d += 2 * kV) {
    acc0 = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + d + kV), Vec::loadu(b + d + kV), acc1);
  }
  for (; d + kV <= D; d += kV) acc0 = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc0);
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc0 + acc1);
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t D) {   // y += a * x
  const Vec va(a);
  int64_t d = 0;
  for (; d + kV <= D; d += kV) at::vec::fmadd(va, Vec::loadu(x + d), Vec::loadu(y + d)).store(y + d);
  for (; d < D; ++d) y[d] += a * x[d];
}

// x [T, Hk, D] (any strides, last dim dense) -> cache [N, bs, Hk, D] at flat slots; negative slots are skipped.
template <typename C>
void store_rows(const at::Tensor& x, const at::Tensor& cache, const int64_t* slots) {
  const int64_t T = x.size(0), Hk = x.size(1), D = x.size(2), bs = cache.size(1);
  C* base = reinterpret_cast<C*>(cache.data_ptr());
  const int64_t c0 = cache.stride(0), c1 = cache.stride(1), c2 = cache.stride(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "kvscope_store", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    const int64_t x0 = x.stride(0), x1 = x.stride(1);
    for (int64_t i = 0; i < T; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      C* dst = base + (slot / bs) * c0 + (slot % bs) * c1;
      for (int64_t h = 0; h < Hk; ++h) {
        const scalar_t* s = src + i * x0 + h * x1;
        C* o = dst + h * c2;
        if constexpr (std::is_same_v<C, scalar_t>) {
          std::memcpy(o, s, D * sizeof(C));
        } else {
          for (int64_t d = 0; d < D; ++d) o[d] = from_float<C>(static_cast<float>(s[d]));
        }
      }
    }
  });
}

template <typename I>
inline int64_t at_i(const void* p, int64_t i) { return static_cast<const I*>(p)[i]; }

inline int64_t index_at(const void* p, bool i32, int64_t i) { return i32 ? at_i<int32_t>(p, i) : at_i<int64_t>(p, i); }

// Eight partial-sum vectors -> their eight sums, in one vector.
inline Vec hsum8(const Vec* v) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // lanes: 0-3 lo | hi
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));  // lanes: 4-7 lo | hi
  return Vec(_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
#else
  float out[kV] = {};
  for (int r = 0; r < 8 && r < kV; ++r) {
    float tmp[kV];
    v[r].store(tmp);
    for (int l = 0; l < kV; ++l) out[r] += tmp[l];
  }
  return Vec::loadu(out);
#endif
}

// The attention of one sequence's tokens [t_begin, t_end) for all H heads: scores, then softmax relative to the
// range's own maximum. Writes m[H] (the maximum), l[H] (the sum of exponentials) and o[H, D] (the unnormalized
// weighted sum of V rows). A cached token's row [Hk, D] is dense; rows of a cache of another type are read
// through a float buffer.
template <typename C, int64_t DC>   // DC: the head size known at compile time (0: read at run time)
struct SeqRange {
  const C* kc; const C* vc;
  int64_t k0, k1, v0, v1, bs, H, Hk, D_;
  const void* bt; bool bt32; int64_t bt_row;

  // rows[i] = the cached row of token t_begin + i (one table lookup a block, no division a token)
  void rows_of(const C* base, int64_t s0, int64_t s1, int64_t t_begin, int64_t t_end, const C** rows) const {
    for (int64_t t = t_begin, i = 0; t < t_end;) {
      const C* blk = base + index_at(bt, bt32, bt_row + t / bs) * s0;
      for (int64_t off = t % bs; off < bs && t < t_end; ++off, ++t, ++i) rows[i] = blk + off * s1;
    }
  }

  void run(const float* qf, int64_t t_begin, int64_t t_end, float* s, float* rowbuf, const C** kr_all,
           const C** vr_all, float* m, float* l, float* o) const {
    const int64_t D = DC > 0 ? DC : D_;
    const int64_t n = t_end - t_begin, g = H / Hk, HkD = Hk * D;
    rows_of(kc, k0, k1, t_begin, t_end, kr_all);
    rows_of(vc, v0, v1, t_begin, t_end, vr_all);
    // scores s[h, i] = q_h . k_{t_begin + i}, eight tokens at a time (one horizontal sum for the eight)
    const int64_t Dv = D / kV * kV;
    for (int64_t i0 = 0; i0 < n; i0 += 8) {
      const int64_t m8 = std::min<int64_t>(8, n - i0);
      const float* rows[8];
      for (int64_t r = 0; r < m8; ++r)
        rows[r] = row_as_float(kr_all[i0 + r], rowbuf + r * HkD, HkD);
      for (int64_t h = 0; h < H; ++h) {
        const float* qh = qf + h * D;
        const int64_t off = (h / g) * D;
        float tail[8] = {};
        Vec part[8];
        for (int64_t r = 0; r < 8; ++r) part[r] = Vec(0.f);
        for (int64_t r = 0; r < m8; ++r) {
          const float* kr = rows[r] + off;
          Vec a(0.f), b(0.f);
          int64_t d = 0;
          for (; d + 2 * kV <= Dv; d += 2 * kV) {
            a = at::vec::fmadd(Vec::loadu(qh + d), Vec::loadu(kr + d), a);
            b = at::vec::fmadd(Vec::loadu(qh + d + kV), Vec::loadu(kr + d + kV), b);
          }
          if (d < Dv) a = at::vec::fmadd(Vec::loadu(qh + d), Vec::loadu(kr + d), a);
          part[r] = a + b;
          for (int64_t e = Dv; e < D; ++e) tail[r] += qh[e] * kr[e];
        }
        float sums[kV];
        (hsum8(part) + Vec::loadu(tail)).store(sums);
        std::memcpy(s + h * n + i0, sums, m8 * sizeof(float));
      }
    }
    // softmax numerators in place; m, l per head
    for (int64_t h = 0; h < H; ++h) {
      float* sh = s + h * n;
      const float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, sh, n);
      const Vec vmx(mx);
      Vec vsum(0.f);
      int64_t i = 0;
      for (; i + kV <= n; i += kV) {
        const Vec e = (Vec::loadu(sh + i) - vmx).exp_u20();
        e.store(sh + i);
        vsum = vsum + e;
      }
      float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
      for (; i < n; ++i) {
        sh[i] = std::exp(sh[i] - mx);
        sum += sh[i];
      }
      m[h] = mx;
      l[h] = sum;
    }
    // o_h = sum_i p[h, i] v_i, four tokens a pass (one load and store of o_h per four)
    std::fill(o, o + H * D, 0.f);
    for (int64_t i0 = 0; i0 < n; i0 += 4) {
      const int64_t m4 = std::min<int64_t>(4, n - i0);
      const float* rows[4];
      for (int64_t r = 0; r < m4; ++r)
        rows[r] = row_as_float(vr_all[i0 + r], rowbuf + r * HkD, HkD);
      for (int64_t h = 0; h < H; ++h) {
        const int64_t off = (h / g) * D;
        float* oh = o + h * D;
        const float* ph = s + h * n + i0;
        if (m4 == 4) {
          const Vec p0(ph[0]), p1(ph[1]), p2(ph[2]), p3(ph[3]);
          const float *r0 = rows[0] + off, *r1 = rows[1] + off, *r2 = rows[2] + off, *r3 = rows[3] + off;
          int64_t d = 0;
          for (; d < Dv; d += kV) {
            Vec a = Vec::loadu(oh + d);
            a = at::vec::fmadd(p0, Vec::loadu(r0 + d), a);
            a = at::vec::fmadd(p1, Vec::loadu(r1 + d), a);
            a = at::vec::fmadd(p2, Vec::loadu(r2 + d), a);
            a = at::vec::fmadd(p3, Vec::loadu(r3 + d), a);
            a.store(oh + d);
          }
          for (; d < D; ++d) oh[d] += ph[0] * r0[d] + ph[1] * r1[d] + ph[2] * r2[d] + ph[3] * r3[d];
        } else {
          for (int64_t r = 0; r < m4; ++r) {
            const float* vr = rows[r] + off;
            const Vec p(ph[r]);
            int64_t d = 0;
            for (; d < Dv; d += kV) at::vec::fmadd(p, Vec::loadu(vr + d), Vec::loadu(oh + d)).store(oh + d);
            for (; d < D; ++d) oh[d] += ph[r] * vr[d];
          }
        }
      }
    }
  }
};

// q [B, H, D] (rows dense), caches [N, bs, Hk, D] (a token's heads dense), block_tables [B, >= blocks],
// seq_lens [B] -> out [B, H, D] float. A task is a sequence's range of tokens (a block multiple): one range a
// sequence where the batch fills the threads, else a long context splits into ranges whose partial softmaxes
// merge at the end (as flash-decoding does).
template <typename C, int64_t DC>
void attend_d(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, const at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), bs = k_cache.size(1), Hk = k_cache.size(2);
  SeqRange<C, DC> sr{reinterpret_cast<const C*>(k_cache.data_ptr()), reinterpret_cast<const C*>(v_cache.data_ptr()),
                 k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), bs, H, Hk, D,
                 block_tables.data_ptr(), block_tables.scalar_type() == at::kInt, 0};
  const int64_t bt0 = block_tables.stride(0);
  const void* lens = seq_lens.data_ptr();
  const bool lens32 = seq_lens.scalar_type() == at::kInt;
  std::vector<int64_t> L(B);
  int64_t max_len = 1, total = 0;
  for (int64_t b = 0; b < B; ++b) {
    L[b] = index_at(lens, lens32, b * seq_lens.stride(0));
    TORCH_CHECK(L[b] <= block_tables.size(1) * bs, "kvscope::decode_attention: seq_lens[", b, "] = ", L[b],
                " beyond its block table's ", block_tables.size(1) * bs, " tokens");
    max_len = std::max(max_len, L[b]);
    total += std::max<int64_t>(L[b], 0);
  }
  const int64_t threads = at::get_num_threads();
  // ranges of at least kMinSplit tokens, enough of them to give every thread work
  constexpr int64_t kMinSplit = 256;
  int64_t S = 1;
  if (B < threads) S = std::max<int64_t>(1, std::min((threads + B - 1) / B, max_len / kMinSplit));
  const int64_t chunk = ((max_len + S - 1) / S + bs - 1) / bs * bs;
  S = (max_len + chunk - 1) / chunk;
  const float sc = static_cast<float>(scale);
  float* o = out.data_ptr<float>();
  std::vector<float> pm(S > 1 ? B * S * H : 0), pl(pm.size()), po(S > 1 ? B * S * H * D : 0);
  // work below ~64k multiply-adds stays on the calling thread: a parallel region costs a few microseconds
  const bool serial = B * S == 1 || total * H * D < (int64_t{1} << 16);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "kvscope_decode_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const int64_t q0 = q.stride(0), q1 = q.stride(1);
    auto tasks = [&](int64_t begin, int64_t end) {
      const int64_t span = std::min(chunk, max_len);
      std::vector<float> qf(H * D), s(H * span), rowbuf(8 * Hk * D), m(H), l(H);
      std::vector<const C*> kr(span), vr(span);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / S, part = task % S;
        const int64_t t0 = part * chunk, t1 = std::min(L[b], t0 + chunk);
        float* ob = o + b * H * D;
        if (t1 <= t0) {                                   // an empty range (or an empty sequence: zeros)
          if (S > 1) {
            std::fill(pm.begin() + task * H, pm.begin() + (task + 1) * H, -std::numeric_limits<float>::infinity());
            std::fill(pl.begin() + task * H, pl.begin() + (task + 1) * H, 0.f);
          } else {
            std::fill(ob, ob + H * D, 0.f);
          }
          continue;
        }
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) qf[h * D + d] = static_cast<float>(qp[b * q0 + h * q1 + d]) * sc;
        SeqRange<C, DC> r = sr;
        r.bt_row = b * bt0;
        if (S == 1) {
          r.run(qf.data(), t0, t1, s.data(), rowbuf.data(), kr.data(), vr.data(), m.data(), l.data(), ob);
          for (int64_t h = 0; h < H; ++h) {
            const Vec inv(1.f / l[h]);
            int64_t d = 0;
            for (; d + kV <= D; d += kV) (Vec::loadu(ob + h * D + d) * inv).store(ob + h * D + d);
            for (; d < D; ++d) ob[h * D + d] /= l[h];
          }
        } else {
          r.run(qf.data(), t0, t1, s.data(), rowbuf.data(), kr.data(), vr.data(), pm.data() + task * H,
                pl.data() + task * H, po.data() + task * H * D);
        }
      }
    };
    if (serial) tasks(0, B * S);
    else at::parallel_for(0, B * S, 1, tasks);
  });
  if (S > 1) {                                            // merge each sequence's ranges
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        float M = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < S; ++p) M = std::max(M, pm[(b * S + p) * H + h]);
        float* oh = o + (b * H + h) * D;
        std::fill(oh, oh + D, 0.f);
        if (M == -std::numeric_limits<float>::infinity()) continue;
        float denom = 0.f;
        for (int64_t p = 0; p < S; ++p) {
          const int64_t i = (b * S + p) * H + h;
          if (pl[i] == 0.f) continue;
          const float w = std::exp(pm[i] - M);
          denom += w * pl[i];
          const float* src = po.data() + i * D;
          for (int64_t d = 0; d < D; ++d) oh[d] += w * src[d];
        }
        for (int64_t d = 0; d < D; ++d) oh[d] /= denom;
      }
    }
  }
}

template <typename C>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, const at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return attend_d<C, 64>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
    case 128: return attend_d<C, 128>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
    default: return attend_d<C, 0>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  }
}

void check_dense_rows(const at::Tensor& t, const char* name, int64_t rank) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == rank, "kvscope::decode_attention: ", name,
              " must be a CPU tensor of rank ", rank);
  TORCH_CHECK(t.stride(-1) == 1, "kvscope::decode_attention: ", name, "'s last dimension must be dense");
}

// ---- kvscope::int4_linear: int4 weights x int8 activations (llama.cpp's Q4_1 x Q8_1 dot) ----------------------

constexpr int64_t kQB = 32;                // activation block: one int8 scale a 32 values
constexpr int64_t kRowsM = 4;              // activation rows a pass over a weight row (accumulators in registers)
constexpr int64_t kRowsN = 8;              // weight rows a tile (their nibbles and the activation rows stay in L1)

// Activations in int8 per 32-block, as llama.cpp's Q8_1, plus (L = 2) a second int8 code for the rounding's remainder:
// x ~ d (256 q1 + q2) / 256 with d = max|x| / 127, ~16 bits a value where one int8 keeps ~7 (bf16: 8). One level
// changed fp32's greedy tokens on 4 of 6 held-out chat prompts of the bundled SmolLM2 (benchmarks/check_cpu_quant.py:
// 2 of 6 identical, against 6 of 6 for torch's bf16 path); two keep 6 of 6 at the same speed at batch 1 (a decode
// step's int4 GEMMs are memory-bound on the weights) and ~12% slower at batch 8.
constexpr int kLevels = 2;

// An activation row [K] -> codes xq [K / 32, L, 32] (q1 rounded to nearest even, as llama.cpp's quantize_row_q8_1;
// q2 = the remainder in steps of d / 256), and per 32-block the step dx (d, or d / 256 for two levels) and
// ds = dx * the block's sum of codes (256 q1 + q2).
template <int L, typename T>
void quantize_row_q8(const T* x, int64_t K, int8_t* xq, float* d, float* ds) {
  float buf[kQB];
  for (int64_t b = 0; b < K / kQB; ++b) {
    const float* xb;
    if constexpr (std::is_same_v<T, float>) {
      xb = x + b * kQB;
    } else {
      for (int64_t i = 0; i < kQB; ++i) buf[i] = static_cast<float>(x[b * kQB + i]);
      xb = buf;
    }
    Vec amax(0.f);
    for (int64_t i = 0; i < kQB; i += kV) amax = at::vec::maximum(amax, Vec::loadu(xb + i).abs());
    const float mx = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return at::vec::maximum(a, c); }, amax);
    const float db = mx / 127.f, id = mx > 0.f ? 127.f / mx : 0.f;
    float r[kQB];
    for (int64_t i = 0; i < kQB; i += kV) (Vec::loadu(xb + i) * Vec(id)).round().store(r + i);
    int32_t sum = 0;
    int8_t* q1 = xq + b * kQB * L;
    for (int64_t i = 0; i < kQB; ++i) {
      q1[i] = static_cast<int8_t>(static_cast<int32_t>(r[i]));
      sum += q1[i];
    }
    if (L == 2) {                          // the rounding's remainder, |x - d q1| <= d / 2, in steps of d / 256
      const Vec vd(db), vid(id * 256.f), lo(-127.f), hi(127.f);
      for (int64_t i = 0; i < kQB; i += kV)
        at::vec::clamp((Vec::loadu(xb + i) - vd * Vec::loadu(r + i)) * vid, lo, hi).round().store(r + i);
      sum *= 256;
      for (int64_t i = 0; i < kQB; ++i) {
        q1[kQB + i] = static_cast<int8_t>(static_cast<int32_t>(r[i]));
        sum += q1[kQB + i];
      }
    }
    // the min term over the same rounded values as the codes' term: their errors cancel where w = q s + m is small
    d[b] = L == 2 ? db / 256.f : db;
    ds[b] = d[b] * static_cast<float>(sum);
  }
}

// The 32 codes of activation block a of a weight row (k order) in G-groups of G / 2 bytes: byte i of a group
// holds k = i in its low nibble and k = G / 2 + i in its high one.
template <int64_t G>
inline const uint8_t* block_bytes(const uint8_t* row, int64_t a, int& shift) {
  const int64_t k = a * kQB, g = k / G, o = k % G;
  if constexpr (G == kQB) {
    shift = 0;
    return row + g * (G / 2);
  } else {
    shift = o >= G / 2 ? 4 : 0;
    return row + g * (G / 2) + o % (G / 2);
  }
}

#if defined(CPU_CAPABILITY_AVX2)
template <int64_t G>
inline __m256i block_codes(const uint8_t* p, int shift) {   // 32 codes, u8 in 0..15
  const __m256i mask = _mm256_set1_epi8(0x0F);
  if constexpr (G == kQB) {                 // 16 bytes: low nibbles are k 0..15, high ones k 16..31
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), mask);
  } else {
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_and_si256(shift ? _mm256_srli_epi16(t, 4) : t, mask);
  }
}
#endif

// out[j][r] = sum_k w_j[k] x_r[k] for NR weight rows (ld bytes apart) and R activation rows, w = q * sw + mw per
// G-group: the sum over blocks of sw * d_r * (q . xq_r) + mw * d_r * sum(xq_r). NR x R independent accumulators
// (one FMA chain each would wait on its own latency), each activation block loaded once for the NR rows.
template <int L, int64_t G, int NR, int R>
inline void row_dots(const uint8_t* row, int64_t ld, const float* sw, const float* mw, const int8_t* xq,
                     const float* dx, const float* dsx, int64_t K, float (*out)[R]) {
  const int64_t nb = K / kQB, ng = K / G;
  float mins[NR][R] = {};
  for (int64_t a = 0; a < nb; ++a)
    for (int j = 0; j < NR; ++j) {
      const float m = mw[j * ng + a * kQB / G];
      for (int r = 0; r < R; ++r) mins[j][r] += m * dsx[r * nb + a];
    }
#if defined(CPU_CAPABILITY_AVX2)
  __m256 acc[NR][R];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), c256 = _mm256_set1_epi16(256);
  for (int64_t a = 0; a < nb; ++a) {
    int shift;
    const uint8_t* bytes = block_bytes<G>(row, a, shift);
    __m256i w[NR];
    float s[NR];
    for (int j = 0; j < NR; ++j) {
      w[j] = block_codes<G>(bytes + j * ld, shift);
      s[j] = sw[j * ng + a * kQB / G];
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xq + (r * K + a * kQB) * L;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
      const __m256i xv2 = L == 2 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + kQB)) : xv;
      const float d = dx[r * nb + a];
      for (int j = 0; j < NR; ++j) {
        __m256i p;                                                                      // 8 x int32
        if constexpr (L == 2)
          p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(w[j], xv), c256),
                               _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], xv2), ones));
        else
          p = _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], xv), ones);
        acc[j][r] = _mm256_fmadd_ps(_mm256_set1_ps(s[j] * d), _mm256_cvtepi32_ps(p), acc[j][r]);
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) {
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[j][r]), _mm256_extractf128_ps(acc[j][r], 1));
      const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
      out[j][r] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2))) + mins[j][r];
    }
#else
  float acc[NR][R] = {};
  for (int64_t a = 0; a < nb; ++a) {
    int shift;
    const uint8_t* bytes = block_bytes<G>(row, a, shift);
    for (int j = 0; j < NR; ++j) {
      const uint8_t* p = bytes + j * ld;
      int8_t w[kQB];
      if constexpr (G == kQB) {
        for (int64_t i = 0; i < kQB / 2; ++i) { w[i] = p[i] & 15; w[i + kQB / 2] = p[i] >> 4; }
      } else {
        for (int64_t i = 0; i < kQB; ++i) w[i] = (p[i] >> shift) & 15;
      }
      const float s = sw[j * ng + a * kQB / G];
      for (int r = 0; r < R; ++r) {
        const int8_t* xv = xq + (r * K + a * kQB) * L;
        int32_t isum = 0;
        for (int64_t i = 0; i < kQB; ++i) isum += static_cast<int32_t>(w[i]) * xv[i];
        if (L == 2) {
          int32_t isum2 = 0;
          for (int64_t i = 0; i < kQB; ++i) isum2 += static_cast<int32_t>(w[i]) * xv[kQB + i];
          isum = isum * 256 + isum2;
        }
        acc[j][r] += s * dx[r * nb + a] * static_cast<float>(isum);
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) out[j][r] = acc[j][r] + mins[j][r];
#endif
}

// Weight rows [n0, n1) against R activation rows: NR rows a pass, the tail one at a time.
template <int L, int64_t G, int NR, int R>
void rows_tile(const uint8_t* qw, const float* sw, const float* mw, int64_t n0, int64_t n1, const int8_t* xq,
               const float* dx, const float* dsx, int64_t K, int64_t N, float* y) {
  const int64_t ng = K / G, ld = K / 2;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    float o[NR][R];
    row_dots<L, G, NR, R>(qw + n * ld, ld, sw + (n - n0) * ng, mw + (n - n0) * ng, xq, dx, dsx, K, o);
    for (int j = 0; j < NR; ++j)
      for (int r = 0; r < R; ++r) y[r * N + n + j] = o[j][r];
  }
  for (; n < n1; ++n) {
    float o[1][R];
    row_dots<L, G, 1, R>(qw + n * ld, ld, sw + (n - n0) * ng, mw + (n - n0) * ng, xq, dx, dsx, K, o);
    for (int r = 0; r < R; ++r) y[r * N + n] = o[0][r];
  }
}

// register tiles (weight rows x activation rows): 4 x 1, 4 x 2, 2 x 3, 2 x 4 (at most 8 accumulators)
template <int L, int64_t G>
void tile(int R, const uint8_t* qw, const float* sw, const float* mw, int64_t n0, int64_t n1, const int8_t* xq,
          const float* dx, const float* dsx, int64_t K, int64_t N, float* y) {
  switch (R) {
    case 1: return rows_tile<L, G, 4, 1>(qw, sw, mw, n0, n1, xq, dx, dsx, K, N, y);
    case 2: return rows_tile<L, G, 4, 2>(qw, sw, mw, n0, n1, xq, dx, dsx, K, N, y);
    case 3: return rows_tile<L, G, 2, 3>(qw, sw, mw, n0, n1, xq, dx, dsx, K, N, y);
    default: return rows_tile<L, G, 2, 4>(qw, sw, mw, n0, n1, xq, dx, dsx, K, N, y);
  }
}

// fp16 scales and mins eight at a time (F16C): converted one by one they cost a batch-1 GEMM a quarter of its time
template <typename S>
inline void to_float(const S* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<S, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<S, at::Half>)
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// ---- Several activation rows at once: 8 rows in the 8 int32 lanes of a vector ----------------------------------
//
// At 8 rows the tiles above spend two maddubs and two madd per weight block and row. Laid out the other way round,
// each int32 lane holds one activation row and each weight code is broadcast to all of them: a block's 32 codes are
// 8 broadcast quads, each one maddubs per level against 8 rows' 4 codes, summed in int16 over the block (8 quads of
// at most 2 * 15 * 127 fit), then one madd a level for the block: half the multiplies per weight and row.

#if defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kPack = 8;               // activation rows of a packed group (one int32 lane each)
constexpr int64_t kPackMin = 5;            // a group of fewer rows (zero rows pad it) takes the tiles above
constexpr int kPackNR = 3;                 // weight rows a pass over a packed group (int16 sums in registers)

// Codes of activation rows [0, R) of xq (quantize_row_q8's layout, [R][K / 32][L][32]) -> one packed group
// xp [K / 32][L][8 quads][8 rows][4] (rows past R zero) and per block the rows' steps dv and dsv [K / 32][8].
template <int L>
void pack_rows(const int8_t* xq, const float* dx, const float* dsx, int64_t R, int64_t K, int8_t* xp, float* dv,
               float* dsv) {
  const int64_t nb = K / kQB;
  std::memset(xp, 0, nb * L * kPack * kQB);
  std::fill(dv, dv + nb * kPack, 0.f);
  std::fill(dsv, dsv + nb * kPack, 0.f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t a = 0; a < nb; ++a) {
      for (int64_t l = 0; l < L; ++l)
        for (int64_t q = 0; q < kQB / 4; ++q)
          std::memcpy(xp + ((a * L + l) * (kQB / 4) + q) * kPack * 4 + r * 4, xq + ((r * nb + a) * L + l) * kQB + q * 4, 4);
      dv[a * kPack + r] = dx[r * nb + a];
      dsv[a * kPack + r] = dsx[r * nb + a];
    }
}

// A weight row in kvscope's layout -> its K codes (0..15) in k order.
template <int64_t G>
inline void unpack_row(const uint8_t* row, int64_t K, uint8_t* codes) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < K / G; ++g)
    for (int64_t c = 0; c < G / 2; c += 16) {
      const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * G / 2 + c));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + g * G + c), _mm_and_si128(t, mask));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + g * G + G / 2 + c),
                       _mm_and_si128(_mm_srli_epi16(t, 4), mask));
    }
}

// out[j] (lane r) = sum_k w_j[k] x_r[k] for NR weight rows (codes [NR][K], scales and mins [NR][K / G]) and one
// packed group of 8 activation rows.
template <int L, int64_t G, int NR>
inline void packed_dots(const uint8_t* codes, int64_t K, const float* sw, const float* mw, const int8_t* xp,
                        const float* dv, const float* dsv, __m256* out) {
  const int64_t nb = K / kQB, ng = K / G;
  const __m256i ones = _mm256_set1_epi16(1), c256 = _mm256_set1_epi16(256);
  __m256 acc[NR];
  for (int j = 0; j < NR; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t a = 0; a < nb; ++a) {
    const int8_t* xa = xp + a * L * kPack * kQB;
    __m256i s1[NR], s2[NR];
    for (int j = 0; j < NR; ++j) s1[j] = s2[j] = _mm256_setzero_si256();
#pragma GCC unroll 1   // unrolled, GCC computes all 8 quads' products first and spills them
    for (int64_t q = 0; q < kQB / 4; ++q) {
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa + q * kPack * 4));
      const __m256i x2 = L == 2 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa + (kQB + q * 4) * kPack))
                                : x1;
      for (int j = 0; j < NR; ++j) {
        int32_t quad;
        std::memcpy(&quad, codes + j * K + a * kQB + q * 4, 4);
        const __m256i w = _mm256_set1_epi32(quad);
        s1[j] = _mm256_add_epi16(s1[j], _mm256_maddubs_epi16(w, x1));
        if constexpr (L == 2) s2[j] = _mm256_add_epi16(s2[j], _mm256_maddubs_epi16(w, x2));
      }
    }
    const __m256 d = _mm256_loadu_ps(dv + a * kPack), ds = _mm256_loadu_ps(dsv + a * kPack);
    for (int j = 0; j < NR; ++j) {
      const __m256i p = L == 2 ? _mm256_add_epi32(_mm256_madd_epi16(s1[j], c256), _mm256_madd_epi16(s2[j], ones))
                               : _mm256_madd_epi16(s1[j], ones);
      const int64_t g = j * ng + a * kQB / G;
      acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(p), d), _mm256_set1_ps(sw[g]), acc[j]);
      acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(mw[g]), ds, acc[j]);
    }
  }
  for (int j = 0; j < NR; ++j) out[j] = acc[j];
}

// Weight rows [n0, n1) (their scales and mins at sw, mw) against P packed groups: NR rows a pass, the tail one
// at a time; group p's rows are y's rows 8p.. (at most M).
template <int L, int64_t G, int NR>
void packed_tile(const uint8_t* qw, const float* sw, const float* mw, int64_t n0, int64_t n1, const int8_t* xp,
                 const float* dv, const float* dsv, int64_t P, int64_t M, int64_t K, int64_t N, uint8_t* codes,
                 float* y) {
  const int64_t ng = K / G, ld = K / 2, nb = K / kQB;
  auto pass = [&](auto nr, int64_t n) {
    constexpr int R = decltype(nr)::value;
    for (int j = 0; j < R; ++j) unpack_row<G>(qw + (n + j) * ld, K, codes + j * K);
    for (int64_t p = 0; p < P; ++p) {
      __m256 o[R];
      packed_dots<L, G, R>(codes, K, sw + (n - n0) * ng, mw + (n - n0) * ng, xp + p * nb * L * kPack * kQB,
                           dv + p * nb * kPack, dsv + p * nb * kPack, o);
      const int64_t rows = std::min(kPack, M - p * kPack);
      for (int j = 0; j < R; ++j) {
        float lanes[kPack];
        _mm256_storeu_ps(lanes, o[j]);
        for (int64_t r = 0; r < rows; ++r) y[(p * kPack + r) * N + n + j] = lanes[r];
      }
    }
  };
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) pass(std::integral_constant<int, NR>{}, n);
  if constexpr (NR > 2)
    if (n + 2 <= n1) {
      pass(std::integral_constant<int, 2>{}, n);
      n += 2;
    }
  for (; n < n1; ++n) pass(std::integral_constant<int, 1>{}, n);
}
#endif

// y [M, N] float = x [M, K] (quantized here) @ w.T; w rows [N, K / 2] bytes, scales and mins [N, K / G]. Groups of
// 8 activation rows (and a last one of at least kPackMin, zero-padded) take the packed kernel where AVX2 is built,
// the rest the register tiles.
template <int L, int64_t G, typename S>
void int4_gemm(const int8_t* xq, const float* dx, const float* dsx, int64_t M, const uint8_t* qw, const S* scales,
               const S* mins, int64_t N, int64_t K, float* y) {
  const int64_t ng = K / G, nb = K / kQB;
  int64_t P = 0, Mp = 0;                   // packed groups, the rows they cover
  std::vector<int8_t> xp;
  std::vector<float> dv, dsv;
#if defined(CPU_CAPABILITY_AVX2)
  P = M / kPack + (M % kPack >= kPackMin ? 1 : 0);
  Mp = std::min(M, P * kPack);
  xp.resize(P * nb * L * kPack * kQB);
  dv.resize(P * nb * kPack);
  dsv.resize(P * nb * kPack);
  for (int64_t p = 0; p < P; ++p)
    pack_rows<L>(xq + p * kPack * K * L, dx + p * kPack * nb, dsx + p * kPack * nb,
                 std::min(kPack, M - p * kPack), K, xp.data() + p * nb * L * kPack * kQB, dv.data() + p * nb * kPack,
                 dsv.data() + p * nb * kPack);
#endif
  // a weight row is K / 2 bytes: at least ~32k of them a thread, or the calling thread alone
  const int64_t grain = std::max<int64_t>(kRowsN, (int64_t{1} << 15) / std::max<int64_t>(1, K / 2 * M));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> sw(kRowsN * ng), mw(kRowsN * ng);
    std::vector<uint8_t> codes(P > 0 ? kRowsN * K : 0);
    for (int64_t n0 = begin; n0 < end; n0 += kRowsN) {
      const int64_t n1 = std::min(end, n0 + kRowsN);
      to_float(scales + n0 * ng, sw.data(), (n1 - n0) * ng);
      to_float(mins + n0 * ng, mw.data(), (n1 - n0) * ng);
#if defined(CPU_CAPABILITY_AVX2)
      if (P > 0)
        packed_tile<L, G, kPackNR>(qw, sw.data(), mw.data(), n0, n1, xp.data(), dv.data(), dsv.data(), P, M, K, N,
                                   codes.data(), y);
#endif
      for (int64_t m0 = Mp; m0 < M; m0 += kRowsM) {
        const int R = static_cast<int>(std::min(kRowsM, M - m0));
        tile<L, G>(R, qw, sw.data(), mw.data(), n0, n1, xq + m0 * K * L, dx + m0 * nb, dsx + m0 * nb, K, N, y + m0 * N);
      }
    }
  });
}

template <int L, typename S>
void int4_gemm_g(int64_t G, const int8_t* xq, const float* dx, const float* dsx, int64_t M, const uint8_t* qw,
                 const S* scales, const S* mins, int64_t N, int64_t K, float* y) {
  switch (G) {
    case 32: return int4_gemm<L, 32>(xq, dx, dsx, M, qw, scales, mins, N, K, y);
    case 64: return int4_gemm<L, 64>(xq, dx, dsx, M, qw, scales, mins, N, K, y);
    default: return int4_gemm<L, 128>(xq, dx, dsx, M, qw, scales, mins, N, K, y);
  }
}

// ---- kvscope::decode_layer: one Llama decoder layer's decode step on fp32 rows --------------------------------

// out[E] = x * rsqrt(mean(x^2) + eps) * w (torch_ops.rms_norm's order: normalized, then weighted)
inline void rms_norm_row(const float* x, const float* w, float eps, int64_t E, float* out) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kV <= E; i += kV) {
    const Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float ss = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < E; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(E) + eps);
  const Vec vr(r);
  for (i = 0; i + kV <= E; i += kV) (Vec::loadu(x + i) * vr * Vec::loadu(w + i)).store(out + i);
  for (; i < E; ++i) out[i] = x[i] * r * w[i];
}

// x [D] in place, neox / Hugging Face style (the halves rotate): cs = cos | sin [D] of the token's position
inline void rope_row(float* x, const float* cs, int64_t D) {
  const int64_t half = D / 2;
  const float *c = cs, *s = cs + half;
  int64_t i = 0;
  for (; i + kV <= half; i += kV) {
    const Vec x1 = Vec::loadu(x + i), x2 = Vec::loadu(x + half + i), vc = Vec::loadu(c + i), vs = Vec::loadu(s + i);
    (x1 * vc - x2 * vs).store(x + i);
    (x2 * vc + x1 * vs).store(x + half + i);
  }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    x[i] = x1 * c[i] - x2 * s[i];
    x[half + i] = x2 * c[i] + x1 * s[i];
  }
}

// out[I] = silu(gate) * up, silu(g) = g / (1 + exp(-g))
inline void silu_mul_row(const float* gate, const float* up, int64_t I, float* out) {
  const Vec one(1.f);
  int64_t i = 0;
  for (; i + kV <= I; i += kV) {
    const Vec g = Vec::loadu(gate + i);
    (g / (one + g.neg().exp_u20()) * Vec::loadu(up + i)).store(out + i);
  }
  for (; i < I; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// One projection's int4 tensors (kvscope's layout, as int4_linear takes them).
struct Int4Weight {
  const uint8_t* q;
  const void* scales;
  const void* mins;
  bool half;
  int64_t N, K, G;
};

Int4Weight int4_weight(const at::Tensor& qw, const at::Tensor& s, const at::Tensor& m, int64_t K, const char* name) {
  TORCH_CHECK(qw.scalar_type() == at::kByte && qw.dim() == 2 && qw.is_contiguous() && qw.size(1) * 2 == K,
              "kvscope::decode_layer: ", name, "'s qweight must be contiguous uint8 [N, ", K / 2, "]");
  const int64_t N = qw.size(0);
  TORCH_CHECK(s.scalar_type() == m.scalar_type() && (s.scalar_type() == at::kFloat || s.scalar_type() == at::kHalf)
              && s.dim() == 2 && s.sizes() == m.sizes() && s.size(0) == N && s.size(1) > 0 && K % s.size(1) == 0
              && s.is_contiguous() && m.is_contiguous(),
              "kvscope::decode_layer: ", name, "'s scales and mins must be contiguous float/half [N, K / group]");
  const int64_t G = K / s.size(1);
  TORCH_CHECK(G == 32 || G == 64 || G == 128, "kvscope::decode_layer: ", name, "'s group must be 32, 64 or 128, got ", G);
  return {qw.data_ptr<uint8_t>(), s.data_ptr(), m.data_ptr(), s.scalar_type() == at::kHalf, N, K, G};
}

// Quantized activations of a projection's input rows (int4_linear's codes), reused from projection to projection.
struct Int4Scratch {
  std::vector<int8_t> xq;
  std::vector<float> dx, dsx;
};

// y [M, N] = x [M, K] @ w.T with x quantized as int4_linear quantizes it
void int4_matmul(const Int4Weight& w, const float* x, int64_t M, float* y, Int4Scratch& t) {
  constexpr int L = kLevels;
  const int64_t K = w.K, nb = K / kQB;
  t.xq.resize(M * K * L);
  t.dx.resize(M * nb);
  t.dsx.resize(M * nb);
  for (int64_t m = 0; m < M; ++m)
    quantize_row_q8<L>(x + m * K, K, t.xq.data() + m * K * L, t.dx.data() + m * nb, t.dsx.data() + m * nb);
  if (w.half)
    int4_gemm_g<L>(w.G, t.xq.data(), t.dx.data(), t.dsx.data(), M, w.q, static_cast<const at::Half*>(w.scales),
                   static_cast<const at::Half*>(w.mins), w.N, K, y);
  else
    int4_gemm_g<L>(w.G, t.xq.data(), t.dx.data(), t.dsx.data(), M, w.q, static_cast<const float*>(w.scales),
                   static_cast<const float*>(w.mins), w.N, K, y);
}

void check_float_vector(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == n &&
              t.is_contiguous(), "kvscope::decode_layer: ", name, " must be a contiguous float tensor [", n, "]");
}

}  // namespace

// x [M, K] float/bf16/half, qweight uint8 [N, K / 2] (kvscope's int4 byte layout), scales and mins [N, K / G]
// float/half (w = q * scale + min) -> [M, N] in x's dtype.
at::Tensor int4_linear(const at::Tensor& x_, const at::Tensor& qweight, const at::Tensor& scales_,
                       const at::Tensor& mins_, int64_t group) {
  TORCH_CHECK(x_.device().is_cpu() && x_.dim() == 2, "kvscope::int4_linear: x must be a CPU tensor [M, K]");
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "kvscope::int4_linear: group must be 32, 64 or 128, got ",
              group);
  const int64_t M = x_.size(0), K = x_.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.size(1) * 2 == K,
              "kvscope::int4_linear: qweight must be uint8 [N, K / 2] for x's K = ", K);
  TORCH_CHECK(K % group == 0, "kvscope::int4_linear: K = ", K, " is not a multiple of the group ", group);
  TORCH_CHECK(scales_.scalar_type() == mins_.scalar_type() &&
              (scales_.scalar_type() == at::kFloat || scales_.scalar_type() == at::kHalf) &&
              scales_.sizes() == mins_.sizes() && scales_.dim() == 2 && scales_.size(0) == N &&
              scales_.size(1) * group == K, "kvscope::int4_linear: scales and mins must be float/half [N, K / group]");
  const at::Tensor x = x_.contiguous(), qw = qweight.contiguous(), scales = scales_.contiguous(),
                   mins = mins_.contiguous();
  const int64_t nb = K / kQB;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  constexpr int L = kLevels;
  std::vector<int8_t> xq(M * K * L);
  std::vector<float> dx(M * nb), dsx(M * nb);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "kvscope_int4_quantize", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    for (int64_t m = 0; m < M; ++m)
      quantize_row_q8<L>(xp + m * K, K, xq.data() + m * K * L, dx.data() + m * nb, dsx.data() + m * nb);
  });
  if (M > 0 && N > 0) {
    const uint8_t* qp = qw.data_ptr<uint8_t>();
    if (scales.scalar_type() == at::kFloat)
      int4_gemm_g<L>(group, xq.data(), dx.data(), dsx.data(), M, qp, scales.data_ptr<float>(),
                     mins.data_ptr<float>(), N, K, y.data_ptr<float>());
    else
      int4_gemm_g<L>(group, xq.data(), dx.data(), dsx.data(), M, qp, scales.data_ptr<at::Half>(),
                     mins.data_ptr<at::Half>(), N, K, y.data_ptr<float>());
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale) {
  check_dense_rows(q, "q", 3);
  check_dense_rows(k, "k", 3);
  check_dense_rows(v, "v", 3);
  check_dense_rows(k_cache, "k_cache", 4);
  check_dense_rows(v_cache, "v_cache", 4);
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "kvscope::decode_attention: caches of two dtypes");
  TORCH_CHECK(k_cache.stride(2) == k_cache.size(3) && v_cache.stride(2) == v_cache.size(3),
              "kvscope::decode_attention: a cached token's heads must be dense");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3),
              "kvscope::decode_attention: q heads must be a multiple of the cache's kv heads, of its head size");
  const auto bt_type = block_tables.scalar_type();
  TORCH_CHECK(block_tables.dim() == 2 && (bt_type == at::kInt || bt_type == at::kLong) && block_tables.stride(1) == 1
              && block_tables.size(0) >= q.size(0),
              "kvscope::decode_attention: block_tables must be int32/int64 [B, blocks]");
  TORCH_CHECK(k.size(0) == slot_mapping.numel() && v.sizes() == k.sizes() && k.size(1) == k_cache.size(2)
              && k.size(2) == k_cache.size(3), "kvscope::decode_attention: k, v must be [slots, Hk, D] of the caches");
  TORCH_CHECK((seq_lens.scalar_type() == at::kInt || seq_lens.scalar_type() == at::kLong)
              && seq_lens.numel() == q.size(0), "kvscope::decode_attention: seq_lens must be int32/int64 [B]");
  const auto cdt = k_cache.scalar_type();
  TORCH_CHECK(cdt == at::kFloat || cdt == at::kBFloat16 || cdt == at::kHalf || cdt == at::kFloat8_e4m3fn,
              "kvscope::decode_attention: unsupported cache dtype ", cdt);
  if (slot_mapping.numel() > 0) {
    const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < slots.numel(); ++i)
      TORCH_CHECK(sp[i] < k_cache.size(0) * k_cache.size(1), "kvscope::decode_attention: slot ", sp[i],
                  " beyond the cache's ", k_cache.size(0) * k_cache.size(1));
    auto store = [&](auto tag) {
      using C = decltype(tag);
      store_rows<C>(k, k_cache, sp);
      store_rows<C>(v, v_cache, sp);
    };
    if (cdt == at::kFloat) store(float{});
    else if (cdt == at::kBFloat16) store(c10::BFloat16{});
    else if (cdt == at::kHalf) store(c10::Half{});
    else store(c10::Float8_e4m3fn{});
  }
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  if (cdt == at::kFloat) attend<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  else if (cdt == at::kBFloat16) attend<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  else if (cdt == at::kHalf) attend<c10::Half>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  else attend<c10::Float8_e4m3fn>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

// h [B, E] float, the residual stream of B single-token sequences (the previous layer's output and its residual
// summed) -> the same after this layer: h + o(attention(RoPE(qkv(RMSNorm(h))))) = h', then
// h' + down(silu(gate) * up of gate_up(RMSNorm(h'))). weights: qweight, scales, mins of qkv_proj, o_proj,
// gate_up_proj and down_proj, in that order; the KV store and the attention are decode_attention's.
at::Tensor decode_layer(const at::Tensor& h_, at::TensorList weights, const std::optional<at::Tensor>& qkv_bias,
                        const at::Tensor& input_norm, const at::Tensor& post_norm, double eps_,
                        const at::Tensor& cos_sin, const at::Tensor& positions, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, int64_t num_heads, double scale) {
  TORCH_CHECK(h_.device().is_cpu() && h_.dim() == 2 && h_.scalar_type() == at::kFloat,
              "kvscope::decode_layer: h must be a float CPU tensor [B, hidden]");
  TORCH_CHECK(weights.size() == 12, "kvscope::decode_layer: weights must be (qweight, scales, mins) of qkv_proj, "
              "o_proj, gate_up_proj and down_proj, got ", weights.size(), " tensors");
  TORCH_CHECK(k_cache.dim() == 4 && num_heads > 0 && num_heads % k_cache.size(2) == 0,
              "kvscope::decode_layer: the caches must be [blocks, block_size, kv_heads, head_size] with num_heads a "
              "multiple of kv_heads");
  const at::Tensor h = h_.contiguous();
  const int64_t B = h.size(0), E = h.size(1), Hk = k_cache.size(2), D = k_cache.size(3), H = num_heads;
  const int64_t QD = H * D, KD = Hk * D, NQKV = QD + 2 * KD;
  const Int4Weight wqkv = int4_weight(weights[0], weights[1], weights[2], E, "qkv_proj");
  const Int4Weight wo = int4_weight(weights[3], weights[4], weights[5], QD, "o_proj");
  const Int4Weight wgu = int4_weight(weights[6], weights[7], weights[8], E, "gate_up_proj");
  const int64_t I = wgu.N / 2;
  const Int4Weight wd = int4_weight(weights[9], weights[10], weights[11], I, "down_proj");
  TORCH_CHECK(wqkv.N == NQKV && wo.N == E && wgu.N == 2 * I && wd.N == E,
              "kvscope::decode_layer: projections of mismatched shapes (qkv_proj ", wqkv.N, " rows for ", NQKV,
              ", o_proj ", wo.N, " and down_proj ", wd.N, " for hidden ", E, ", gate_up_proj ", wgu.N, ")");
  check_float_vector(input_norm, E, "input_norm");
  check_float_vector(post_norm, E, "post_norm");
  if (qkv_bias.has_value()) check_float_vector(*qkv_bias, NQKV, "qkv_bias");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.dim() == 2 && cos_sin.size(1) == D &&
              cos_sin.is_contiguous(), "kvscope::decode_layer: cos_sin must be contiguous float [positions, ", D, "]");
  TORCH_CHECK((positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt) && positions.dim() == 1 &&
              positions.size(0) == B, "kvscope::decode_layer: positions must be int32/int64 [", B, "]");
  const float eps = static_cast<float>(eps_);
  at::Tensor qkv = at::empty({B, NQKV}, h.options());
  at::Tensor out = at::empty({B, E}, h.options());
  std::vector<float> a(B * std::max(E, I)), gu(B * std::max(2 * I, E));
  Int4Scratch scratch;
  const float* hp = h.data_ptr<float>();
  float* qp = qkv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* cs = cos_sin.data_ptr<float>();
  const bool pos32 = positions.scalar_type() == at::kInt;
  const void* pp = positions.data_ptr();
  // attention: RMSNorm, q/k/v, RoPE on q and k, the KV store and the attention, o + the residual
  for (int64_t b = 0; b < B; ++b) rms_norm_row(hp + b * E, input_norm.data_ptr<float>(), eps, E, a.data() + b * E);
  int4_matmul(wqkv, a.data(), B, qp, scratch);
  for (int64_t b = 0; b < B; ++b) {
    float* row = qp + b * NQKV;
    if (qkv_bias.has_value()) {
      const float* bias = qkv_bias->data_ptr<float>();
      for (int64_t n = 0; n < NQKV; ++n) row[n] += bias[n];
    }
    const int64_t pos = index_at(pp, pos32, b * positions.stride(0));
    TORCH_CHECK(pos >= 0 && pos < cos_sin.size(0), "kvscope::decode_layer: position ", pos, " beyond cos_sin's ",
                cos_sin.size(0));
    for (int64_t hh = 0; hh < H + Hk; ++hh) rope_row(row + hh * D, cs + pos * D, D);
  }
  const at::Tensor q = qkv.as_strided({B, H, D}, {NQKV, D, 1}, 0);              // views of the qkv rows
  const at::Tensor k = qkv.as_strided({B, Hk, D}, {NQKV, D, 1}, QD);
  const at::Tensor v = qkv.as_strided({B, Hk, D}, {NQKV, D, 1}, QD + KD);
  const at::Tensor attn = decode_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale);
  int4_matmul(wo, attn.data_ptr<float>(), B, op, scratch);                      // attn [B, H, D] as [B, H * D]
  for (int64_t i = 0; i < B * E; ++i) op[i] += hp[i];
  // MLP: RMSNorm, gate | up, SiLU-and-mul, down + the residual
  for (int64_t b = 0; b < B; ++b) rms_norm_row(op + b * E, post_norm.data_ptr<float>(), eps, E, a.data() + b * E);
  int4_matmul(wgu, a.data(), B, gu.data(), scratch);
  for (int64_t b = 0; b < B; ++b) silu_mul_row(gu.data() + b * 2 * I, gu.data() + b * 2 * I + I, I, a.data() + b * I);
  int4_matmul(wd, a.data(), B, gu.data(), scratch);                              // gu's storage: [B, E] now
  for (int64_t i = 0; i < B * E; ++i) op[i] += gu[i];
  return out;
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("int4_linear", &int4_linear);
  m.impl("decode_layer", &decode_layer);
}
"""

_NAME = "kvscope_cpu_kernels"
_state: dict[str, object] = {}          # "module": the loaded extension (None: unavailable); "build": a build process


def _isa() -> tuple[str, list[str]]:
    """The vector ISA of the build and its compiler flags: AVX2 (+ FMA, F16C) where torch's own kernels run AVX2
    or AVX-512, else none (the portable scalar build). Never -march=native: the build is cached by this key."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512"):
        return "avx2", ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return "default", []


def build_directory() -> Path:
    """Keyed on the torch version, the ISA and the source: a changed kernel builds afresh (in the background)
    instead of being rebuilt in place by the first engine that loads it."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "kvscope" / "torch_extensions")
    isa, flags = _isa()
    src = hashlib.sha1((_SOURCE + " ".join(flags)).encode()).hexdigest()[:10]
    return Path(root) / f"{_NAME}_torch{torch.__version__.replace('+', '_')}_{isa}_{src}"


def load():
    """The built extension (its CPU kernels registered for kvscope::decode_attention, kvscope::int4_linear and
    kvscope::decode_layer), or None where it cannot be built; tried once per process."""
    if "module" in _state:
        return _state["module"]
    _state["module"] = None
    try:
        from torch.utils.cpp_extension import load as load_extension
        isa, flags = _isa()
        d = build_directory()
        d.mkdir(parents=True, exist_ok=True)
        # a source file rather than load_inline, which prepends torch/extension.h: 70 s a build here against 30
        src = d / "cpu_kernels.cpp"
        if not src.exists() or src.read_text() != _SOURCE:
            tmp = d / f".cpu_kernels.{os.getpid()}.cpp"
            tmp.write_text(_SOURCE)
            os.replace(tmp, src)
        _state["module"] = load_extension(
            name=f"{_NAME}_{isa}", sources=[str(src)], build_directory=str(d),
            extra_cflags=["-O3", "-fopenmp", *flags], extra_ldflags=["-fopenmp"], is_python_module=False,
            verbose=False)
    except Exception as e:   # no compiler, no ninja, a failed build: the torch implementation stays
        log.warning("kvscope's C++ CPU kernels unavailable (%s), using the torch implementations",
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
    return _state["module"]


def loaded() -> bool:
    """Whether the C++ kernels serve kvscope::decode_attention, kvscope::int4_linear and kvscope::decode_layer on
    CPU tensors in this process."""
    return _state.get("module") is not None


def is_built() -> bool:
    return (build_directory() / f"{_NAME}_{_isa()[0]}.so").exists()


def prepare() -> None:
    """At an engine's start on the CPU: load the kernels if they are built, else start building them in a background
    process (at low priority) and keep the torch implementations until `poll` finds the build done."""
    if "module" in _state or "build" in _state:
        return
    if is_built():
        load()
        return
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
    code = "import os; os.nice(10); from engine.kernels.cpu_kernels import load; raise SystemExit(load() is None)"
    _state["build"] = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
    log.info("building the C++ CPU kernels in the background (once per machine, about half a minute); the torch "
             "implementations serve until it is done")


def poll() -> None:
    """Once a step: load the kernels when their background build has finished."""
    proc = _state.get("build")
    if proc is None or "module" in _state or proc.poll() is None:
        return
    if proc.returncode == 0:
        load()
        log.info("the C++ CPU kernels are built and serve from now on")
    else:
        _state["module"] = None
        log.warning("kvscope's C++ CPU kernels: the build failed (exit %d), using the torch implementations",
                    proc.returncode)

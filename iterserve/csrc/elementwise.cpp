// silu_and_mul, rope, moe_combine: the gated MLP's SiLU-and-multiply, RoPE over q and k, and the sum of
// a MoE layer's weighted expert outputs, one pass each, with torch's bits (eager torch: 3, 7 and 3 ops
// with their temporaries); and permute_columns, the q/k/v outputs of a GGUF's projection put back in
// Hugging Face's order.
#include "kernel_common.h"
#include "kernels.h"
#include "lanes.h"
#include "work_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace iterserve {
namespace {

// ---- element-wise steps of a layer: the gated MLP's SiLU-and-multiply, RoPE ----------------------
// Eager torch runs each as several ops, each a dispatch, a pass over memory and a temporary: the
// MLP's split + silu + mul (two [T, F] temporaries), RoPE's slices + neg + cat + two muls + add (five
// temporaries) for q and k. Here each is one pass. Both keep torch's order of rounding (bf16 inputs
// rounded to bf16 after each op torch runs as its own, float32 ones never fused into an FMA), and
// SiLU takes exp from SLEEF's expf_u10 formula, the one torch's vectorised silu calls: the outputs
// are torch's bits (tests/test_cpu_elementwise.py; torch's own scalar tail, std::exp, may differ in
// the last float32 bit, which a bf16 output rounds away but a rare tie). Each element alike whatever
// its row or column (batch-invariant). A few rows run inline on the calling thread: a decode step
// would pay more to wake the pool than the work takes (for_rows, work_pool.h). SmolLM2-135M shapes, bf16, 2-core
// Zen 5 VM, per layer: SiLU-and-multiply of 2048 x 1536 0.86 vs torch's 1.55 ms (32 rows: 23 vs
// 166 us, torch's OpenMP wake-up), RoPE of 2048 x 12 heads 0.19 vs 1.17 ms, 1 row 1.0 vs 19 us.


// The value rounded to T, as torch leaves it between two of its ops: to bf16 for bf16 data; for
// float32 data a value the compiler may not fuse into an FMA with the next op (gcc contracts a*b + c
// by default), which torch's separate ops never do.
template <typename T, typename V>
inline V as_stored(V v) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    if constexpr (std::is_same_v<V, float>) {
      uint16_t b;
      store(&b, v);
      return load(b);
    } else {
      return lv_round_bf16(v);
    }
  } else {
#if defined(__x86_64__) && defined(__GNUC__)
    asm("" : "+v"(v));
#else
    volatile V keep = v;
    v = keep;
#endif
    return v;
  }
}

// out[t, j] = silu(g[t, j]) * u[t, j] with g, u the halves of x[t] = [g | u]: silu(v) = v / (1 + exp(-v))
// in float32 (torch's formula), rounded to T, then the product rounded to T.
template <typename T>
void silu_and_mul_row(const T* g, const T* u, T* o, int64_t F) {
  int64_t j = 0;
#if defined(__AVX512F__) || ISV_AVX2_FMA
  const LVec one = lv_set1(1.f);
  for (; j + kLW <= F; j += kLW) {
    const LVec v = lv_load(g + j);
    const LVec s = as_stored<T>(lv_div(v, lv_add(one, lv_expf_u10(lv_neg(v)))));
    lv_store(o + j, lv_mul(s, lv_load(u + j)));
  }
#endif
  for (; j < F; ++j) {
    const float v = load(g[j]);
    store(o + j, as_stored<T>(v / (1.f + exp_sleef(-v))) * load(u[j]));
  }
}

// One head's row of RoPE in Hugging Face's rotate-half form over its first 2 * half channels:
// out = x * cos + rot * sin, rot = (-x2, x1), each product and the sum rounded to T as torch's
// separate ops do (a bf16 x bf16 product is exact in float32, so bf16 rounds it once, as torch);
// channels 2 * half .. D pass through (partial rotary).
template <typename T>
void rope_row(const T* x, const T* c, const T* s, T* o, int64_t half, int64_t D) {
  const T* x2 = x + half;
  int64_t i = 0;
#if defined(__AVX512F__) || ISV_AVX2_FMA
  for (; i + kLW <= half; i += kLW) {
    const LVec a = lv_load(x + i), b = lv_load(x2 + i);
    lv_store(o + i, lv_add(as_stored<T>(lv_mul(a, lv_load(c + i))),
                           as_stored<T>(lv_mul(lv_neg(b), lv_load(s + i)))));
    lv_store(o + half + i, lv_add(as_stored<T>(lv_mul(b, lv_load(c + half + i))),
                                  as_stored<T>(lv_mul(a, lv_load(s + half + i)))));
  }
#endif
  for (; i < half; ++i) {
    const float a = load(x[i]), b = load(x2[i]);
    store(o + i, as_stored<T>(a * load(c[i])) + as_stored<T>(-b * load(s[i])));
    store(o + half + i, as_stored<T>(b * load(c[half + i])) + as_stored<T>(a * load(s[half + i])));
  }
  if (2 * half < D) std::memcpy(o + 2 * half, x + 2 * half, (D - 2 * half) * sizeof(T));
}

// Columns [j0, j1) of moe_combine: for each pair i in order, out[tok[i]] += (h[i] * w[i]) rounded to
// T, the sum rounded to T: torch's mul (float32), .to(T) and one index_add_ per expert (a token once
// per expert: each add rounded to T), as transformers' loop adds them.
template <typename T, typename W>
void moe_combine_cols(const T* h, const W* w, const int64_t* tok, int64_t P, T* out, int64_t H, int64_t j0,
                      int64_t j1) {
  for (int64_t i = 0; i < P; ++i) {
    const float wi = load(w[i]);
    const T* hr = h + i * H;
    T* o = out + tok[i] * H;
    int64_t j = j0;
#if defined(__AVX512F__) || ISV_AVX2_FMA
    const LVec wv = lv_set1(wi);
    for (; j + kLW <= j1; j += kLW) lv_store(o + j, lv_add(lv_load(o + j), as_stored<T>(lv_mul(lv_load(hr + j), wv))));
#endif
    for (; j < j1; ++j) store(o + j, load(o[j]) + as_stored<T>(load(hr[j]) * wi));
  }
}

}  // namespace

// The output of a mixture-of-experts layer: h [P, H] (each (token, expert) pair's expert output),
// w [P] (its router weight, float32 or h's dtype), tokens [P] (its token) -> [T, H] of h's dtype,
// each token's pairs added in P's order from zero, every add rounded to h's dtype. (One torch
// index_add_ over all pairs would sum a bf16 token's duplicates in float32 and round once: not
// transformers' bits.) Eager torch's mul + to + index_add_ paid ~60 us
// per index_add_ of one bf16 decode row (its OpenMP wake-up); here a decode row takes ~1 us inline.
// Columns split over the pool when large, each column's pairs still added in order.
at::Tensor moe_combine(const at::Tensor& h_in, const at::Tensor& w_in, const at::Tensor& tokens_in, int64_t T) {
  const auto st = h_in.scalar_type();
  TORCH_CHECK(h_in.dim() == 2 && (st == at::kFloat || st == at::kBFloat16), "h must be [P, H] float32 or bfloat16");
  const int64_t P = h_in.size(0), H = h_in.size(1);
  TORCH_CHECK(w_in.dim() == 1 && w_in.size(0) == P && (w_in.scalar_type() == at::kFloat || w_in.scalar_type() == st),
              "w must be [P] float32 or h's dtype");
  TORCH_CHECK(tokens_in.dim() == 1 && tokens_in.size(0) == P && tokens_in.scalar_type() == at::kLong,
              "tokens must be [P] int64");
  const at::Tensor h = h_in.contiguous(), w = w_in.contiguous(), tokens = tokens_in.contiguous();
  const int64_t* tok = tokens.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < P; ++i) TORCH_CHECK(tok[i] >= 0 && tok[i] < T, "moe_combine: token ", tok[i], " not in 0..", T - 1);
  at::Tensor out = at::empty({T, H}, h.options());
  std::memset(out.data_ptr(), 0, out.nbytes());
  auto run = [&](auto* op, const auto* wp) {
    using E = std::remove_pointer_t<decltype(op)>;
    const E* hp = ptr<E>(h);
    if (P * H < kElemInline) return moe_combine_cols<E>(hp, wp, tok, P, op, H, 0, H);
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(P * H / kElemChunk, H / kLW));
    const int64_t step = (H / kLW + chunks - 1) / chunks * kLW;  // whole vectors a chunk
    WorkPool::instance().run((H + step - 1) / step, [&](int64_t c) {
      moe_combine_cols<E>(hp, wp, tok, P, op, H, c * step, std::min(H, c * step + step));
    });
  };
  auto with_w = [&](auto* op) {
    if (w.scalar_type() == at::kFloat) run(op, w.const_data_ptr<float>());
    else run(op, reinterpret_cast<const uint16_t*>(w.const_data_ptr()));
  };
  if (st == at::kFloat) with_w(reinterpret_cast<float*>(out.data_ptr()));
  else with_w(reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

// x [T, 2F] (rows may be strided, columns contiguous) -> [T, F] of x's dtype (float32 or bf16).
at::Tensor silu_and_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % 2 == 0, "x must be [T, 2F]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t T = x.size(0), F = x.size(1) / 2, ld = x.stride(0);
  at::Tensor out = at::empty({T, F}, x.options());
  auto run = [&](auto* op) {
    using E = std::remove_pointer_t<decltype(op)>;
    const E* xp = ptr<E>(x);
    for_rows(T, F, [&](int64_t t) { silu_and_mul_row<E>(xp + t * ld, xp + t * ld + F, op + t * F, F); });
  };
  if (x.scalar_type() == at::kFloat) run(reinterpret_cast<float*>(out.data_ptr()));
  else run(reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}


// x [T, N] bf16 (rows may be strided, columns contiguous) -> a new [T, N] float32 of the same values (bf16
// widens exactly): the LM head's logits for the sampler. torch's .float() took ~0.5 ms of the 1B's 16-row
// step (16 x 49,152; 0.17 ms timed alone: in a step its OpenMP thread had gone to sleep); here the rows
// run on the pool (for_rows).
at::Tensor widen_bf16(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "widen_bf16 takes [T, N] bf16 rows with contiguous columns");
  const int64_t T = x.size(0), N = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({T, N}, x.options().dtype(at::kFloat));
  const uint16_t* xp = ptr<uint16_t>(x);
  float* op = out.data_ptr<float>();
  for_rows(T, N, [&](int64_t t) {
    const uint16_t* src = xp + t * ld;
    float* dst = op + t * N;
    int64_t j = 0;
#if ISV_LANES
    for (; j + kLW <= N; j += kLW) lv_store(dst + j, lv_load(src + j));
#endif
    for (; j < N; ++j) dst[j] = load(src[j]);
  });
  return out;
}

// y [T, N] (rows may be strided, columns contiguous), order [N] int64, a permutation of 0 .. N - 1 ->
// a new [T, N] with out[t, j] = y[t, order[j]]: torch.gather(y, -1, order.expand(T, N))'s values, for
// CpuLinear.out_order (llama.cpp stores a Llama's q and k rows in another order than Hugging Face's).
// torch's gather expanded the index into a [T, N] copy and, from 32,768 elements (a 16-row step of the
// 1B's q/k/v), woke its OpenMP thread: 50 us a call with OMP_WAIT_POLICY=PASSIVE on 2 cores. Here a
// few rows run on the calling thread and more on the pool (for_rows).
at::Tensor permute_columns(const at::Tensor& y_in, const at::Tensor& order_in) {
  TORCH_CHECK(y_in.dim() == 2, "y must be [T, N]");
  TORCH_CHECK(order_in.dim() == 1 && order_in.scalar_type() == at::kLong && order_in.size(0) == y_in.size(1),
              "order must be [N] int64, N = y's columns");
  const at::Tensor y = y_in.stride(1) == 1 ? y_in : y_in.contiguous();
  const at::Tensor order = order_in.contiguous();
  const int64_t T = y.size(0), N = y.size(1), ld = y.stride(0);
  const int64_t* op = order.const_data_ptr<int64_t>();
  for (int64_t j = 0; j < N; ++j) TORCH_CHECK(op[j] >= 0 && op[j] < N, "order[", j, "] = ", op[j], " is outside 0 .. ", N - 1);
  at::Tensor out = at::empty({T, N}, y.options());
  auto run = [&](auto* dst) {
    using E = std::remove_pointer_t<decltype(dst)>;
    const E* src = reinterpret_cast<const E*>(y.const_data_ptr());
    for_rows(T, N, [&](int64_t t) {
      const E* row = src + t * ld;
      E* o = dst + t * N;
      for (int64_t j = 0; j < N; ++j) o[j] = row[op[j]];
    });
  };
  switch (y.element_size()) {
    case 2: run(reinterpret_cast<uint16_t*>(out.data_ptr())); break;
    case 4: run(reinterpret_cast<uint32_t*>(out.data_ptr())); break;
    default: TORCH_CHECK(false, "permute_columns takes 2- or 4-byte elements (bf16, fp16, float32), not ", y.scalar_type());
  }
  return out;
}

// x [T, H, D] (heads and rows may be strided: q and k as one view of the fused QKV output), cos and
// sin [T, rd] of x's dtype, rd even and <= D -> a new contiguous [T, H, D].
at::Tensor rope(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x_in.dim() == 3 && cos_in.dim() == 2 && sin_in.sizes() == cos_in.sizes() &&
              cos_in.size(0) == x_in.size(0), "x must be [T, heads, D], cos and sin [T, rd]");
  const auto st = x_in.scalar_type();
  TORCH_CHECK((st == at::kFloat || st == at::kBFloat16) && cos_in.scalar_type() == st && sin_in.scalar_type() == st,
              "x, cos and sin must be all float32 or all bfloat16");
  const int64_t T = x_in.size(0), H = x_in.size(1), D = x_in.size(2), rd = cos_in.size(1);
  TORCH_CHECK(rd % 2 == 0 && rd <= D, "the rotary dim must be even and at most head_dim");
  const at::Tensor x = x_in.stride(2) == 1 ? x_in : x_in.contiguous();
  const at::Tensor c = cos_in.stride(1) == 1 ? cos_in : cos_in.contiguous();
  const at::Tensor s = sin_in.stride(1) == 1 ? sin_in : sin_in.contiguous();
  at::Tensor out = at::empty({T, H, D}, x.options());
  const int64_t sx = x.stride(0), sh = x.stride(1), sc = c.stride(0), ss = s.stride(0);
  auto run = [&](auto* op) {
    using E = std::remove_pointer_t<decltype(op)>;
    const E *xp = ptr<E>(x), *cp = ptr<E>(c), *sp = ptr<E>(s);
    for_rows(T, H * D, [&](int64_t t) {
      for (int64_t h = 0; h < H; ++h)
        rope_row<E>(xp + t * sx + h * sh, cp + t * sc, sp + t * ss, op + (t * H + h) * D, rd / 2, D);
    });
  };
  if (st == at::kFloat) run(reinterpret_cast<float*>(out.data_ptr()));
  else run(reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

}  // namespace iterserve

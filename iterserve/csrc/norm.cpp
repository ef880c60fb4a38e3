// rms_norm: RMSNorm of bf16 or float32 rows in one pass (eager torch runs it as eight ops); add_rms_norm:
// a residual add and the norm after it, in one pass.
#include "kernel_common.h"
#include "kernels.h"
#include "lanes.h"
#include "work_pool.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace iterserve {
namespace {

// ---- RMSNorm in bf16, in Hugging Face's order of rounding -------------------------------------
// out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))), x widened to float32: one pass per row instead of
// eager torch's eight ops (cast, pow, mean, add, rsqrt, mul, cast, mul), each a call with its own
// dispatch and its own pass over memory (61 norms a step). Each row is computed alone, in one fixed
// order, whatever the row count (batch-invariant); only the sum of squares' order differs from
// torch's, which can move the normalised x by one bf16 ulp (the output, rounded again after the
// weight, by up to two).
// unit_offset: Gemma's form, whose weight is stored as an offset from 1, in Gemma's own order of
// rounding (transformers' GemmaRMSNorm scales in float32 and rounds once): out = bf16(x * r * (1 + w)).
// T = float: a float32 model's rows and weight (AVX2-only CPUs run float32), the same formulas with no
// rounding to bf16: 28.6 us a 576-wide row through eager torch on a Zen 3 core, 61 norms a step.
template <typename T>
void rms_norm_row(const T* xr, const T* wp, T* orow, int64_t H, float e, bool unit_offset) {
  float ss = 0.f;
  int64_t d = 0;
#if defined(__AVX512F__)  // over the lanes, AVX-512 only: on AVX2 the plain loop's order is kept (its bits)
  LVec acc = lv_zero();
  for (; d + kLW <= H; d += kLW) {
    const LVec v = lv_load(xr + d);
    acc = lv_fma(v, v, acc);
  }
  ss = lv_sum(acc);
#endif
  for (; d < H; ++d) ss += load(xr[d]) * load(xr[d]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + e);
  if (unit_offset) {
    for (int64_t c = 0; c < H; ++c) store(orow + c, load(xr[c]) * r * (1.f + load(wp[c])));
    return;
  }
  for (int64_t c = 0; c < H; ++c) {
    T y;
    store(&y, load(xr[c]) * r);
    store(orow + c, load(wp[c]) * load(y));
  }
}

// a decode step's few rows inline (waking the pool costs more than they take); prefill rows spread
template <typename F>
void norm_rows(int64_t T, const F& row) {
  if (T < 64) {
    for (int64_t t = 0; t < T; ++t) row(t);
  } else {
    WorkPool::instance().run((T + 31) / 32, [&](int64_t c) {
      for (int64_t t = c * 32; t < std::min(T, c * 32 + 32); ++t) row(t);
    });
  }
}

void check_norm_args(const at::Tensor& x, const at::Tensor& w) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dt == at::kBFloat16 || dt == at::kFloat) && w.scalar_type() == dt &&
              w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(),
              "x must be [T, H] bfloat16 or float32 and the weight [H] of its dtype");
}

// the element type of a bf16 (its bits) or float32 tensor
template <typename F>
void by_dtype(const at::Tensor& x, const F& f) {
  if (x.scalar_type() == at::kFloat) f(float{});
  else f(uint16_t{});
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps, bool unit_offset) {
  check_norm_args(x_in, w);
  const at::Tensor x = x_in.contiguous();
  const int64_t H = x.size(1);
  at::Tensor out = at::empty_like(x);
  by_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    const T *xp = ptr<T>(x), *wp = ptr<T>(w);
    T* op = reinterpret_cast<T*>(out.data_ptr());
    norm_rows(x.size(0), [&](int64_t t) {
      rms_norm_row(xp + t * H, wp, op + t * H, H, static_cast<float>(eps), unit_offset);
    });
  });
  return out;
}

// The residual add and the RMSNorm after it (a decoder layer's `x = x + a; h = norm(x)`) in one pass
// per row: (s, rms_norm(s)) with s = x + a in the rows' dtype, torch's add (the sum in float32, rounded once to bf16), and
// the norm above on s while its row is in L1. Eager torch reads x and a, writes s, reads s again:
// 2048 x 576 0.20 vs 0.30 ms (add + the norm kernel), 1 row 3.6 vs 4.4 us.
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& a_in, const at::Tensor& w,
                                     double eps, bool unit_offset) {
  check_norm_args(x_in, w);
  TORCH_CHECK(a_in.sizes() == x_in.sizes() && a_in.scalar_type() == x_in.scalar_type(), "a must be x's shape and dtype");
  const at::Tensor x = x_in.contiguous(), a = a_in.contiguous();
  const int64_t H = x.size(1);
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  by_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    const T *xp = ptr<T>(x), *ap = ptr<T>(a), *wp = ptr<T>(w);
    T *sp = reinterpret_cast<T*>(sum.data_ptr()), *op = reinterpret_cast<T*>(out.data_ptr());
    norm_rows(x.size(0), [&](int64_t t) {
      const T *xr = xp + t * H, *ar = ap + t * H;
      T* sr = sp + t * H;
      for (int64_t c = 0; c < H; ++c) store(sr + c, load(xr[c]) + load(ar[c]));
      rms_norm_row(sr, wp, op + t * H, H, static_cast<float>(eps), unit_offset);
    });
  });
  return {sum, out};
}

}  // namespace iterserve

// first_argmax: each row's argmax as torch.argmax defines it (the first of equal maxima; a row with a
// NaN: its first NaN), for the sampler's greedy choice. torch's max(dim=-1) took ~0.9 ms of a 1B's
// 16-row decode step on the 2-core AMX Xeon (16 x 49,152 float32 logits; 0.25 ms timed alone: in a
// step its OpenMP thread had gone to sleep), its index bookkeeping a compare and blend a lane. Here a
// row is two passes over lanes: the largest value (NaNs noted apart, never taken), then the first
// position holding it; rows over the pool (for_rows).
#include "kernel_common.h"
#include "kernels.h"
#include "lanes.h"
#include "work_pool.h"

#include <algorithm>
#include <cmath>

namespace iterserve {
namespace {

int64_t first_argmax_row(const float* x, int64_t n) {
  // the largest non-NaN value, and whether there is a NaN
  float m = -INFINITY;
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  {
    __m512 v = _mm512_set1_ps(-INFINITY);
    __mmask16 un = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 e = _mm512_loadu_ps(x + i);
      un |= _mm512_cmp_ps_mask(e, e, _CMP_UNORD_Q);
      v = _mm512_max_ps(e, v);  // the second operand where either is NaN: a NaN never taken
    }
    m = _mm512_reduce_max_ps(v);
    nan = un != 0;
  }
#elif ISV_AVX2_FMA
  {
    __m256 v = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 e = _mm256_loadu_ps(x + i);
      un = _mm256_or_ps(un, _mm256_cmp_ps(e, e, _CMP_UNORD_Q));
      v = _mm256_max_ps(e, v);
    }
    alignas(32) float t[8];
    _mm256_store_ps(t, v);
    for (float e : t) m = std::max(m, e);
    nan = _mm256_movemask_ps(un) != 0;
  }
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) nan = true;
    else m = std::max(m, x[i]);
  }
  if (nan) {  // torch counts a NaN the largest: the first one
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  // the first position holding m (an all -inf row: 0); -0 and +0 compare equal, as in torch's scan
  i = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mv, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(eq);
  }
#elif ISV_AVX2_FMA
  const __m256 mv = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
    if (eq) return i + __builtin_ctz(eq);
  }
#endif
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return 0;  // n == 0 is refused by the caller
}

}  // namespace

// x [T, V] float32 (rows may be strided, values contiguous) -> [T] int64: x.argmax(dim=-1)'s indices
at::Tensor first_argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "first_argmax takes [T, V] float32 rows with contiguous values");
  TORCH_CHECK(x.size(1) > 0, "first_argmax: rows of no values have no argmax");
  const int64_t T = x.size(0), V = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({T}, x.options().dtype(at::kLong));
  const float* xp = x.const_data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for_rows(T, V, [&](int64_t t) { op[t] = first_argmax_row(xp + t * ld, V); });
  return out;
}

}  // namespace iterserve

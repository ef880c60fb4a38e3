// lora_sgmv: multi-LoRA deltas, each row through its own adapter slot's A and B only.
#include "kernel_common.h"
#include "kernels.h"
#include "lanes.h"
#include "work_pool.h"

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

namespace iterserve {
namespace {

// ---- multi-LoRA deltas: each row through its own adapter slot's A and B (SGMV / BGMV style) ------
// out[r] += B[s] (A[s] x[r]) for s = row_slot[r] >= 0, in place; rows with slot -1 are untouched.
// A [slots, S*R, in] stacks a fused module's S projections' A; B [slots, S*R, N] is block-diagonal
// (projection j's R rows feed only its columns [bounds[j], bounds[j+1])), scaling folded in. Only
// the diagonal blocks are read: torch's masked path multiplied every row by every slot's A and by
// the whole B, slots x S times the arithmetic, ~12 ms of a 16-row SmolLM2-135M step over 4 adapters.
// Rows are grouped by slot, up to four at a time, so each A and B vector loaded serves four rows;
// float32 accumulation, one rounding into out. The vector type is AVX-512's, AVX2's, or one float
// (the scalar build: the same loops, each "vector" a single lane; lanes.h).

// NR rows of one slot (rows[0..NR)): xf holds them widened to float [NR, K]; h gets A x [NR, SR].
template <int NR, typename T, typename C>
void lora_rows(const int64_t* rows, const float* xf, const C* a, const C* b, const std::vector<int64_t>& bounds,
               int64_t R, int64_t K, int64_t N, float* h, T* out) {
  const int64_t SR = static_cast<int64_t>(bounds.size() - 1) * R;
  for (int64_t k = 0; k < SR; ++k) {  // shrink: h[r, k] = A[k] . x[r]
    const C* ak = a + k * K;
    LVec acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = lv_zero();
    int64_t i = 0;
    for (; i + kLW <= K; i += kLW) {
      const LVec av = lv_load(ak + i);
      for (int r = 0; r < NR; ++r) acc[r] = lv_fma(av, lv_load(xf + r * K + i), acc[r]);
    }
    for (int r = 0; r < NR; ++r) {
      float sum = lv_sum(acc[r]);
      for (int64_t t = i; t < K; ++t) sum += load(ak[t]) * xf[r * K + t];
      h[r * SR + k] = sum;
    }
  }
  for (size_t j = 0; j + 1 < bounds.size(); ++j) {  // expand: projection j's R values into its columns
    const C* bj = b + static_cast<int64_t>(j) * R * N;
    const float* hj = h + static_cast<int64_t>(j) * R;
    const int64_t lo = bounds[j], hi = bounds[j + 1];
    int64_t c = lo;
    for (; c + kLW <= hi; c += kLW) {
      LVec acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = lv_zero();
      for (int64_t t = 0; t < R; ++t) {
        const LVec bv = lv_load(bj + t * N + c);
        for (int r = 0; r < NR; ++r) acc[r] = lv_fma(lv_set1(hj[r * SR + t]), bv, acc[r]);
      }
      for (int r = 0; r < NR; ++r) {
        T* o = out + rows[r] * N + c;
        lv_store(o, lv_add(lv_load(o), acc[r]));
      }
    }
    for (; c < hi; ++c) {
      for (int r = 0; r < NR; ++r) {
        float sum = 0.f;
        for (int64_t t = 0; t < R; ++t) sum += hj[r * SR + t] * load(bj[t * N + c]);
        T* o = out + rows[r] * N + c;
        store(o, load(*o) + sum);
      }
    }
  }
}

template <typename T, typename C>
void lora_sgmv_impl(const T* x, const C* a, const C* b, const int32_t* row_slot, int64_t T_rows, int64_t slots,
                    int64_t K, int64_t N, int64_t R, const std::vector<int64_t>& bounds, T* out) {
  const int64_t SR = static_cast<int64_t>(bounds.size() - 1) * R;
  std::vector<int64_t> order;  // the adapter rows, grouped by slot
  std::vector<std::pair<int64_t, int64_t>> items;  // (first index into order, row count): <= 4 rows of one slot
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t first = static_cast<int64_t>(order.size());
    for (int64_t r = 0; r < T_rows; ++r)
      if (row_slot[r] == s) order.push_back(r);
    for (int64_t i = first; i < static_cast<int64_t>(order.size()); i += 4)
      items.emplace_back(i, std::min<int64_t>(4, static_cast<int64_t>(order.size()) - i));
  }
  auto item = [&](int64_t n) {
    thread_local std::vector<float> xf, h;
    const auto [first, count] = items[n];
    const int64_t* rows = order.data() + first;
    const int64_t s = row_slot[rows[0]];
    xf.resize(4 * K);
    h.resize(4 * SR);
    for (int64_t r = 0; r < count; ++r)
      for (int64_t i = 0; i < K; ++i) xf[r * K + i] = load(x[rows[r] * K + i]);
    const C* as = a + s * SR * K;
    const C* bs = b + s * SR * N;
    if (count == 4) {
      lora_rows<4>(rows, xf.data(), as, bs, bounds, R, K, N, h.data(), out);
      return;
    }
    int64_t r = 0;
    if (count >= 2) {
      lora_rows<2>(rows, xf.data(), as, bs, bounds, R, K, N, h.data(), out);
      r = 2;
    }
    if (r < count) lora_rows<1>(rows + r, xf.data() + r * K, as, bs, bounds, R, K, N, h.data(), out);
  };
  // FMAs per row: SR * K to shrink, R * N to expand. Below ~64k FMAs in all (a few us), waking the
  // pool's second thread costs more than it saves: a 1-row step's projections run inline.
  const int64_t work = static_cast<int64_t>(order.size()) * (SR * K + R * N);
  if (items.size() > 1 && work >= (1 << 16)) {
    WorkPool::instance().run(static_cast<int64_t>(items.size()), item);
  } else {
    for (size_t n = 0; n < items.size(); ++n) item(static_cast<int64_t>(n));
  }
}

}  // namespace

// x [T, K], a [slots, S*R, K], b [slots, S*R, N], row_slot [T] int32, bounds: S+1 column offsets
// (0 .. N), out [T, N] contiguous, updated in place. x/out float32 or bf16, a/b float32 or bf16.
void lora_sgmv(const at::Tensor& x_in, const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& row_slot_in,
               const std::vector<int64_t>& bounds, at::Tensor& out) {
  TORCH_CHECK(a_in.dim() == 3 && b_in.dim() == 3 && a_in.size(0) == b_in.size(0) && a_in.size(1) == b_in.size(1) &&
              a_in.scalar_type() == b_in.scalar_type(), "a must be [slots, S*R, in], b [slots, S*R, out], one dtype");
  const int64_t slots = a_in.size(0), SR = a_in.size(1), K = a_in.size(2), N = b_in.size(2);
  TORCH_CHECK(bounds.size() >= 2 && SR % static_cast<int64_t>(bounds.size() - 1) == 0 && bounds.front() == 0 &&
              bounds.back() == N, "bounds must be S+1 column offsets from 0 to out's width");
  for (size_t j = 0; j + 1 < bounds.size(); ++j) TORCH_CHECK(bounds[j] <= bounds[j + 1], "bounds must not decrease");
  TORCH_CHECK(out.is_contiguous() && out.numel() % N == 0 && x_in.numel() == out.numel() / N * K &&
              x_in.scalar_type() == out.scalar_type(), "out must be contiguous [T, out], x [T, in], one dtype");
  const int64_t T_rows = out.numel() / N;
  TORCH_CHECK(row_slot_in.scalar_type() == at::kInt && row_slot_in.numel() == T_rows, "row_slot must be [T] int32");
  const auto ft = out.scalar_type(), wt = a_in.scalar_type();
  TORCH_CHECK((ft == at::kFloat || ft == at::kBFloat16) && (wt == at::kFloat || wt == at::kBFloat16),
              "x/out and a/b must be float32 or bfloat16");
  const at::Tensor x = x_in.contiguous(), a = a_in.contiguous(), b = b_in.contiguous(),
                   row_slot = row_slot_in.contiguous();
  const int64_t R = SR / static_cast<int64_t>(bounds.size() - 1);
  const int32_t* rs = ptr<int32_t>(row_slot);
  for (int64_t r = 0; r < T_rows; ++r) TORCH_CHECK(rs[r] < slots, "row_slot out of range");
  auto run = [&](auto* op, const auto* wa) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(op)>>;
    using C = std::remove_const_t<std::remove_pointer_t<decltype(wa)>>;
    lora_sgmv_impl<T, C>(ptr<T>(x), wa, ptr<C>(b), rs, T_rows, slots, K, N, R, bounds, op);
  };
  auto by_weight = [&](auto* op) {
    if (wt == at::kFloat) run(op, ptr<float>(a));
    else run(op, ptr<uint16_t>(a));
  };
  if (ft == at::kFloat) by_weight(reinterpret_cast<float*>(out.data_ptr()));
  else by_weight(reinterpret_cast<uint16_t*>(out.data_ptr()));
}

}  // namespace iterserve

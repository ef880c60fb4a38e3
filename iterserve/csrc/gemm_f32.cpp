// f32_gemm: float32 x @ w.T from float32 weights, each output one dot product in a fixed order,
// whatever the step's row count: the projections of a batch-invariant float32 run
// (EngineConfig.batch_invariant on a CPU without AVX512-BF16, e.g. AVX2-only Zen 3).
#include "kernel_common.h"
#include "kernels.h"
#include "lanes.h"
#include "work_pool.h"

#include <algorithm>
#include <cmath>

namespace iterserve {
namespace {

// ---- float32 GEMM with one reduction order per output ----------------------------------------------
// out[m, n] = dot(x[m], w[n]) over K, always as: lane l of one LVec accumulator sums inputs
// k = l, l + kLW, l + 2 kLW, ... (one FMA each, in order), lv_sum adds the lanes, and the inputs past
// the last full vector (K % kLW) are added one at a time with fma. The register blocking (how many
// rows and outputs share a pass over K) decides only which dots run side by side, never a dot's
// order, so a row's outputs are the same bits in a step of 1 row or of 1000 (the tiled bf16 GEMM
// has this property too; f32_bf16w_gemm does not: its 1-3 row tiles split k into two chains).
// Weights stay in their rows ([N, K], as F.linear takes them): a panel of outputs is read from L2 by
// every row block, the row block's x from L1.
constexpr int64_t kPanelBytes = 192 << 10;  // the weight rows one pass over the row blocks reuses

// MB rows x NB outputs: out[i * ldo + j] = dot(x row i, w row j).
template <int MB, int NB>
void dot_block(const float* x, int64_t K, const float* w, float* out, int64_t ldo) {
  LVec acc[MB][NB];
#pragma GCC unroll 32
  for (int i = 0; i < MB * NB; ++i) acc[i / NB][i % NB] = lv_zero();
  const int64_t kv = K / kLW * kLW;
  for (int64_t k = 0; k < kv; k += kLW) {
    LVec xv[MB];
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) xv[i] = lv_load(x + i * K + k);
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const LVec wv = lv_load(w + j * K + k);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) acc[i][j] = lv_fma(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = lv_sum(acc[i][j]);
      for (int64_t k = kv; k < K; ++k) s = std::fma(x[i * K + k], w[j * K + k], s);
      out[i * ldo + j] = s;
    }
}

// MB rows x outputs [n0, n1): blocks of NB outputs, the rest one at a time (the same dots).
template <int MB, int NB>
void dot_rows(const float* x, int64_t K, const float* w, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) dot_block<MB, NB>(x, K, w + n * K, out + n, ldo);
  for (; n < n1; ++n) dot_block<MB, 1>(x, K, w + n * K, out + n, ldo);
}

// Register blocks (AVX2's 16 registers: MB x NB accumulators + MB rows of x + one weight): 3 x 4
// for steps of many rows; a step of 1 or 2 rows (and a block's last rows) runs wider in outputs,
// so that 8 FMA chains hide the FMA's latency.
void dot_panel(const float* x, int64_t M, int64_t K, const float* w, float* out, int64_t N, int64_t n0,
               int64_t n1) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) dot_rows<3, 4>(x + m * K, K, w, out + m * N, N, n0, n1);
  if (M - m == 2) dot_rows<2, 6>(x + m * K, K, w, out + m * N, N, n0, n1);
  if (M - m == 1) dot_rows<1, 8>(x + m * K, K, w, out + m * N, N, n0, n1);
}

}  // namespace

// x [M, K] float32; w [N, K] float32 (contiguous) -> [M, N] float32.
at::Tensor f32_gemm(const at::Tensor& x_in, const at::Tensor& w) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) == x_in.size(1),
              "w must be contiguous [N, K] float32, K as x's");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const int64_t panel = std::max<int64_t>(24, kPanelBytes / (K * 4) / 24 * 24);  // 24: whole 4-, 6- and 8-blocks
  const float* xp = x.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  iterserve::parallel_ranges(N, kRanges, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n += panel) dot_panel(xp, M, K, wp, op, N, n, std::min(end, n + panel));
  });
  return out;
}

bool f32_gemm_is_vectorised() { return ISV_LANES; }

}  // namespace iterserve

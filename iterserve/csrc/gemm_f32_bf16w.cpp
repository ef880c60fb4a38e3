// f32_bf16w_gemm: float32 projections from bf16 weights on CPUs without fast bf16 (AVX2 + FMA):
// half the bytes of a float32 weight, and none of MKL's small-M overhead.
#include "kernel_common.h"
#include "kernels.h"
#include "lanes.h"
#include "work_pool.h"

#include <algorithm>

namespace iterserve {
namespace {

// ---- float32 x bf16-weight GEMM (AVX2 + FMA): out[m, n] = sum_k x[m, k] * w[n, k] -----------------
// For float32 engines on CPUs without fast bf16 (no AVX512-BF16): a decode step reads every weight
// once, so storing the weights as bf16 halves the bytes read, and widening bf16 to float32 is a
// 16-bit shift. (MKL's float32 GEMM is also slow at a few rows on AMD: docs/profile.md.)
// Layout, made by pack_bf16_f32 (cpu_linear.py): w [ceil(N/16), K, 16] bfloat16, zero-padded; in a
// tile's 16 values for input k, position 2j holds output j and 2j+1 output 8+j, so one 32-byte load
// read as 8 uint32 gives outputs 0..7 by a shift left (even halves) and 8..15 by masking the low
// halves away (odd ones), with no lane shuffles. MB rows x 16 outputs of accumulators (2 x MB of
// AVX2's 16 registers), each x value broadcast from its row; the tile's weights stay in cache
// across the row blocks of a larger M.
constexpr int64_t kF32Rows = 6;  // 12 accumulators + 2 weights + 1 broadcast of AVX2's 16 registers

template <int MB>
void f32_bf16w_tile(const float* x, int64_t K, const uint16_t* wt, float* out, int64_t N, int64_t n0) {
  const int64_t width = std::min<int64_t>(16, N - n0);
#if ISV_AVX2_FMA
  // Every loop over the accumulators is unrolled (the pragmas): otherwise gcc keeps the arrays in
  // memory and stores them at every k, which halved the speed. For 1-3 rows, two sets of
  // accumulators take even and odd k, so that 4+ FMA chains hide the FMA's latency.
  constexpr int S = MB <= 3 ? 2 : 1;
  __m256 lo[S][MB], hi[S][MB];
#pragma GCC unroll 16
  for (int i = 0; i < S * MB; ++i) lo[i / MB][i % MB] = hi[i / MB][i % MB] = _mm256_setzero_ps();
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t k = 0;
  auto step = [&](int64_t kk, __m256* l, __m256* h) __attribute__((always_inline)) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + kk * 16));
    const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(w, odd));
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m256 xi = _mm256_broadcast_ss(x + i * K + kk);
      l[i] = _mm256_fmadd_ps(w0, xi, l[i]);
      h[i] = _mm256_fmadd_ps(w1, xi, h[i]);
    }
  };
  for (; k + S <= K; k += S) {
    _mm_prefetch(reinterpret_cast<const char*>(wt + (k + 32) * 16), _MM_HINT_T0);
#pragma GCC unroll 2
    for (int u = 0; u < S; ++u) step(k + u, lo[u], hi[u]);
  }
  for (; k < K; ++k) step(k, lo[0], hi[0]);
  alignas(32) float res[MB][16];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) {
    __m256 l = lo[0][i], h = hi[0][i];
#pragma GCC unroll 2
    for (int u = 1; u < S; ++u) l = _mm256_add_ps(l, lo[u][i]), h = _mm256_add_ps(h, hi[u][i]);
    _mm256_store_ps(res[i], l);
    _mm256_store_ps(res[i] + 8, h);
  }
  for (int i = 0; i < MB; ++i) std::memcpy(out + i * N + n0, res[i], width * sizeof(float));
#else
  for (int i = 0; i < MB; ++i)
    for (int64_t c = 0; c < width; ++c) {
      const int64_t pos = c < 8 ? 2 * c : 2 * (c - 8) + 1;  // where output c sits in the tile
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[i * K + k] * load(wt[k * 16 + pos]);
      out[i * N + n0 + c] = s;
    }
#endif
}

void f32_bf16w_tile_rows(int64_t rows, const float* x, int64_t K, const uint16_t* wt, float* out, int64_t N,
                         int64_t n0) {
  switch (rows) {
#define ISV_ROWS(R) case R: return f32_bf16w_tile<R>(x, K, wt, out, N, n0);
    ISV_ROWS(1) ISV_ROWS(2) ISV_ROWS(3) ISV_ROWS(4) ISV_ROWS(5) ISV_ROWS(6)
#undef ISV_ROWS
  }
}

}  // namespace

// x [M, K] float32; w packed as above for N outputs -> [M, N] float32.
at::Tensor f32_bf16w_gemm(const at::Tensor& x_in, const at::Tensor& w, int64_t N) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be [M, K] float32");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + 15) / 16;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 3 && w.size(0) == tiles &&
              w.size(1) == K && w.size(2) == 16, "w must be contiguous [ceil(N/16), K, 16] bfloat16 (pack_bf16_f32)");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // row blocks of equal height (7 rows: 4 + 3, not 6 + 1)
  const int64_t blocks = (M + kF32Rows - 1) / kF32Rows, mb = (M + blocks - 1) / blocks;
  const float* xp = x.const_data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.const_data_ptr());
  float* op = out.data_ptr<float>();
  iterserve::parallel_ranges(tiles, kRanges, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m = 0; m < M; m += mb)
        f32_bf16w_tile_rows(std::min(mb, M - m), xp + m * K, K, wp + t * K * 16, op + m * N, N, t * 16);
  });
  return out;
}

bool f32_bf16w_gemm_is_vectorised() { return ISV_AVX2_FMA; }

}  // namespace iterserve

// Experiment (benchmarks only, not used by the engine): the LM head as GGUF Q8_0 keeps it, int8
// weights with one float scale per 32, against bf16 activations, for steps of a few rows.
// Why: at batch 1 the bf16 head (49152 x 576, 56 MB) is bound by reading its weights; Q8_0 halves
// that and is the checkpoint's own format. Each group of 32 int8 weights is widened to float32
// (vpmovsxbd + vcvtdq2ps) and multiplied with the row's activations; float32 accumulation.
// Built on demand by benchmarks/kernel_options.py (lm-head --q8-kernel).
#include <immintrin.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/all.h>

namespace {
template <int MB>
void rows(const float* x, int64_t K, const int8_t* w, const float* sc, at::BFloat16* out, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * K;
    const float* sr = sc + n * G;
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wr + g * 32))));
      __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wr + g * 32 + 16))));
      __m512 s = _mm512_set1_ps(sr[g]);
      for (int m = 0; m < MB; ++m) {
        const float* xr = x + m * K + g * 32;
        __m512 p = _mm512_mul_ps(w0, _mm512_loadu_ps(xr));
        p = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), p);
        acc[m] = _mm512_fmadd_ps(p, s, acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) out[m * N + n] = at::BFloat16(_mm512_reduce_add_ps(acc[m]));
  }
}

at::Tensor q8_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && w.dim() == 2 && w.size(1) == K && w.scalar_type() == at::kChar && w.is_contiguous(),
              "w must be contiguous [N, K] int8 with K % 32 == 0");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / 32),
              "scales must be contiguous [N, K/32] float32");
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = xf.const_data_ptr<float>();
  const int8_t* wp = w.const_data_ptr<int8_t>();
  const float* sp = scales.const_data_ptr<float>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 256, [&](int64_t b, int64_t e) {
    for (int64_t n0 = b; n0 < e; n0 += 64) {
      int64_t n1 = std::min(e, n0 + 64);
      for (int64_t m = 0; m < M;) {
        int64_t left = M - m;
        if (left >= 4) { rows<4>(xp + m * K, K, wp, sp, op + m * N, N, n0, n1); m += 4; }
        else if (left >= 2) { rows<2>(xp + m * K, K, wp, sp, op + m * N, N, n0, n1); m += 2; }
        else { rows<1>(xp + m * K, K, wp, sp, op + m * N, N, n0, n1); m += 1; }
      }
    }
  });
  return out;
}
}  // namespace

TORCH_LIBRARY(iterserve_bench_q8, m) { m.def("q8_gemm(Tensor x, Tensor w, Tensor scales) -> Tensor"); }
TORCH_LIBRARY_IMPL(iterserve_bench_q8, CPU, m) { m.impl("q8_gemm", &q8_gemm); }

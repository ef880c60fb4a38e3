// The decode GEMMs from our own quantised layouts, for steps of a few rows where reading the weights
// bounds the step: q8_0_gemm (int8 weights, one float scale per 32: the LM head in GGUF's Q8_0
// layout) and q4_gemm (4-bit weights with GGUF Q4_1's levels, int16 activations; the projections of
// steps of <= 8 rows).
#include "kernel_common.h"
#include "kernels.h"
#include "lanes.h"
#include "work_pool.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace iterserve {
namespace {

// ---- Q8_0 GEMM: out[m, n] = sum_k x[m, k] * w[n, k] * scale[n, k / 32] --------------------------------
// MB rows of x share each weight group as it is widened to float; the accumulators stay 32 wide
// until the end of the row, as in llama.cpp's Q8_0 dot. On AVX-512 written with intrinsics (the
// vectoriser made the portable loop 5x slower: 4.9 vs 0.84 ms for a 49152 x 576 head at 1 row).
template <int MB, typename T>
void q8_0_rows(const float* x, int64_t K, const int8_t* w, const float* scales, T* out, int64_t N,
               int64_t n0, int64_t n1) {
  constexpr int Q = 32;
  const int64_t groups = K / Q;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * K;
    const float* sr = scales + n * groups;
#if defined(__AVX512F__)
    const int64_t ahead = std::min(n + kPrefetchRows, N - 1);
    prefetch(w + ahead * K, K);
    prefetch(scales + ahead * groups, groups * sizeof(float));
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 s = _mm512_set1_ps(sr[g]);
      const __m512 w0 = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + g * Q)))));
      const __m512 w1 = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + g * Q + 16)))));
      for (int m = 0; m < MB; ++m) {
        const float* xr = x + m * K + g * Q;
        acc[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[m]);
        acc[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) store(out + m * N + n, _mm512_reduce_add_ps(acc[m]));
#else
    float acc[MB] = {};
    for (int64_t g = 0; g < groups; ++g) {
      for (int m = 0; m < MB; ++m) {
        const float* xr = x + m * K + g * Q;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int i = 0; i < Q; ++i) s += static_cast<float>(wr[g * Q + i]) * xr[i];
        acc[m] += s * sr[g];
      }
    }
    for (int m = 0; m < MB; ++m) store(out + m * N + n, acc[m]);
#endif
  }
}

template <typename T>
void q8_0_gemm_impl(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scales, T* out, int64_t N) {
  // a few long ranges (interleaved short chunks broke the hardware prefetcher's streams: 1.09 vs
  // 0.75 ms for a 49152 x 576 head), walked 64 rows at a time so every x row reuses them from cache
  iterserve::parallel_ranges(N, kRanges, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += 64) {
      const int64_t n1 = std::min(end, n0 + 64);
      for (int64_t m = 0; m < M;) {
        const int64_t left = M - m;
        if (left >= 4) { q8_0_rows<4>(x + m * K, K, w, scales, out + m * N, N, n0, n1); m += 4; }
        else if (left >= 2) { q8_0_rows<2>(x + m * K, K, w, scales, out + m * N, N, n0, n1); m += 2; }
        else { q8_0_rows<1>(x + m * K, K, w, scales, out + m * N, N, n0, n1); m += 1; }
      }
    }
  });
}

// ---- Q4 GEMM (GGUF Q4_1 levels): w[n, k] = d[n, b] * q[n, k] + m[n, b], q in 0..15, b = k / 32 ------
// Decoding a few sequences reads every weight once per token, so the weights stay 4-bit. Each
// activation row is quantised to int16 with one scale (dx: 2^-15 of the row's largest value, so an
// element's absolute error stays below what bf16 rounding gives it unless it is 100x smaller than
// the row's largest, where its share of the dot is as small), and each 32-weight block is one
// s16 x s16 dot instruction (AVX512-VNNI vpdpwssd):
//   sum_k x w = dx * sum_b d_b sum_{k in b} q xq  +  sum_b m_b sum_{k in b} x.
// (llama.cpp quantises activations to int8 per 32: twice the dot rate, but on this model the logits
// then drifted ~4x further from float32 than with bf16 activations.)
// Layout, made by pack_q4_1 (cpu_linear.py): qs [N, K/2] uint8, chunk c's byte i = q[64c+i] | q[64c+32+i] << 4;
// d and m [N, K/32] float16 (GGUF's own types).

struct Q4Rows {  // quantised activation rows
  const int16_t* xq;  // [M, K]
  const float* dx;    // [M]: one scale a row
  const float* sx;    // [M, K/32]: the exact float sum of x over each block
  int64_t K;
  Q4Rows at(int64_t m) const { return {xq + m * K, dx + m, sx + m * (K / 32), K}; }
};

template <int MB, typename T>
void q4_rows(const Q4Rows& a, const uint8_t* qs, const at::Half* d, const at::Half* mn, T* out, int64_t N,
             int64_t n0, int64_t n1) {
  const int64_t K = a.K, chunks = K / 64, blocks = K / 32;
#if ISV_Q4_VNNI
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = qs + n * (K / 2);
    const at::Half* dr = d + n * blocks;
    const at::Half* mr = mn + n * blocks;
    const int64_t ahead = std::min(n + kPrefetchRows, N - 1);
    prefetch(qs + ahead * (K / 2), K / 2);
    prefetch(d + ahead * blocks, blocks * sizeof(at::Half));
    prefetch(mn + ahead * blocks, blocks * sizeof(at::Half));
    float mins[MB] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const float mb = static_cast<float>(mr[b]);
      for (int m = 0; m < MB; ++m) mins[m] += mb * a.sx[m * blocks + b];
    }
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + c * 32));
      const __m512i w0 = _mm512_cvtepu8_epi16(_mm256_and_si256(bytes, low4));
      const __m512i w1 = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4));
      const __m512 d0 = _mm512_set1_ps(static_cast<float>(dr[2 * c])), d1 = _mm512_set1_ps(static_cast<float>(dr[2 * c + 1]));
      for (int m = 0; m < MB; ++m) {
        const int16_t* xr = a.xq + m * K + c * 64;
        const __m512i s0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(xr));
        const __m512i s1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w1, _mm512_loadu_si512(xr + 32));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), d0, acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), d1, acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m)
      store(out + m * N + n, _mm512_reduce_add_ps(acc[m]) * a.dx[m] + mins[m]);
  }
#elif ISV_AVX2_FMA
  // AVX2 (float32 engines on CPUs without AVX-512): the same sums, each 32-weight block widened to
  // int16 and multiplied by vpmaddwd (pairs of s16 x s16 into s32, 4 products a lane at most:
  // 4 x 15 x 32767, far from overflow). Every loop over the accumulators is unrolled, as in
  // f32_bf16w_tile (else gcc keeps them in memory).
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = qs + n * (K / 2);
    const at::Half* dr = d + n * blocks;
    const at::Half* mr = mn + n * blocks;
    const int64_t ahead = std::min(n + kPrefetchRows, N - 1);
    prefetch(qs + ahead * (K / 2), K / 2);
    prefetch(d + ahead * blocks, blocks * sizeof(at::Half));
    prefetch(mn + ahead * blocks, blocks * sizeof(at::Half));
    float mins[MB] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const float mb = static_cast<float>(mr[b]);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) mins[m] += mb * a.sx[m * blocks + b];
    }
    __m256 acc[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + c * 32));
      const __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      const __m256i w0a = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));
      const __m256i w0b = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
      const __m256i w1a = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));
      const __m256i w1b = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
      const __m256 d0 = _mm256_set1_ps(static_cast<float>(dr[2 * c])), d1 = _mm256_set1_ps(static_cast<float>(dr[2 * c + 1]));
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m256i* xr = reinterpret_cast<const __m256i*>(a.xq + m * K + c * 64);
        const __m256i s0 = _mm256_add_epi32(_mm256_madd_epi16(w0a, _mm256_loadu_si256(xr)),
                                            _mm256_madd_epi16(w0b, _mm256_loadu_si256(xr + 1)));
        const __m256i s1 = _mm256_add_epi32(_mm256_madd_epi16(w1a, _mm256_loadu_si256(xr + 2)),
                                            _mm256_madd_epi16(w1b, _mm256_loadu_si256(xr + 3)));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), d0, acc[m]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), d1, acc[m]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) store(out + m * N + n, reduce_add8(acc[m]) * a.dx[m] + mins[m]);
  }
#else
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = qs + n * (K / 2);
    float acc[MB] = {}, macc[MB] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c = b / 2, h = b % 2;
      const float db = static_cast<float>(d[n * blocks + b]), mb = static_cast<float>(mn[n * blocks + b]);
      for (int m = 0; m < MB; ++m) {
        int32_t isum = 0;
        for (int i = 0; i < 32; ++i) {
          const int q = h ? qr[c * 32 + i] >> 4 : qr[c * 32 + i] & 0x0F;
          isum += q * a.xq[m * K + b * 32 + i];
        }
        acc[m] += db * static_cast<float>(isum);
        macc[m] += mb * a.sx[m * blocks + b];
      }
    }
    for (int m = 0; m < MB; ++m) store(out + m * N + n, acc[m] * a.dx[m] + macc[m]);
  }
#endif
}

}  // namespace

// x [M, K] float32 or bfloat16; w [N, K] int8; scales [N, K / 32] float32 -> [M, N] in x's dtype.
at::Tensor q8_0_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be [M, K] float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && w.dim() == 2 && w.size(1) == K && w.scalar_type() == at::kChar && w.is_contiguous(),
              "w must be contiguous [N, K] int8 with K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / 32),
              "scales must be contiguous [N, K / 32] float32");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  if (x.scalar_type() == at::kFloat)
    q8_0_gemm_impl(xf.const_data_ptr<float>(), M, K, w.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                   out.data_ptr<float>(), N);
  else
    q8_0_gemm_impl(xf.const_data_ptr<float>(), M, K, w.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                   reinterpret_cast<uint16_t*>(out.data_ptr()), N);
  return out;
}

// x [M, K] float32 or bfloat16; qs [N, K/2] uint8; d, m [N, K/32] float16 -> [M, N] in x's dtype.
at::Tensor q4_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mn) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be [M, K] float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  TORCH_CHECK(K % 64 == 0 && qs.dim() == 2 && qs.size(1) == K / 2 && qs.scalar_type() == at::kByte &&
              qs.is_contiguous(), "qs must be contiguous [N, K/2] uint8 with K a multiple of 64");
  for (const at::Tensor* t : {&d, &mn})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == N * (K / 32),
                "scales and mins must be contiguous [N, K/32] float16");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  // the activations, quantised once on the calling thread (M x K is tiny next to the weights)
  std::vector<int16_t> xq(M * K);
  std::vector<float> dx(M), sx(M * (K / 32));
  const float* xp = xf.const_data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (int64_t k = 0; k < K; ++k) xq[m * K + k] = static_cast<int16_t>(std::nearbyint(xr[k] * inv));
    dx[m] = amax / 32767.f;
    for (int64_t b = 0; b < K / 32; ++b) {
      float sum = 0.f;
      for (int i = 0; i < 32; ++i) sum += xr[b * 32 + i];
      sx[m * (K / 32) + b] = sum;
    }
  }
  const Q4Rows rows{xq.data(), dx.data(), sx.data(), K};
  const uint8_t* qp = qs.const_data_ptr<uint8_t>();
  const at::Half* dp = d.const_data_ptr<at::Half>();
  const at::Half* mp = mn.const_data_ptr<at::Half>();
  auto run = [&](auto* op) {
    iterserve::parallel_ranges(N, kRanges, [&](int64_t begin, int64_t end) {  // as in q8_0_gemm
      for (int64_t n0 = begin; n0 < end; n0 += 32) {
        const int64_t n1 = std::min(end, n0 + 32);
        for (int64_t m = 0; m < M;) {
          const int64_t left = M - m;
          if (left >= 8) { q4_rows<8>(rows.at(m), qp, dp, mp, op + m * N, N, n0, n1); m += 8; }
          else if (left >= 4) { q4_rows<4>(rows.at(m), qp, dp, mp, op + m * N, N, n0, n1); m += 4; }
          else if (left >= 2) { q4_rows<2>(rows.at(m), qp, dp, mp, op + m * N, N, n0, n1); m += 2; }
          else { q4_rows<1>(rows.at(m), qp, dp, mp, op + m * N, N, n0, n1); m += 1; }
        }
      }
    });
  };
  if (x.scalar_type() == at::kFloat) run(out.data_ptr<float>());
  else run(reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

bool q4_gemm_is_vectorised() { return ISV_Q4_VNNI || ISV_AVX2_FMA; }

}  // namespace iterserve

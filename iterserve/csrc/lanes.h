// The vector lanes every kernel file shares: what this build's instruction sets are (ISV_* macros),
// float32 <-> bf16 loads and stores (bf16 rounded to nearest even, NaN to a quiet NaN, as torch),
// exp in plain arithmetic and SLEEF's expf_u10, the AVX2 (load8, reduce_add8) and AVX-512 (load16)
// loads of float32 or bf16 as float32, and LVec / lv_*: one vector type over AVX-512, AVX2 + FMA or a
// single float, so that a kernel written over it is written once.
// Contract: every function here is the same operation, lane for lane, on each instruction set (the
// scalar build's "vector" is one float): a kernel over lv_* runs the same arithmetic in the same
// order whatever the build, and its results differ between builds only where the lane count decides
// the order of a reduction (lv_sum) or which columns fall in the scalar tail.
// Built with -march=native: the compiler's own macros (__AVX512F__, __AVX2__, ...) pick the branch.
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// the instructions q4_gemm's and gguf_gemm's int16 dot paths need (else AVX2 + FMA);
// q4_gemm_is_vectorised() reports either to Python
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ISV_Q4_VNNI 1
#else
#define ISV_Q4_VNNI 0
#endif
// vdpbf16ps: bf16_gemm and the prefill attention (bf16_gemm_is_vectorised() tells Python)
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define ISV_BF16_DOT 1
#else
#define ISV_BF16_DOT 0
#endif

namespace iterserve {

inline float load(float x) { return x; }
inline float load(uint16_t bits) {  // bfloat16 -> float32 is a 16-bit shift
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// AVX2 + FMA (every x86-64 CPU of the last decade, AVX-512 ones too): the float32 x bf16-weight
// GEMM and the decode attention's float32 paths where AVX-512 is missing
#if defined(__AVX2__) && defined(__FMA__)
#define ISV_AVX2_FMA 1
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bfloat16 -> float32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#define ISV_AVX2_FMA 0
#endif
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (std::isnan(x)) { *p = 0x7fc0; return; }
  u += 0x7fff + ((u >> 16) & 1);
  *p = static_cast<uint16_t>(u >> 16);
}

// exp(x) for x <= 0 in plain arithmetic, so that `omp simd` loops vectorise it (std::exp stays a
// scalar call; it was the largest part of a batch-16 layer). Range reduction to 2^n * exp(r),
// |r| <= ln2/2, and a degree-6 polynomial: relative error ~2e-7, below float32's own rounding of
// the softmax sums. x is clamped at -87 (e^-87 ~ 1.6e-38: nothing a softmax sum can tell from 0).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504089f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

// ---- the vector lanes: LVec, kLW floats wide, and the lv_* operations on it --------------------
// One wrapper over AVX-512 (16 lanes), AVX2 + FMA (8 lanes) or a single float (the scalar build),
// so that a kernel written over it is written once for every instruction set and runs the same
// operations in the same order on each (per lane). ISV_LANES says whether the lanes are a vector.
#if defined(__AVX512F__)
#define ISV_LANES 1
using LVec = __m512;
constexpr int64_t kLW = 16;
inline LVec lv_zero() { return _mm512_setzero_ps(); }
inline LVec lv_set1(float v) { return _mm512_set1_ps(v); }
inline LVec lv_fma(LVec a, LVec b, LVec c) { return _mm512_fmadd_ps(a, b, c); }
inline LVec lv_add(LVec a, LVec b) { return _mm512_add_ps(a, b); }
inline LVec lv_load(const float* p) { return _mm512_loadu_ps(p); }
inline LVec lv_load(const uint16_t* p) { return load16(p); }
inline float lv_sum(LVec v) { return _mm512_reduce_add_ps(v); }
inline void lv_store(float* p, LVec v) { _mm512_storeu_ps(p, v); }
// each lane's bf16 bits (in its low 16): round to nearest even, NaN to a quiet NaN, as store()
inline __m512i lv_bf16_bits(LVec v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
}
inline void lv_store(uint16_t* p, LVec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(lv_bf16_bits(v)));
}
#elif ISV_AVX2_FMA
#define ISV_LANES 1
using LVec = __m256;
constexpr int64_t kLW = 8;
inline LVec lv_zero() { return _mm256_setzero_ps(); }
inline LVec lv_set1(float v) { return _mm256_set1_ps(v); }
inline LVec lv_fma(LVec a, LVec b, LVec c) { return _mm256_fmadd_ps(a, b, c); }
inline LVec lv_add(LVec a, LVec b) { return _mm256_add_ps(a, b); }
inline LVec lv_load(const float* p) { return _mm256_loadu_ps(p); }
inline LVec lv_load(const uint16_t* p) { return load8(p); }
inline float lv_sum(LVec v) { return reduce_add8(v); }
inline void lv_store(float* p, LVec v) { _mm256_storeu_ps(p, v); }
inline void lv_store(uint16_t* p, LVec v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int i = 0; i < 8; ++i) store(p + i, f[i]);
}
#else
#define ISV_LANES 0
using LVec = float;
constexpr int64_t kLW = 1;
inline LVec lv_zero() { return 0.f; }
inline LVec lv_set1(float v) { return v; }
inline LVec lv_fma(LVec a, LVec b, LVec c) { return a * b + c; }
inline LVec lv_add(LVec a, LVec b) { return a + b; }
template <typename C>
inline LVec lv_load(const C* p) { return load(*p); }
inline float lv_sum(LVec v) { return v; }
template <typename C>
inline void lv_store(C* p, LVec v) { store(p, v); }
#endif
// s[0..3] = lv_sum(a), lv_sum(b), lv_sum(c), lv_sum(d), bit for bit (the same pairs added in the same
// order: the upper half onto the lower, then the upper quarter, ...), the four reductions interleaved
// in shared shuffles: ~13 operations where four lv_sums take ~32 (a GQA group's four scores a key in
// attention_decode.cpp).
inline void lv_sum4(LVec a, LVec b, LVec c, LVec d, float* s) {
#if defined(__AVX512F__)
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));  // x[i] + x[i + 8]
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));  // + x[i + 4]: a, b, c, d by 128-bit lane
  r = _mm512_add_ps(r, _mm512_permute_ps(r, 0x4E));                                                  // + x[i + 2]
  r = _mm512_add_ps(r, _mm512_permute_ps(r, 0xB1));                                                  // + x[i + 1]
  alignas(64) float t[16];
  _mm512_store_ps(t, r);
  s[0] = t[0], s[1] = t[4], s[2] = t[8], s[3] = t[12];
#elif ISV_AVX2_FMA
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));  // x[i] + x[i + 4]
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
  __m256 r = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));  // + x[i + 2]: a, c | b, d
  r = _mm256_add_ps(r, _mm256_permute_ps(r, 0xB1));                                           // + x[i + 1]
  alignas(32) float t[8];
  _mm256_store_ps(t, r);
  s[0] = t[0], s[1] = t[4], s[2] = t[2], s[3] = t[6];
#else
  s[0] = lv_sum(a), s[1] = lv_sum(b), s[2] = lv_sum(c), s[3] = lv_sum(d);
#endif
}

// which of the three the lanes are, for Python (lanes_isa()): a test of a variant build checks it
constexpr const char* kLanesIsa = kLW == 16 ? "avx512" : kLW == 8 ? "avx2" : "scalar";

#if defined(__AVX512F__)
inline LVec lv_mul(LVec a, LVec b) { return _mm512_mul_ps(a, b); }
inline LVec lv_div(LVec a, LVec b) { return _mm512_div_ps(a, b); }
inline LVec lv_neg(LVec a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a),
                                                                         _mm512_set1_epi32(INT32_MIN))); }
inline LVec lv_round_bf16(LVec v) {  // to the nearest bf16 (ties to even), NaN to a quiet NaN; as store() does
  return _mm512_castsi512_ps(_mm512_slli_epi32(lv_bf16_bits(v), 16));
}
// integer lanes, for lv_expf_u10's exponent arithmetic
using LInt = __m512i;
inline LInt lv_to_int(LVec v) { return _mm512_cvtps_epi32(v); }  // to nearest, ties to even (MXCSR)
inline LVec lv_from_int(LInt i) { return _mm512_cvtepi32_ps(i); }
inline LInt li_half(LInt i) { return _mm512_srai_epi32(i, 1); }
inline LInt li_sub(LInt a, LInt b) { return _mm512_sub_epi32(a, b); }
inline LVec lv_pow2i(LInt e) {  // 2^e for -126 <= e <= 127
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(0x7f)), 23));
}
// u where d >= lo (or d is NaN), else 0; u where d <= hi (or NaN), else +inf
inline LVec lv_zero_below(LVec d, float lo, LVec u) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(lo), _CMP_NLT_UQ), u);
}
inline LVec lv_inf_above(LVec d, float hi, LVec u) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_set1_ps(hi), d, _CMP_LT_OQ), u, _mm512_set1_ps(INFINITY));
}
#elif ISV_AVX2_FMA
inline LVec lv_mul(LVec a, LVec b) { return _mm256_mul_ps(a, b); }
inline LVec lv_div(LVec a, LVec b) { return _mm256_div_ps(a, b); }
inline LVec lv_neg(LVec a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.f)); }
inline LVec lv_round_bf16(LVec v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                     _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                          _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
using LInt = __m256i;
inline LInt lv_to_int(LVec v) { return _mm256_cvtps_epi32(v); }
inline LVec lv_from_int(LInt i) { return _mm256_cvtepi32_ps(i); }
inline LInt li_half(LInt i) { return _mm256_srai_epi32(i, 1); }
inline LInt li_sub(LInt a, LInt b) { return _mm256_sub_epi32(a, b); }
inline LVec lv_pow2i(LInt e) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(0x7f)), 23));
}
inline LVec lv_zero_below(LVec d, float lo, LVec u) {
  return _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(lo), _CMP_LT_OQ), u);
}
inline LVec lv_inf_above(LVec d, float hi, LVec u) {
  return _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(_mm256_set1_ps(hi), d, _CMP_LT_OQ));
}
#else
inline LVec lv_mul(LVec a, LVec b) { return a * b; }
inline LVec lv_div(LVec a, LVec b) { return a / b; }
inline LVec lv_neg(LVec a) { return -a; }
#endif

#if ISV_LANES
inline LVec lv_expf_u10(LVec d) {  // SLEEF's xexpf, lane for lane (see exp_sleef below)
  const LInt q = lv_to_int(lv_mul(d, lv_set1(1.442695040888963407359924681001892137f)));
  const LVec qf = lv_from_int(q);
  LVec s = lv_fma(qf, lv_set1(-0.693145751953125f), d);
  s = lv_fma(qf, lv_set1(-1.428606765330187045e-06f), s);
  LVec u = lv_set1(0.000198527617612853646278381f);
  u = lv_fma(u, s, lv_set1(0.00139304355252534151077271f));
  u = lv_fma(u, s, lv_set1(0.00833336077630519866943359f));
  u = lv_fma(u, s, lv_set1(0.0416664853692054748535156f));
  u = lv_fma(u, s, lv_set1(0.166666671633720397949219f));
  u = lv_fma(u, s, lv_set1(0.5f));
  u = lv_add(lv_set1(1.f), lv_fma(lv_mul(s, s), u, s));
  const LInt h = li_half(q);
  u = lv_mul(u, lv_pow2i(h));
  u = lv_mul(u, lv_pow2i(li_sub(q, h)));
  return lv_inf_above(d, 100.f, lv_zero_below(d, -104.f, u));
}
#endif

// SLEEF's expf_u10 (xexpf, 1-ulp) in one lane: the vector forms above, and the columns past the last
// whole vector, so that every column of a row gets the same bits.
inline float exp_sleef(float d) {
  if (std::isnan(d)) return d;
  if (d < -104.f) return 0.f;
  if (d > 100.f) return INFINITY;
  const int32_t q = static_cast<int32_t>(std::nearbyint(d * 1.442695040888963407359924681001892137f));
  const float qf = static_cast<float>(q);
  float s = std::fma(qf, -0.693145751953125f, d);
  s = std::fma(qf, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = std::fma(u, s, 0.00139304355252534151077271f);
  u = std::fma(u, s, 0.00833336077630519866943359f);
  u = std::fma(u, s, 0.0416664853692054748535156f);
  u = std::fma(u, s, 0.166666671633720397949219f);
  u = std::fma(u, s, 0.5f);
  u = 1.f + std::fma(s * s, u, s);
  auto pow2i = [](int32_t e) {
    const int32_t bits = (e + 0x7f) << 23;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  };
  return u * pow2i(q >> 1) * pow2i(q - (q >> 1));
}

}  // namespace iterserve

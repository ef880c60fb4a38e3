// The KV cache's 8-bit formats (--kv-cache-dtype; iterserve/attention/kv_cache_dtype.py writes them)
// as the attention kernels read them: each value is widened to float32 in registers where a key or
// value row is used, never a whole cache (or block) first.
// - Fp8E4M3 / Fp8E5M2: one byte a value, torch's float8_e4m3fn / float8_e5m2 (vLLM's fp8 KV cache,
//   scale 1.0). Both widen exactly through float16 (F16C / AVX-512's vcvtph2ps): e5m2 is a float16's
//   high byte; e4m3's exponent and mantissa shifted into a float16's, times 2^8 (the bias 15 - 7).
// - Q8Block: llama.cpp's block_q8_0, 32 int8 values and their float16 scale d (value = d * q), so a
//   head_dim-D row is D / 32 blocks (34 bytes each). int8 * a float16 scale is exact in float32.
// Every load here is exact: a kernel fed an 8-bit cache computes what it computes on the float32
// cache that the same values dequantise to (the tests check it bit for bit).
#pragma once

#include "lanes.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>

namespace iterserve {

struct Fp8E4M3 { uint8_t bits; };
struct Fp8E5M2 { uint8_t bits; };
struct Q8Block {
  uint16_t d;  // float16 bits
  int8_t qs[32];
};
static_assert(sizeof(Q8Block) == 34, "block_q8_0 is 34 bytes");

// values per element of a cache row: a row of D values is D / kValuesPer<C> elements of C
template <typename C>
constexpr int64_t kValuesPer = 1;
template <>
constexpr int64_t kValuesPer<Q8Block> = 32;

inline float half_to_float(uint16_t h) {  // exact; the scalar build's and the row tails' form
  const int e = (h >> 10) & 31;
  const uint32_t m = h & 1023u;
  const float f = e == 0 ? std::ldexp(static_cast<float>(m), -24)
                  : e == 31 ? (m ? NAN : INFINITY)
                  : std::ldexp(static_cast<float>(m | 1024u), e - 25);
  return (h & 0x8000u) ? -f : f;
}
inline uint16_t e4m3_half_bits(uint8_t b) { return static_cast<uint16_t>(((b & 0x7f) << 7) | ((b & 0x80) << 8)); }
inline float load(Fp8E5M2 x) { return half_to_float(static_cast<uint16_t>(x.bits << 8)); }
inline float load(Fp8E4M3 x) { return half_to_float(e4m3_half_bits(x.bits)) * 256.f; }

#if defined(__AVX512F__)
inline LVec lv_load(const Fp8E5M2* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
}
inline LVec lv_load(const Fp8E4M3* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
inline LVec lv_load_i8(const int8_t* p) {  // kLW int8 -> float32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif ISV_AVX2_FMA
#if defined(__F16C__)
inline LVec lv_load(const Fp8E5M2* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
}
inline LVec lv_load(const Fp8E4M3* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7),
                                 _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
#else
template <typename F8>
inline LVec lv_load(const F8* p) {
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = load(p[i]);
  return _mm256_load_ps(f);
}
#endif
inline LVec lv_load_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
inline LVec lv_load_i8(const int8_t* p) { return static_cast<float>(*p); }
#endif

// One cache row of D values as float32 (the prefill kernel lays a chunk's keys and values out from it)
template <typename C>
inline void load_row(const C* row, int64_t D, float* out) {
  for (int64_t d = 0; d < D; ++d) out[d] = load(row[d]);
}
inline void load_row(const Q8Block* row, int64_t D, float* out) {
  for (int64_t b = 0; b < D / 32; ++b) {
    const float s = half_to_float(row[b].d);
    for (int i = 0; i < 32; ++i) out[32 * b + i] = s * static_cast<float>(row[b].qs[i]);
  }
}

// The format a cache tensor holds: float32, bf16, float8 e4m3 / e5m2 by their
// dtypes; q8_0 as uint8 rows of D / 32 * 34 bytes.
enum class KVFormat { kFloat, kBF16, kE4M3, kE5M2, kQ8 };
inline KVFormat kv_format(const at::Tensor& cache, int64_t D) {
  switch (cache.scalar_type()) {
    case at::kFloat: TORCH_CHECK(cache.size(3) == D, "head_dim does not match the caches"); return KVFormat::kFloat;
    case at::kBFloat16: TORCH_CHECK(cache.size(3) == D, "head_dim does not match the caches"); return KVFormat::kBF16;
    case at::kFloat8_e4m3fn: TORCH_CHECK(cache.size(3) == D, "head_dim does not match the caches"); return KVFormat::kE4M3;
    case at::kFloat8_e5m2: TORCH_CHECK(cache.size(3) == D, "head_dim does not match the caches"); return KVFormat::kE5M2;
    case at::kByte:
      TORCH_CHECK(D % 32 == 0 && cache.size(3) == D / 32 * static_cast<int64_t>(sizeof(Q8Block)),
                  "a uint8 cache is q8_0: rows of head_dim / 32 blocks of 34 bytes (head_dim a multiple of 32)");
      return KVFormat::kQ8;
    default: TORCH_CHECK(false, "caches must be float32, bfloat16, float8_e4m3fn, float8_e5m2 or q8_0 (uint8)");
  }
  return KVFormat::kFloat;
}

}  // namespace iterserve

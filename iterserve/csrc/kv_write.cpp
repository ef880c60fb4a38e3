// kv_write: a step's keys or values written into a float32, bf16 or q8_0 KV cache (kv_formats.h) at
// their slots, converted or quantised on the way in, in one pass. bf16 from float32 rows (the default cache
// of a float32 run on an AVX2-only CPU) is torch's rounding, to nearest even: the bytes of the torch form
// (`.to(bfloat16)` and `index_copy_`, two ops a call with their dispatch, 60 calls a SmolLM2 step). q8_0:
// the torch form (attention/kv_cache_dtype.py `quantise`, ~15 small ops) took ~250 us a call for 16
// decode rows on a loaded 2-core host: 15 ms of a SmolLM2 step's 60 writes.
// Same arithmetic as the torch form and llama.cpp's quantize_row_q8_0: per 32 values d = max|x| / 127,
// q = round-half-even(x * (1 / d)), d stored as float16 (round to nearest even), so the bytes equal
// the torch form's (tests/test_kv_cache_dtype.py).
#include "kernel_common.h"
#include "kernels.h"
#include "kv_formats.h"
#include "lanes.h"

#include <cmath>
#include <cstring>

namespace iterserve {
namespace {

inline uint16_t float_to_half(float f) {  // round to nearest even, as torch's .to(float16)
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x47800000u) return static_cast<uint16_t>(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax < 0x38800000u) {  // a float16 subnormal: its mantissa is |f| * 2^24, rounded (exact scaling)
    float af;
    std::memcpy(&af, &ax, sizeof af);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(af * 16777216.f)));
  }
  return static_cast<uint16_t>(sign | ((ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u) >> 13));
}

template <typename T>
void quantise_row(const T* x, int64_t D, Q8Block* out) {
  for (int64_t b = 0; b < D / 32; ++b) {
    float v[32], amax = 0.f;
    for (int i = 0; i < 32; ++i) {
      v[i] = load(x[32 * b + i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    out[b].d = float_to_half(d);
    for (int i = 0; i < 32; ++i) out[b].qs[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
  }
}

}  // namespace

// x [T, KVH, D] float32 or bf16 -> cache [num_blocks, block_size, KVH, W] at the slots slot_mapping [T]
// int64 names (slot = block * block_size + offset), in place; W = D (float32, bf16) or D / 32 * 34 bytes (q8_0).
void kv_write(const at::Tensor& x_in, at::Tensor& cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(x_in.dim() == 3 && cache.dim() == 4 && cache.is_contiguous(), "x must be [T, kv_heads, D], the cache 4-d");
  const at::Tensor x = dense_heads(x_in);  // rows may be strided
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t T = x.size(0), KVH = x.size(1), D = x.size(2);
  const KVFormat fmt = kv_format(cache, D);
  TORCH_CHECK(fmt == KVFormat::kQ8 || fmt == KVFormat::kBF16 || fmt == KVFormat::kFloat,
              "kv_write takes float32, bf16 or q8_0 caches");
  TORCH_CHECK(cache.size(2) == KVH, "the cache must have x's heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == T, "one int64 slot per row");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " is outside the cache");
  auto rows = [&](auto zero) {
    using X = decltype(zero);
    const X* xp = ptr<X>(x);
    const int64_t ld = x.stride(0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        const X* src = xp + t * ld + h * D;
        const int64_t at = sp[t] * KVH + h;  // the (slot, head) row of the cache
        if (fmt == KVFormat::kQ8) {
          quantise_row(src, D, reinterpret_cast<Q8Block*>(cache.data_ptr()) + at * (D / 32));
        } else if (fmt == KVFormat::kBF16) {
          uint16_t* dst = reinterpret_cast<uint16_t*>(cache.data_ptr()) + at * D;
          for (int64_t d = 0; d < D; ++d) store(dst + d, load(src[d]));
        } else {
          float* dst = reinterpret_cast<float*>(cache.data_ptr()) + at * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = load(src[d]);
        }
      }
  };
  if (x.scalar_type() == at::kFloat) rows(float{});
  else rows(uint16_t{});
}

}  // namespace iterserve

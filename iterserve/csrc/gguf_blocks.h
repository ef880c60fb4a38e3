// What the GGUF block kernels share (gemm_gguf.cpp's GEMM, gguf_dequant.cpp's dequantisation): the
// ggml type ids, block sizes and the layout of the 32-input types' groups of four (pack_gguf_x4 in
// platform/cpu_linear.py; described in gemm_gguf.cpp), and the scale decoding of the K-quants.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace iterserve {
namespace gguf {

enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// Activation elements from which a gguf_gemm call quantises its rows (and lays them out for AMX) over
// the work pool (32 rows of K 2048: a prompt chunk's; a decode step's few rows stay on the calling
// thread, a pool wake-up costs more)
constexpr int64_t kParallelQuantise = 1 << 16;

constexpr bool is_kquant(int64_t t) { return t == kQ4_K || t == kQ5_K || t == kQ6_K; }
constexpr int64_t kquant_bytes(int64_t t) { return t == kQ4_K ? 144 : t == kQ5_K ? 176 : 210; }  // per 256 inputs
constexpr int64_t x4_header(int64_t t) {  // bytes before a group's levels
  return 8 + ((t == kQ4_1 || t == kQ5_1) ? 8 : 0) + ((t == kQ5_0 || t == kQ5_1) ? 16 : 0);
}
constexpr int64_t x4_bytes(int64_t t) { return x4_header(t) + (t == kQ8_0 ? 128 : 64); }  // per 128 inputs
constexpr bool has_min(int64_t t) { return t == kQ4_1 || t == kQ5_1 || t == kQ4_K || t == kQ5_K; }
constexpr int x4_offset(int64_t t) { return t == kQ4_0 ? 8 : t == kQ5_0 ? 16 : 0; }  // level - offset

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and mins from their 12 packed bytes, a byte each in
// two words (llama.cpp's get_scale_min_k4, on whole words: no byte stores for a vector load to wait on)
inline void k4_scales(const uint8_t* q, uint64_t& sc, uint64_t& mn) {
  uint32_t u[3];  // three loads into registers (one 12-byte copy went through the stack: ~6 more
  std::memcpy(&u[0], q, 4), std::memcpy(&u[1], q + 4, 4), std::memcpy(&u[2], q + 8, 4);  // instructions a super-block)
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  sc = (u[0] & k1) | static_cast<uint64_t>((u[2] & k2) | (((u[0] >> 6) & k3) << 4)) << 32;
  mn = (u[1] & k1) | static_cast<uint64_t>(((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4)) << 32;
}
inline int16_t byte_of(uint64_t v, int i) { return static_cast<int16_t>((v >> (8 * i)) & 0xFF); }

}  // namespace gguf
}  // namespace iterserve

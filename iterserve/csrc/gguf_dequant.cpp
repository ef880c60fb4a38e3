// gguf_dequant: rows of a GGUF projection's blocks (gguf_gemm's buffer: K-quants as stored, the
// 32-input types in groups of four) back to numbers, for the steps of many rows. A GGUF's quantised
// weights are kept only as their blocks (one copy of the weights); a step of many rows (a prefill
// chunk) is bound by arithmetic, not by reading weights, so it dequantises a panel of output rows at
// a time into a scratch tile and runs the dense GEMM on it (platform/cpu_linear.py). The numbers are
// gguf-py's dequantisation, bit for bit (each product and difference rounded to float32 separately:
// this file is built without fused multiply-adds), then rounded to bf16 where asked, as a float copy
// of the weights loaded through gguf-py and cast to bf16 would hold: a step of many rows computes
// what it computed when the float copy was kept.
#pragma GCC optimize("fp-contract=off")

#include "gguf_blocks.h"
#include "kernel_common.h"
#include "kernels.h"
#include "work_pool.h"


#include <algorithm>
#include <cstring>
#include <vector>

namespace iterserve {
namespace {

using namespace gguf;

// One row of a K-quant shard, K inputs -> out[K] float32 (gguf-py's quants.py, type by type). The
// loops run over contiguous runs of inputs that share a scale, so the compiler vectorises them.
template <int64_t type>
void kquant_row(const uint8_t* row, int64_t K, float* out) {
  constexpr int64_t bytes = kquant_bytes(type);
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* b = row + sb * bytes;
    float* o = out + sb * 256;
    if constexpr (type == kQ6_K) {  // ql[128], qh[64], scales[16] int8, d: value = (d * sc) * (q - 32)
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16_at(b + 208);
      for (int h = 0; h < 2; ++h)      // inputs 128h + 32j + l
        for (int j = 0; j < 4; ++j) {  // low nibbles of ql[64h + 32(j % 2) + l] >> 4(j / 2); qh[32h + l] >> 2j
          const uint8_t* ql = b + 64 * h + 32 * (j % 2);
          const uint8_t* qh = b + 128 + 32 * h;
          for (int half = 0; half < 2; ++half) {
            const float D = d * static_cast<float>(sc[8 * h + 2 * j + half]);
            float* oo = o + 128 * h + 32 * j + 16 * half;
            for (int l = 16 * half; l < 16 * half + 16; ++l) {
              const int lo = (ql[l] >> (4 * (j / 2))) & 0x0F, hi = (qh[l] >> (2 * j)) & 3;
              oo[l - 16 * half] = D * static_cast<float>((lo | (hi << 4)) - 32);
            }
          }
        }
    } else {
    // Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, [Q5_K: qh[32]], qs[128]:
    // value = (d * sc) * q - (dmin * m)
    const float d = f16_at(b), dmin = f16_at(b + 2);
    uint64_t sc, mn;
    k4_scales(b + 4, sc, mn);
    const uint8_t* qs = b + (type == kQ5_K ? 48 : 16);
    for (int i = 0; i < 8; ++i) {  // sub-block i: nibble i % 2 of bytes 32 * (i / 2) ..
      const float D = d * static_cast<float>(byte_of(sc, i)), M = dmin * static_cast<float>(byte_of(mn, i));
      const uint8_t* q = qs + 32 * (i / 2);
      const int shift = 4 * (i % 2);
      float* oo = o + 32 * i;
      if constexpr (type == kQ5_K)
        for (int l = 0; l < 32; ++l) oo[l] = D * static_cast<float>(((q[l] >> shift) & 0x0F) | (((b[16 + l] >> i) & 1) << 4)) - M;
      else
        for (int l = 0; l < 32; ++l) oo[l] = D * static_cast<float>((q[l] >> shift) & 0x0F) - M;
    }
    }
  }
}

// One row of a 32-input shard in groups of four (pack_gguf_x4's layout) -> out[K] float32. Byte
// 32c + 8b + j of a group's levels holds (low nibble, high nibble) the levels of positions
// 64c + 8b + j and 64c + 32 + 8b + j, i.e. inputs 8(2c) + j and 8(2c + 1) + j of block b: runs of 8.
template <int64_t type>
void x4_row(const uint8_t* row, int64_t K, float* out) {
  constexpr int64_t gbytes = x4_bytes(type), head = x4_header(type);
  constexpr bool q5 = type == kQ5_0 || type == kQ5_1;
  constexpr int64_t hb_at = type == kQ5_1 ? 16 : 8;
  constexpr int off = x4_offset(type);
  for (int64_t g = 0; g * 128 < K; ++g) {
    const uint8_t* gb = row + g * gbytes;
    const uint8_t* lv = gb + head;
    uint32_t words[4] = {0, 0, 0, 0};  // word w bit i: bit 4 of position 32w + i (Q5)
    if constexpr (q5) std::memcpy(words, gb + hb_at, 16);
    for (int blk = 0; blk < 4 && g * 128 + 32 * blk < K; ++blk) {
      const float d = f16_at(gb + 2 * blk);
      [[maybe_unused]] const float m = has_min(type) ? f16_at(gb + 8 + 2 * blk) : 0.f;
      float* o = out + g * 128 + 32 * blk;
      for (int run = 0; run < 4; ++run) {  // inputs 8 run + j: position 32 run + 8 blk + j
        float* oo = o + 8 * run;
        if constexpr (type == kQ8_0) {
          const int8_t* q = reinterpret_cast<const int8_t*>(lv + 32 * run + 8 * blk);
          for (int j = 0; j < 8; ++j) oo[j] = d * static_cast<float>(q[j]);
        } else {
        const uint8_t* q = lv + 32 * (run / 2) + 8 * blk;
        const int shift = 4 * (run % 2);
        int level[8];
        for (int j = 0; j < 8; ++j) level[j] = (q[j] >> shift) & 0x0F;
        if constexpr (q5)
          for (int j = 0; j < 8; ++j) level[j] |= static_cast<int>((words[run] >> (8 * blk + j)) & 1) << 4;
        if constexpr (has_min(type))
          for (int j = 0; j < 8; ++j) oo[j] = d * static_cast<float>(level[j]) + m;
        else
          for (int j = 0; j < 8; ++j) oo[j] = d * static_cast<float>(level[j] - off);
        }
      }
    }
  }
}

// float32 -> bf16 bits, rounded to nearest even (as torch's .to(bfloat16) for finite values; the
// weights are finite), in a form the compiler vectorises
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

}  // namespace

// buf/meta as gguf_gemm takes them; rows [R] int64 (fused output rows, any order) -> [R, K] float32
// or bfloat16 (bf16); tiled: bf16 in pack_bf16's layout [ceil(R/16), K/2, 16, 2] (zero rows pad the
// last tile), what bf16_gemm takes. `into`: scratch to write to instead of a new tensor (a panel
// freshly allocated each call costs its page faults again: a third of the dequantisation).
at::Tensor gguf_dequant(const at::Tensor& buf, const at::Tensor& meta, int64_t K, const at::Tensor& rows,
                        bool bf16, bool tiled, const c10::optional<at::Tensor>& into) {
  TORCH_CHECK(buf.scalar_type() == at::kByte && buf.is_contiguous(), "buf must be contiguous uint8");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.dim() == 2 && meta.size(1) == 4 && meta.is_contiguous(),
              "meta must be contiguous [S, 4] int64 (type, rows, bytes per row, offset)");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "rows must be 1-d int64");
  TORCH_CHECK(K > 0 && K % 32 == 0, "gguf_dequant needs K a multiple of 32");
  TORCH_CHECK(!tiled || (bf16 && K % 2 == 0), "the tiled layout is bf16 with an even K");
  const int64_t S = meta.size(0), R = rows.size(0), K4 = (K + 127) / 128 * 128;
  const int64_t* mt = meta.const_data_ptr<int64_t>();
  std::vector<int64_t> first(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t t = mt[4 * s], n = mt[4 * s + 1], rb = mt[4 * s + 2], off = mt[4 * s + 3];
    const bool known = t == kQ4_0 || t == kQ4_1 || t == kQ5_0 || t == kQ5_1 || t == kQ8_0 || is_kquant(t);
    TORCH_CHECK(known, "gguf_dequant: unsupported ggml type ", t);
    TORCH_CHECK(!is_kquant(t) || K % 256 == 0, "gguf_dequant: K-quant blocks need K a multiple of 256, got ", K);
    const int64_t want = is_kquant(t) ? K / 256 * kquant_bytes(t) : K4 / 128 * x4_bytes(t);
    TORCH_CHECK(rb == want, "gguf_dequant: shard ", s, " has ", rb, " bytes a row, type ", t, " at K ", K, " takes ", want);
    TORCH_CHECK(n >= 0 && off >= 0 && off + n * rb <= buf.numel(), "gguf_dequant: shard ", s, " lies outside buf");
    first[s + 1] = first[s] + n;
  }
  const at::Tensor rc = rows.contiguous();
  const int64_t* rp = rc.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < first[S], "gguf_dequant: row ", rp[i], " outside the ", first[S], " rows");
  const int64_t tiles = (R + 15) / 16;
  const auto dtype = tiled || bf16 ? at::kBFloat16 : at::kFloat;
  const std::vector<int64_t> shape = tiled ? std::vector<int64_t>{tiles, K / 2, 16, 2} : std::vector<int64_t>{R, K};
  const int64_t need = tiled ? tiles * 16 * K : R * K;
  at::Tensor out;
  if (into.has_value()) {  // a caller's scratch: its first `need` elements, viewed in the output's shape
    TORCH_CHECK(into->scalar_type() == dtype && into->is_contiguous() && into->numel() >= need,
                "gguf_dequant: `into` must be a contiguous ", dtype, " tensor of at least ", need, " elements");
    out = into->view({-1}).narrow(0, 0, need).view(shape);
  } else {
    out = at::empty(shape, dtype);
  }
  if (R == 0) return out;
  const uint8_t* bp = buf.const_data_ptr<uint8_t>();
  void* op = out.data_ptr();
  // a row at a time into a float row, then stored; a tiled output is split by tiles (16 rows
  // dequantised, then written tile-order, each output line once), the others by rows
  auto dequant_row = [&](int64_t i, float* dst) {
    const int64_t r = rp[i];
    const int64_t s = std::upper_bound(first.begin(), first.end(), r) - first.begin() - 1;
    const int64_t t = mt[4 * s], rb = mt[4 * s + 2];
    const uint8_t* row = bp + mt[4 * s + 3] + (r - first[s]) * rb;
    switch (t) {
      case kQ4_K: return kquant_row<kQ4_K>(row, K, dst);
      case kQ5_K: return kquant_row<kQ5_K>(row, K, dst);
      case kQ6_K: return kquant_row<kQ6_K>(row, K, dst);
      case kQ4_0: return x4_row<kQ4_0>(row, K, dst);
      case kQ4_1: return x4_row<kQ4_1>(row, K, dst);
      case kQ5_0: return x4_row<kQ5_0>(row, K, dst);
      case kQ5_1: return x4_row<kQ5_1>(row, K, dst);
      case kQ8_0: return x4_row<kQ8_0>(row, K, dst);
    }
  };
  if (tiled) {
    iterserve::parallel_ranges(tiles, kRanges, [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(16 * K, 0.f);
      for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t n = std::min<int64_t>(16, R - 16 * tile);
        for (int64_t j = 0; j < n; ++j) dequant_row(16 * tile + j, &tmp[j * K]);
        if (n < 16) std::fill(tmp.begin() + n * K, tmp.end(), 0.f);
        uint16_t* o = static_cast<uint16_t*>(op) + tile * K * 16;  // [K/2][16][2]
        for (int64_t kk = 0; kk < K / 2; ++kk)
          for (int j = 0; j < 16; ++j) {
            o[(kk * 16 + j) * 2] = to_bf16(tmp[j * K + 2 * kk]);
            o[(kk * 16 + j) * 2 + 1] = to_bf16(tmp[j * K + 2 * kk + 1]);
          }
      }
    });
  } else {
    iterserve::parallel_ranges(R, kRanges, [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(bf16 ? K : 0);
      for (int64_t i = begin; i < end; ++i) {
        if (!bf16) {
          dequant_row(i, static_cast<float*>(op) + i * K);
          continue;
        }
        dequant_row(i, tmp.data());
        uint16_t* o = static_cast<uint16_t*>(op) + i * K;
        for (int64_t k = 0; k < K; ++k) o[k] = to_bf16(tmp[k]);
      }
    });
  }
  return out;
}

}  // namespace iterserve

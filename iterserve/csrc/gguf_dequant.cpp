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

#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <vector>

namespace iterserve {
namespace {

using namespace gguf;

// One row of a K-quant shard, K inputs -> out[K] float32 (gguf-py's quants.py, type by type).
void kquant_row(int64_t type, const uint8_t* row, int64_t K, float* out) {
  const int64_t bytes = kquant_bytes(type);
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* b = row + sb * bytes;
    float* o = out + sb * 256;
    if (type == kQ6_K) {  // ql[128], qh[64], scales[16] int8, d: value = (d * sc) * (q - 32)
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16_at(b + 208);
      for (int v = 0; v < 256; ++v) {
        const int h = v / 128, w = v % 128;
        const int lo = (ql[64 * h + w % 64] >> (4 * (w / 64))) & 0x0F;
        const int hi = (qh[32 * h + w % 32] >> (2 * (w / 32))) & 3;
        o[v] = (d * static_cast<float>(sc[v / 16])) * static_cast<float>((lo | (hi << 4)) - 32);
      }
      continue;
    }
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
      for (int l = 0; l < 32; ++l) {
        int level = (q[l] >> shift) & 0x0F;
        if (type == kQ5_K) level |= ((b[16 + l] >> i) & 1) << 4;
        o[32 * i + l] = D * static_cast<float>(level) - M;
      }
    }
  }
}

// One row of a 32-input shard in groups of four (pack_gguf_x4's layout) -> out[K] float32.
void x4_row(int64_t type, const uint8_t* row, int64_t K, float* out) {
  const int64_t gbytes = x4_bytes(type), head = x4_header(type);
  const bool q5 = type == kQ5_0 || type == kQ5_1;
  const int64_t hb_at = type == kQ5_1 ? 16 : 8;
  for (int64_t g = 0; g * 128 < K; ++g) {
    const uint8_t* gb = row + g * gbytes;
    const uint8_t* lv = gb + head;
    for (int p = 0; p < 128; ++p) {  // position p: input 8 * (p / 32) + p % 8 of block (p % 32) / 8
      const int blk = (p % 32) / 8;
      const int64_t k = g * 128 + 32 * blk + 8 * (p / 32) + p % 8;
      if (k >= K) continue;
      const float d = f16_at(gb + 2 * blk);
      float v;
      if (type == kQ8_0) {
        v = d * static_cast<float>(static_cast<int8_t>(lv[p]));
      } else {
        int level = (lv[32 * (p / 64) + p % 32] >> (4 * ((p / 32) % 2))) & 0x0F;
        if (q5) {
          uint32_t word;
          std::memcpy(&word, gb + hb_at + 4 * (p / 32), 4);
          level |= ((word >> (p % 32)) & 1) << 4;
        }
        if (has_min(type)) v = d * static_cast<float>(level) + f16_at(gb + 8 + 2 * blk);
        else v = d * static_cast<float>(level - x4_offset(type));
      }
      out[k] = v;
    }
  }
}

}  // namespace

// buf/meta as gguf_gemm takes them; rows [R] int64 (fused output rows, any order) -> [R, K] float32
// or bfloat16 (bf16); tiled: bf16 in pack_bf16's layout [ceil(R/16), K/2, 16, 2] (zero rows pad the
// last tile), what bf16_gemm takes.
at::Tensor gguf_dequant(const at::Tensor& buf, const at::Tensor& meta, int64_t K, const at::Tensor& rows,
                        bool bf16, bool tiled) {
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
  at::Tensor out = tiled ? at::zeros({tiles, K / 2, 16, 2}, at::kBFloat16)
                         : at::empty({R, K}, bf16 ? at::kBFloat16 : at::kFloat);
  if (R == 0) return out;
  const uint8_t* bp = buf.const_data_ptr<uint8_t>();
  void* op = out.data_ptr();
  // one row at a time into a float row, then stored; a tiled output is split by tiles (whole
  // tiles to each worker), the others by rows
  auto run_row = [&](int64_t i, float* tmp) {
    const int64_t r = rp[i];
    const int64_t s = std::upper_bound(first.begin(), first.end(), r) - first.begin() - 1;
    const int64_t t = mt[4 * s], rb = mt[4 * s + 2];
    const uint8_t* row = bp + mt[4 * s + 3] + (r - first[s]) * rb;
    if (is_kquant(t)) kquant_row(t, row, K, tmp);
    else x4_row(t, row, K, tmp);
    if (tiled) {
      uint16_t* base = static_cast<uint16_t*>(op) + (i / 16) * (K / 2) * 32 + (i % 16) * 2;
      for (int64_t k = 0; k < K; ++k) base[(k / 2) * 32 + k % 2] = c10::BFloat16(tmp[k]).x;
    } else if (bf16) {
      uint16_t* o = static_cast<uint16_t*>(op) + i * K;
      for (int64_t k = 0; k < K; ++k) o[k] = c10::BFloat16(tmp[k]).x;
    }
  };
  const int64_t units = tiled ? tiles : R, per = tiled ? 16 : 1;
  iterserve::parallel_ranges(units, kRanges, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(bf16 ? K : 0);
    for (int64_t u = begin; u < end; ++u)
      for (int64_t i = u * per; i < std::min(R, (u + 1) * per); ++i)
        run_row(i, bf16 ? tmp.data() : static_cast<float*>(op) + i * K);
  });
  return out;
}

}  // namespace iterserve

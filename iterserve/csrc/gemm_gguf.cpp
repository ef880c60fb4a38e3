// gguf_gemm: the decode twins of a GGUF checkpoint, x @ w.T from the file's own blocks (Q4_K, Q5_K,
// Q6_K, Q8_0, Q5_0, Q5_1, Q4_0, Q4_1), several block types per fused projection, so that the twins
// compute with the values the file stores, not a re-quantisation of them.
#include "kernel_common.h"
#include "kernels.h"
#include "gemm_gguf_amx.h"
#include "gguf_blocks.h"
#include "lanes.h"
#include "work_pool.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace iterserve {
namespace {

using namespace gguf;

// ---- GGUF block GEMM: x @ w.T from a GGUF's own quantised blocks ---------------------------------------
// The decode twins of a GGUF checkpoint's projections and LM head compute with the values the file
// stores, not a re-quantisation of them. Each call quantises its activation rows as q4_gemm does
// (int16, one scale a row: llama.cpp's int8 per 32 or per 256 moved SmolLM2's logits 30-90x further
// from float32, docs/profile.md) and runs every 32 inputs as one s16 x s16 dot instruction (vpdpwssd; vpmaddwd on
// AVX2). The weights stay in their blocks:
// - K-quants (Q4_K, Q5_K, Q6_K; super-blocks of 256 inputs), read as the file stores them. Their
//   sub-block scales are small integers (6-bit for Q4_K/Q5_K, int8 for Q6_K), so each 32 inputs'
//   levels are widened to int16 and multiplied by their scale *before* the dot ((q - 32) * sc for
//   Q6_K: at most 4096), the super-block's dots add up in int32 (<= 16 products a lane: no overflow),
//   and a row pays one float multiply-add per 256 inputs for d; Q4_K/Q5_K's mins are
//   dmin * m * (the float32 sum of x over the sub-block, not quantised), 8 at once.
// - 32-input blocks (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1) have a float16 scale per 32, which a dot cannot
//   fold in: one float multiply-add per block and row would cost as much as the dot. So they are
//   repacked at load (pack_gguf_x4 in cpu_linear.py: a permutation, every stored value kept) four
//   blocks to a group: a 32-lane load holds 8 inputs of each of the 4 blocks, so one int32
//   accumulator's lanes 4b..4b+3 belong to block b, and 4 blocks cost one float multiply-add with
//   the vector (d0 x4, d1 x4, d2 x4, d3 x4). Group layout: d[4] f16, [m[4] f16 (Q4_1, Q5_1)],
//   [high bits: 4 x u32, word j bit i = bit 4 of position 32j + i (Q5_0, Q5_1)], then the levels in
//   positions 0..127 (position p holds input 8 * (p / 32) + p % 8 of block (p % 32) / 8): Q8_0 one
//   int8 each; the 4/5-bit types a nibble each, byte 32c + i = p[64c + i] | p[64c + 32 + i] << 4.
//   K is padded to a multiple of 128 with zero blocks (d = 0).
// One call runs every shard of a fused projection (row ranges of different block types, e.g. Q4_K
// q/k and Q6_K v), the activations quantised once; meta [S, 4] int64: ggml type, rows, bytes per
// row, byte offset in buf.
#if ISV_Q4_VNNI && ISV_AVX2_FMA && defined(__F16C__)
#define ISV_GG_AVX512 1
#else
#define ISV_GG_AVX512 0
#endif
#if ISV_AVX2_FMA && defined(__F16C__)
#define ISV_GG_AVX2 1
#else
#define ISV_GG_AVX2 0
#endif



// The AVX2 path reads the K-quants' activations per 32 inputs as the 16 even inputs, then the 16 odd
// ones (see there); the others in input order.
constexpr bool kXqEvenOdd = !ISV_GG_AVX512 && ISV_GG_AVX2;  // xq and xq4 alike

struct GgRows {  // the quantised activation rows
  const int16_t* xq;   // [M, K] (K-quant blocks): in input order, or even / odd per 32 (kXqEvenOdd)
  const int16_t* xq4;  // [M, K4], each 128 inputs in the x4 order (32-input blocks; then even / odd per 32
                       // positions where kXqEvenOdd); null when unused
  const float* dx;     // [M]: one scale a row (null with xq)
  const float* sx;     // [M, K4 / 32]: float32 sum of x over each 32 inputs (not quantised), zero past K (null with xq)
  int64_t K, K4;
  // row strides of xq, xq4 and x8 (elements): a row and 64 bytes, so that the rows of a tile do not
  // all fall in the same L1 sets (a 4 KiB multiple apart, as K 2048 int16 or K 8192 int8 rows would be,
  // 8 rows share 8-way sets with the weights and evict each other)
  int64_t lq, lq4, l8;
  // int8 activations for the K-quants (gguf_gemm(int8=true), llama.cpp's Q8_K), null otherwise: levels
  // round(x / d8) per 256 inputs, d8 = amax / 127, and the levels' sums per 16 inputs
  const int8_t* x8 = nullptr;  // [M, K]
  const float* d8 = nullptr;   // [M, K / 256]
  const int16_t* bs = nullptr;  // [M, K / 16]
  // the same int8 rows laid out for AMX (gemm_gguf_amx.h), where the call runs its K-quant shards there
  const AmxActivations* amx = nullptr;
  const AmxActivations16* amx16 = nullptr;  // the int16 rows laid out for AMX, where the call runs them there
  GgRows at(int64_t m) const {
    return {xq ? xq + m * lq : nullptr, xq4 ? xq4 + m * lq4 : nullptr, xq ? dx + m : nullptr,
            xq ? sx + m * (K4 / 32) : nullptr, K, K4, lq, lq4, l8, x8 ? x8 + m * l8 : nullptr,
            x8 ? d8 + m * (K / 256) : nullptr, x8 ? bs + m * (K / 16) : nullptr};
  }
};

// One output column's running sums for MB rows between two K chunks of gg_rows (any ISA's lanes): a
// chunk picks up the float accumulators where the previous one left them, so a row's float
// operations run in the same order as in one pass over K (bit-equal at every chunking).
template <int MB>
struct GgCarry {
  float acc[MB][16];
  float kmin[MB][8];
  float bmin[MB][4];
};

// Q4_K / Q5_K super-block b: where its 128 bytes of nibbles start (after Q5_K's 32 bytes of fifth bits)
template <int64_t TYPE>
inline const uint8_t* k4_nibbles(const uint8_t* b) {
  return b + (TYPE == kQ5_K ? 48 : 16);
}

#if ISV_GG_AVX512 || ISV_GG_AVX2
// The K-quants' levels as 32 u8 in input order, what every vector path of gg_rows and gg_rows_i8 reads.
// Q6_K: the four 32-input pieces of half h (inputs 128h .. 128h + 127) of block b, 0..63 (before - 32).
inline void q6k_levels(const uint8_t* b, int h, __m256i q[4]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
  const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
  q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
  q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(hb, m30));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                         _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
}

// Q4_K / Q5_K: the levels of sub-blocks 2j (lo) and 2j + 1 (hi) from their 32 bytes of nibbles; Q5_K
// adds bit 4 from qh (bit s of qh[i]: bit 4 of sub-block s's input i).
template <bool Q5>
inline void k4_levels(__m256i bytes, __m256i qh, int j, __m256i& lo, __m256i& hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
  if constexpr (Q5) {
    const __m256i m10 = _mm256_set1_epi8(0x10);
    const int s = 2 * j;  // s <= 6: shift left by 4 - s or right by s - 4, then keep bit 4
    const __m256i h0 = s <= 4 ? _mm256_slli_epi16(qh, 4 - s) : _mm256_srli_epi16(qh, s - 4);
    const __m256i h1 = s + 1 <= 4 ? _mm256_slli_epi16(qh, 3 - s) : _mm256_srli_epi16(qh, s - 3);
    lo = _mm256_or_si256(lo, _mm256_and_si256(h0, m10));
    hi = _mm256_or_si256(hi, _mm256_and_si256(h1, m10));
  }
}

// k4_levels' qh for super-block b: Q5_K's 32 bytes of fifth bits, zero for Q4_K
template <int64_t TYPE>
inline __m256i k4_fifth_bits(const uint8_t* b) {
  if constexpr (TYPE == kQ5_K) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
  else return _mm256_setzero_si256();
}

// A Q4_K / Q5_K super-block's 8 sub-block mins `mn` (k4_scales) times its dmin, as floats: what the
// mins term multiplies the activations' float sums by (gg_rows: the int16 path).
inline __m256 k4_mins(const uint8_t* b, uint64_t mn) {
  return _mm256_mul_ps(_mm256_set1_ps(f16_at(b + 2)),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn)))));
}

// The mins term of gg_rows (K-quants' 8 sub-block mins, Q4_1/Q5_1's one min per 32 inputs) times
// the activations' sums: 8 and 4 lanes wide on either ISA, so both vector paths keep it here.
template <int64_t TYPE, int MB>
struct GgMins {
  __m256 k[MB];  // K-quant mins, 8 sub-blocks at once
  __m128 b4[MB];  // 32-input blocks' mins, 4 at once

  GgMins() {
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) k[m] = _mm256_setzero_ps(), b4[m] = _mm_setzero_ps();
  }
  // super-block sb: mins `mn` (8 bytes) scaled by its dmin, at `b`
  void add_kquant(const uint8_t* b, uint64_t mn, const GgRows& a, int64_t B4, int64_t sb) {
    const __m256 mv = k4_mins(b, mn);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) k[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(a.sx + m * B4 + sb * 8), k[m]);
  }
  // group g of four 32-input blocks, whose four f16 mins sit at gb + 8
  void add_blocks(const uint8_t* gb, const GgRows& a, int64_t B4, int64_t g) {
    const __m128 mv = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gb + 8)));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) b4[m] = _mm_fmadd_ps(mv, _mm_loadu_ps(a.sx + m * B4 + 4 * g), b4[m]);
  }
  void load(const GgCarry<MB>& c) {
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) k[m] = _mm256_loadu_ps(c.kmin[m]), b4[m] = _mm_loadu_ps(c.bmin[m]);
  }
  void save(GgCarry<MB>& c) const {
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) _mm256_storeu_ps(c.kmin[m], k[m]), _mm_storeu_ps(c.bmin[m], b4[m]);
  }
  float total(int m) const {
    if constexpr (!has_min(TYPE)) return 0.f;
    else if constexpr (is_kquant(TYPE)) return -reduce_add8(k[m]);
    else return reduce_add8(_mm256_insertf128_ps(_mm256_setzero_ps(), b4[m], 0));
  }
};
#endif

#if ISV_GG_AVX2
// The K-quants' scale vector for 32 inputs on AVX2: int16 lanes 0-7 all `scales`' lane lo (the scale of
// inputs 0-15), lanes 8-15 all lane hi (inputs 16-31); `scales` holds the same 8 int16 in both halves.
// The shuffle controls come from a table (a memory operand of vpshufb): built in registers, the
// compiler rebuilt the ones it could not keep every super-block (4 instructions each, Zen 3's 1-row
// loops are bound by their instruction count, not by memory).
struct PickControls {
  alignas(32) uint8_t c[8][8][32];  // [lo][hi]: bytes 2l, 2l + 1 of lane l in every int16 lane of a half
  constexpr PickControls() : c{} {
    for (int lo = 0; lo < 8; ++lo)
      for (int hi = 0; hi < 8; ++hi)
        for (int i = 0; i < 32; ++i) c[lo][hi][i] = static_cast<uint8_t>(2 * (i < 16 ? lo : hi) + (i & 1));
  }
};
inline constexpr PickControls kPickControls{};
inline __m256i pick_scales(__m256i scales, int lo, int hi) {
  return _mm256_shuffle_epi8(scales, _mm256_load_si256(reinterpret_cast<const __m256i*>(kPickControls.c[lo][hi])));
}
#endif

// Out[m, n] for n in [n0, n1) of one shard: w its first row, `last` its last row index (prefetch),
// over inputs [k0, k1) (whole blocks / groups); in chunks (CH), a chunk after the first starts from
// carry[n - n0], and one before the last leaves its sums there instead of writing out. One pass over
// K (CH false) is its own instantiation, the carry's branches compiled out.
template <int64_t TYPE, int MB, bool CH, typename T>
void gg_rows(const GgRows& a, const uint8_t* w, int64_t row_bytes, T* out, int64_t ldo, int64_t n0, int64_t n1,
             int64_t last, int64_t k0, int64_t k1, GgCarry<MB>* carry) {
  const int64_t K = a.K, B4 = a.K4 / 32;
  constexpr bool KQ = is_kquant(TYPE);
  const bool first = !CH || k0 == 0, final = !CH || k1 >= (KQ ? K : a.K4);
  // in chunks the next bytes read are the next weight row's at the same inputs, one row ahead
  [[maybe_unused]] const int64_t ahead = CH ? row_bytes : stream_ahead();
  [[maybe_unused]] const uint8_t* wend = w + (last + 1) * row_bytes;  // the shard's end
#if ISV_GG_AVX512
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m512 acc[MB];
    GgMins<TYPE, MB> mins;
    GgCarry<MB>* c = carry ? carry + (n - n0) : nullptr;  // null in a one-chunk pass
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[m] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c->acc[m]);
    if (!first) mins.load(*c);
    if constexpr (KQ) {
      for (int64_t sb = k0 / 256; sb < k1 / 256; ++sb) {
        const uint8_t* b = wr + sb * kquant_bytes(TYPE);
        prefetch_stream(b, kquant_bytes(TYPE), wend, ahead);
        // NA int32 accumulators a row (few rows: a single chain of dependent dots would bound the loop)
        constexpr int NA = MB == 1 ? 4 : MB == 2 ? 2 : 1;
        __m512i is[MB][NA];
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m)
          for (int i = 0; i < NA; ++i) is[m][i] = _mm512_setzero_si512();
        float d;
        if constexpr (TYPE == kQ6_K) {
          d = f16_at(b + 208);
          const __m512i sc = _mm512_castsi256_si512(
              _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
          for (int h = 0; h < 2; ++h) {
            __m256i q[4];
            q6k_levels(b, h, q);
            for (int s = 0; s < 4; ++s) {
              // lanes 0-15 take scale 8h + 2s, lanes 16-31 the next
              const int16_t i0 = static_cast<int16_t>(8 * h + 2 * s);
              const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi16(i0), _mm256_set1_epi16(i0 + 1), 1);
              const __m512i wv = _mm512_mullo_epi16(
                  _mm512_sub_epi16(_mm512_cvtepu8_epi16(q[s]), _mm512_set1_epi16(32)),
                  _mm512_permutexvar_epi16(idx, sc));
#pragma GCC unroll 8
              for (int m = 0; m < MB; ++m)
                is[m][s % NA] = _mm512_dpwssd_epi32(is[m][s % NA], wv,
                                                    _mm512_loadu_si512(a.xq + m * a.lq + sb * 256 + 128 * h + 32 * s));
            }
          }
        } else {
          uint64_t sc, mn;
          d = f16_at(b);
          k4_scales(b + 4, sc, mn);
          mins.add_kquant(b, mn, a, B4, sb);
          const uint8_t* qs = k4_nibbles<TYPE>(b);
          const __m256i qh = k4_fifth_bits<TYPE>(b);
          const __m512i scz = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
          for (int j = 0; j < 4; ++j) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
            __m256i lo, hi;
            k4_levels<TYPE == kQ5_K>(bytes, qh, j, lo, hi);
            const __m512i s0 = _mm512_permutexvar_epi16(_mm512_set1_epi16(2 * j), scz);  // sub-block 2j's scale
            const __m512i s1 = _mm512_permutexvar_epi16(_mm512_set1_epi16(2 * j + 1), scz);
            const __m512i w0 = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(lo), s0);
            const __m512i w1 = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(hi), s1);
#pragma GCC unroll 8
            for (int m = 0; m < MB; ++m) {
              const int16_t* xr = a.xq + m * a.lq + sb * 256 + 64 * j;
              is[m][(2 * j) % NA] = _mm512_dpwssd_epi32(is[m][(2 * j) % NA], w0, _mm512_loadu_si512(xr));
              is[m][(2 * j + 1) % NA] = _mm512_dpwssd_epi32(is[m][(2 * j + 1) % NA], w1, _mm512_loadu_si512(xr + 32));
            }
          }
        }
        const __m512 dv = _mm512_set1_ps(d);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          __m512i sum = is[m][0];  // the parts of one super-block: within the int32 bound above
          for (int i = 1; i < NA; ++i) sum = _mm512_add_epi32(sum, is[m][i]);
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), dv, acc[m]);
        }
      }
    } else {
      const __m512i by4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
      const __m256i m10 = _mm256_set1_epi8(0x10);
      for (int64_t g = k0 / 128; g < k1 / 128; ++g) {
        const uint8_t* gb = wr + g * x4_bytes(TYPE);
        prefetch_stream(gb, x4_bytes(TYPE), wend, ahead);
        const __m512 dv = _mm512_permutexvar_ps(
            by4, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gb)))));
        const uint8_t* lv = gb + x4_header(TYPE);
        __m512i wv[4];
        if constexpr (TYPE == kQ8_0) {
          for (int j = 0; j < 4; ++j)
            wv[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lv + 32 * j)));
        } else {
          const uint8_t* hbits = gb + 8 + (has_min(TYPE) ? 8 : 0);
          for (int c = 0; c < 2; ++c) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lv + 32 * c));
            __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            if constexpr (TYPE == kQ5_0 || TYPE == kQ5_1) {
              uint32_t b0, b1;
              std::memcpy(&b0, hbits + 8 * c, 4);
              std::memcpy(&b1, hbits + 8 * c + 4, 4);
              lo = _mm256_or_si256(lo, _mm256_maskz_mov_epi8(b0, m10));
              hi = _mm256_or_si256(hi, _mm256_maskz_mov_epi8(b1, m10));
            }
            wv[2 * c] = _mm512_cvtepu8_epi16(lo);
            wv[2 * c + 1] = _mm512_cvtepu8_epi16(hi);
            if constexpr (x4_offset(TYPE) != 0) {
              wv[2 * c] = _mm512_sub_epi16(wv[2 * c], _mm512_set1_epi16(x4_offset(TYPE)));
              wv[2 * c + 1] = _mm512_sub_epi16(wv[2 * c + 1], _mm512_set1_epi16(x4_offset(TYPE)));
            }
          }
        }
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          const int16_t* xr = a.xq4 + m * a.lq4 + g * 128;
          __m512i i0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wv[0], _mm512_loadu_si512(xr));
          __m512i i1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wv[1], _mm512_loadu_si512(xr + 32));
          i0 = _mm512_dpwssd_epi32(i0, wv[2], _mm512_loadu_si512(xr + 64));
          i1 = _mm512_dpwssd_epi32(i1, wv[3], _mm512_loadu_si512(xr + 96));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), dv, acc[m]);
        }
        if constexpr (has_min(TYPE)) mins.add_blocks(gb, a, B4, g);
      }
    }
    if (!final) {
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) _mm512_storeu_ps(c->acc[m], acc[m]);
      mins.save(*c);
      continue;
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) store(out + m * ldo + n, _mm512_reduce_add_ps(acc[m]) * a.dx[m] + mins.total(m));
  }
#elif ISV_GG_AVX2
  // AVX2 (+ F16C): the same integer sums on 16 lanes, vpmaddwd + vpaddd. K-quants: each 32 inputs' levels
  // are taken as 16 int16 lanes holding a byte pair each (inputs 2i, 2i + 1), split into the even inputs
  // (& 0xFF) and the odd ones (>> 8) without crossing the register's halves, scaled, and dotted with the
  // activations' even and odd inputs (GgRows::xq's AVX2 order); int32 lane l of a super-block's sum holds
  // inputs 4l..4l+3 of every 32, exact (Q4_K / Q5_K: at most 32 products a lane of 31 * 63 * 32767 < 2^31;
  // Q6_K's larger levels: one sum per 128 inputs). Widening bytes to int16 in input order (vpmovzxbw
  // across the halves, as before) cost 1.35x the time a row at one activation row (Zen 3).
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m256 acc[MB];
    GgMins<TYPE, MB> mins;
    GgCarry<MB>* c = carry ? carry + (n - n0) : nullptr;  // null in a one-chunk pass
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[m] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c->acc[m]);
    if (!first) mins.load(*c);
    if constexpr (KQ) {
      const __m256i lowb = _mm256_set1_epi16(0x00FF);
      for (int64_t sb = k0 / 256; sb < k1 / 256; ++sb) {
        const uint8_t* b = wr + sb * kquant_bytes(TYPE);
        prefetch_stream(b, kquant_bytes(TYPE), wend, ahead);
        __m256i is[MB];
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) is[m] = _mm256_setzero_si256();
        // one 32-input piece at input offset off: the levels split into even inputs we and odd ones wo
        // (int16), less sub, times sv (pick_scales); `piece` takes them as 32 u8 in input order
        auto piece_eo = [&](__m256i we, __m256i wo, __m256i sv, int16_t sub, int64_t off) {
          if (sub) we = _mm256_sub_epi16(we, _mm256_set1_epi16(sub)), wo = _mm256_sub_epi16(wo, _mm256_set1_epi16(sub));
          we = _mm256_mullo_epi16(we, sv);
          wo = _mm256_mullo_epi16(wo, sv);
#pragma GCC unroll 8
          for (int m = 0; m < MB; ++m) {
            const __m256i* xr = reinterpret_cast<const __m256i*>(a.xq + m * a.lq + sb * 256 + off);
            is[m] = _mm256_add_epi32(is[m], _mm256_add_epi32(_mm256_madd_epi16(we, _mm256_loadu_si256(xr)),
                                                             _mm256_madd_epi16(wo, _mm256_loadu_si256(xr + 1))));
          }
        };
        auto piece = [&](__m256i q, __m256i sv, int16_t sub, int64_t off) {
          piece_eo(_mm256_and_si256(q, lowb), _mm256_srli_epi16(q, 8), sv, sub, off);
        };
        float d;
        if constexpr (TYPE == kQ6_K) {
          d = f16_at(b + 208);
          const __m256 dv = _mm256_set1_ps(d);
          for (int h = 0; h < 2; ++h) {
            const __m256i scales = _mm256_broadcastsi128_si256(
                _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 192 + 8 * h))));
            __m256i q[4];
            q6k_levels(b, h, q);
            for (int s = 0; s < 4; ++s) piece(q[s], pick_scales(scales, 2 * s, 2 * s + 1), 32, 128 * h + 32 * s);
#pragma GCC unroll 8
            for (int m = 0; m < MB; ++m) {  // one 128 inputs' sum: (q - 32) * sc up to 4096, 16 products a lane
              acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[m]), dv, acc[m]);
              is[m] = _mm256_setzero_si256();
            }
          }
        } else {
          uint64_t sc, mn;
          d = f16_at(b);
          k4_scales(b + 4, sc, mn);
          mins.add_kquant(b, mn, a, B4, sb);
          const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
          const uint8_t* qs = k4_nibbles<TYPE>(b);
          const __m256i qh = k4_fifth_bits<TYPE>(b);
          const __m256i n0 = _mm256_set1_epi16(0x000F);  // Q4_K: each int16 lane's four nibbles straight out
          for (int j = 0; j < 4; ++j) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
            if constexpr (TYPE == kQ4_K) {
              piece_eo(_mm256_and_si256(bytes, n0), _mm256_and_si256(_mm256_srli_epi16(bytes, 8), n0),
                       pick_scales(scales, 2 * j, 2 * j), 0, 64 * j);
              piece_eo(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), n0), _mm256_srli_epi16(bytes, 12),
                       pick_scales(scales, 2 * j + 1, 2 * j + 1), 0, 64 * j + 32);
              continue;
            }
            __m256i lo, hi;
            k4_levels<TYPE == kQ5_K>(bytes, qh, j, lo, hi);
            piece(lo, pick_scales(scales, 2 * j, 2 * j), 0, 64 * j);
            piece(hi, pick_scales(scales, 2 * j + 1, 2 * j + 1), 0, 64 * j + 32);
          }
          const __m256 dv = _mm256_set1_ps(d);
#pragma GCC unroll 8
          for (int m = 0; m < MB; ++m) acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[m]), dv, acc[m]);
        }
      }
    } else {
      // the group's 4 scales, each on the two int32 lanes its block's positions land on (see below)
      const __m256i by2 = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
      const __m256i lowb = _mm256_set1_epi16(0x00FF);
      for (int64_t g = k0 / 128; g < k1 / 128; ++g) {
        const uint8_t* gb = wr + g * x4_bytes(TYPE);
        prefetch_stream(gb, x4_bytes(TYPE), wend, ahead);
        const __m256 dv = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gb)))), by2);
        const uint8_t* lv = gb + x4_header(TYPE);
        __m256i q[4];  // the 4 x 32 positions' levels as u8 (i8 for Q8_0; Q4_0 / Q4_1 split below straight from the bytes)
        if constexpr (TYPE == kQ8_0) {
          for (int j = 0; j < 4; ++j) q[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lv + 32 * j));
        } else if constexpr (TYPE == kQ5_0 || TYPE == kQ5_1) {
          const uint8_t* hbits = gb + 8 + (has_min(TYPE) ? 8 : 0);
          for (int c = 0; c < 2; ++c) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lv + 32 * c));
            q[2 * c] = _mm256_and_si256(bytes, low4);
            q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            for (int t = 0; t < 2; ++t) {  // 32 bits -> 32 bytes of 0x10 / 0 (llama.cpp's bytes_from_bits_32)
              uint32_t bits;
              std::memcpy(&bits, hbits + 8 * c + 4 * t, 4);
              const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
              __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), shuf);
              v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
              v = _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
              q[2 * c + t] = _mm256_or_si256(q[2 * c + t], _mm256_and_si256(v, _mm256_set1_epi8(0x10)));
            }
          }
        }
        // as the K-quants: int16 lane i of q[j] holds positions 2i, 2i + 1, split into the even and odd
        // positions without crossing the halves; int32 lane l of the dot holds positions 4l..4l+3 of
        // each 32, i.e. block l / 2
        __m256i we[4], wo[4];
        for (int j = 0; j < 4; ++j) {
          if constexpr (TYPE == kQ4_0 || TYPE == kQ4_1) {  // each int16 lane's four nibbles straight out
            const __m256i n0 = _mm256_set1_epi16(0x000F);
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lv + 32 * (j / 2)));
            we[j] = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, n0);
            wo[j] = j % 2 ? _mm256_srli_epi16(bytes, 12) : _mm256_and_si256(_mm256_srli_epi16(bytes, 8), n0);
            if constexpr (x4_offset(TYPE) != 0) {
              const __m256i off = _mm256_set1_epi16(x4_offset(TYPE));
              we[j] = _mm256_sub_epi16(we[j], off), wo[j] = _mm256_sub_epi16(wo[j], off);
            }
          } else if constexpr (TYPE == kQ8_0) {
            we[j] = _mm256_srai_epi16(_mm256_slli_epi16(q[j], 8), 8);
            wo[j] = _mm256_srai_epi16(q[j], 8);
          } else {
            we[j] = _mm256_and_si256(q[j], lowb);
            wo[j] = _mm256_srli_epi16(q[j], 8);
            if constexpr (x4_offset(TYPE) != 0) {
              const __m256i off = _mm256_set1_epi16(x4_offset(TYPE));
              we[j] = _mm256_sub_epi16(we[j], off), wo[j] = _mm256_sub_epi16(wo[j], off);
            }
          }
        }
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          const __m256i* xr = reinterpret_cast<const __m256i*>(a.xq4 + m * a.lq4 + g * 128);
          __m256i i0 = _mm256_madd_epi16(we[0], _mm256_loadu_si256(xr));
          __m256i i1 = _mm256_madd_epi16(wo[0], _mm256_loadu_si256(xr + 1));
          for (int j = 1; j < 4; ++j) {
            i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(we[j], _mm256_loadu_si256(xr + 2 * j)));
            i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(wo[j], _mm256_loadu_si256(xr + 2 * j + 1)));
          }
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), dv, acc[m]);
        }
        if constexpr (has_min(TYPE)) mins.add_blocks(gb, a, B4, g);
      }
    }
    if (!final) {
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) _mm256_storeu_ps(c->acc[m], acc[m]);
      mins.save(*c);
      continue;
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) store(out + m * ldo + n, reduce_add8(acc[m]) * a.dx[m] + mins.total(m));
  }
#else
  // portable: the same integer sums, one input at a time
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    float acc[MB] = {}, mins[MB] = {};
    GgCarry<MB>* c = carry ? carry + (n - n0) : nullptr;  // null in a one-chunk pass
    if (!first)
      for (int m = 0; m < MB; ++m) acc[m] = c->acc[m][0], mins[m] = c->kmin[m][0];
    if constexpr (KQ) {
      for (int64_t sb = k0 / 256; sb < k1 / 256; ++sb) {
        const uint8_t* b = wr + sb * kquant_bytes(TYPE);
        int64_t is[MB] = {};  // up to 256 products of 2^12 x 2^15: past int32
        float d;
        if constexpr (TYPE == kQ6_K) {
          d = f16_at(b + 208);
          const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
          for (int i = 0; i < 256; ++i) {
            const int h = i / 128, s = (i % 128) / 32, l = i % 32;
            const int lb = b[64 * h + 32 * (s & 1) + l], hb = b[128 + 32 * h + l];
            const int q = ((s < 2 ? lb & 0xF : lb >> 4) | (((hb >> (2 * s)) & 3) << 4)) - 32;
            const int32_t wq = q * sc[i / 16];
            for (int m = 0; m < MB; ++m) is[m] += wq * a.xq[m * a.lq + sb * 256 + i];
          }
        } else {
          uint64_t sc, mn;
          d = f16_at(b);
          const float dmin = f16_at(b + 2);
          k4_scales(b + 4, sc, mn);
          const uint8_t* qs = k4_nibbles<TYPE>(b);
          for (int i = 0; i < 256; ++i) {
            const int j = i / 64, l = i % 32, s = i / 32;
            int q = (i % 64) < 32 ? qs[32 * j + l] & 0xF : qs[32 * j + l] >> 4;
            if constexpr (TYPE == kQ5_K) q |= ((b[16 + l] >> s) & 1) << 4;
            const int32_t wq = q * byte_of(sc, s);
            for (int m = 0; m < MB; ++m) is[m] += wq * a.xq[m * a.lq + sb * 256 + i];
          }
          for (int s = 0; s < 8; ++s)
            for (int m = 0; m < MB; ++m) mins[m] -= dmin * static_cast<float>(byte_of(mn, s)) * a.sx[m * B4 + sb * 8 + s];
        }
        for (int m = 0; m < MB; ++m) acc[m] += d * static_cast<float>(is[m]);
      }
    } else {
      for (int64_t g = k0 / 128; g < k1 / 128; ++g) {
        const uint8_t* gb = wr + g * x4_bytes(TYPE);
        const uint8_t* lv = gb + x4_header(TYPE);
        const uint8_t* hbits = gb + 8 + (has_min(TYPE) ? 8 : 0);
        int32_t is[MB][4] = {};
        for (int p = 0; p < 128; ++p) {
          int q;
          if constexpr (TYPE == kQ8_0) {
            q = static_cast<int8_t>(lv[p]);
          } else {
            const int byte = lv[32 * (p / 64) + p % 32];
            q = (p % 64) < 32 ? byte & 0xF : byte >> 4;
            if constexpr (TYPE == kQ5_0 || TYPE == kQ5_1) q |= ((hbits[4 * (p / 32) + (p % 32) / 8] >> (p % 8)) & 1) << 4;
            q -= x4_offset(TYPE);
          }
          for (int m = 0; m < MB; ++m) is[m][(p % 32) / 8] += q * a.xq4[m * a.K4 + g * 128 + p];
        }
        for (int b4 = 0; b4 < 4; ++b4) {
          const float db = f16_at(gb + 2 * b4);
          for (int m = 0; m < MB; ++m) {
            acc[m] += db * static_cast<float>(is[m][b4]);
            if constexpr (has_min(TYPE)) mins[m] += f16_at(gb + 8 + 2 * b4) * a.sx[m * B4 + 4 * g + b4];
          }
        }
      }
    }
    if (!final) {
      for (int m = 0; m < MB; ++m) c->acc[m][0] = acc[m], c->kmin[m][0] = mins[m];
      continue;
    }
    for (int m = 0; m < MB; ++m) store(out + m * ldo + n, acc[m] * a.dx[m] + mins[m]);
  }
#endif
}

#if ISV_GG_AVX2
// gg_rows for the K-quants on int8 activations (GgRows::x8; AVX2, also in AVX-512 builds): llama.cpp's
// Q4_K x Q8_K dot, vpmaddubsw (u8 levels x s8 activations, pairs summed in int16: at most 2 * 63 * 127)
// then vpmaddwd by the sub-block scales, one float multiply-add a super-block with d * d8. About half
// the instructions of the int16 path a weight, at llama.cpp's accuracy instead of int16's (docs/profile.md).
// The mins term reads the same int8 levels as the dot (their sums per 16, bs; llama.cpp's bsums): the
// dot part's rounding errors then cancel against the mins' instead of adding to them (from the float
// sums of x, Gemma 3's o_proj outputs were 1.4-4x further from float32 than both terms on the levels);
// Q6_K's offset of 32 comes off the same way, as 32 * sc * bs.
#if ISV_GG_AVX512
// On AVX-512 (VNNI), blocks of 4 and 8 rows run two of those 32-input pieces (64 inputs in order) as
// one 512-bit vpmaddubsw and one vpdpwssd a row, a third of the AVX2 loop's instructions a row; Q4_K's
// two nibbles of a byte split in one 512-bit shift. Measured on a 2-core AMX Xeon (docs/profile.md):
// 1.03-1.5x the AVX2 loop at 4 and 8 rows; at 1 and 2 rows, where unpacking the levels is most of the
// work, no faster (0.8-1.1x: 512-bit operations have half the vector ports), so those keep the AVX2
// loop. The int32 sums are the same integers, lane 8 + i of the wide sum added onto lane i (inputs
// 4i .. 4i + 3 of a piece) before they reach float, so the results are the AVX2 path's bit for bit
// (tests/test_kquant.py). The scale vector of a pair of pieces: int16 lanes 8c .. 8c + 7 hold scale
// kScales512[v][8c] of `scales`.
struct Scales512 {
  alignas(64) int16_t c[6][32];  // 0-3: Q4_K/Q5_K sub-blocks 2j, 2j + 1; 4, 5: Q6_K's scales 0-3, 4-7
  constexpr Scales512() : c{} {
    for (int i = 0; i < 32; ++i) {
      for (int j = 0; j < 4; ++j) c[j][i] = static_cast<int16_t>(2 * j + (i >= 16));
      c[4][i] = static_cast<int16_t>(i / 8), c[5][i] = static_cast<int16_t>(4 + i / 8);
    }
  }
};
inline constexpr Scales512 kScales512{};
inline __m512i scales512(__m256i scales, int v) {  // `scales`: 8 int16 in its low 128 bits
  return _mm512_permutexvar_epi16(_mm512_load_si512(kScales512.c[v]), _mm512_castsi256_si512(scales));
}
#endif

template <int64_t TYPE, int MB, bool CH, typename T>
void gg_rows_i8(const GgRows& a, const uint8_t* w, int64_t row_bytes, T* out, int64_t ldo, int64_t n0, int64_t n1,
                int64_t last, int64_t k0, int64_t k1, GgCarry<MB>* carry) {
  const int64_t K = a.K, NB = K / 256;
  const bool first = !CH || k0 == 0, final = !CH || k1 >= K;
  const int64_t ahead = CH ? row_bytes : stream_ahead();
  const uint8_t* wend = w + (last + 1) * row_bytes;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m256 acc[MB];
    GgCarry<MB>* c = carry ? carry + (n - n0) : nullptr;
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[m] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c->acc[m]);
    for (int64_t sb = k0 / 256; sb < k1 / 256; ++sb) {
      const uint8_t* b = wr + sb * kquant_bytes(TYPE);
      prefetch_stream(b, kquant_bytes(TYPE), wend, ahead);
      __m256i is[MB];
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) is[m] = _mm256_setzero_si256();
      // 32 levels q (u8, input order) at input offset off, times scale vector sv
      auto piece = [&](__m256i q, __m256i sv, int64_t off) {
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.x8 + m * a.l8 + sb * 256 + off));
          is[m] = _mm256_add_epi32(is[m], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), sv));
        }
      };
#if ISV_GG_AVX512
      constexpr bool kWide = MB >= 4;  // the 512-bit loop (see there)
      [[maybe_unused]] __m512i iz[MB];  // the piece pairs' sums, lanes 8 + i to go onto lanes i (halves_to_is)
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) iz[m] = _mm512_setzero_si512();
      // two pieces: 64 levels q (u8, input order) at input offset off, times the pair's scale vector sv
      [[maybe_unused]] auto pieces = [&](__m512i q, __m512i sv, int64_t off) {
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m)
          iz[m] = _mm512_dpwssd_epi32(
              iz[m], _mm512_maddubs_epi16(q, _mm512_loadu_si512(a.x8 + m * a.l8 + sb * 256 + off)), sv);
      };
      [[maybe_unused]] auto join = [](__m256i q0, __m256i q1) {
        return _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
      };
      [[maybe_unused]] auto halves_to_is = [&] {
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m)
          is[m] = _mm256_add_epi32(_mm512_castsi512_si256(iz[m]), _mm512_extracti64x4_epi64(iz[m], 1));
      };
#endif
      float d, dmin = 0.f;
      [[maybe_unused]] __m256i ms[MB];  // Q4_K, Q5_K: the mins' integer sums
      if constexpr (TYPE == kQ6_K) {
        d = f16_at(b + 208);
        for (int h = 0; h < 2; ++h) {
          const __m256i scales = _mm256_broadcastsi128_si256(
              _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 192 + 8 * h))));
          __m256i q[4];
          q6k_levels(b, h, q);
#if ISV_GG_AVX512
          if constexpr (kWide) {
            pieces(join(q[0], q[1]), scales512(scales, 4), 128 * h);
            pieces(join(q[2], q[3]), scales512(scales, 5), 128 * h + 64);
            continue;
          }
#endif
          for (int s = 0; s < 4; ++s) piece(q[s], pick_scales(scales, 2 * s, 2 * s + 1), 128 * h + 32 * s);
        }
#if ISV_GG_AVX512
        if constexpr (kWide) halves_to_is();
#endif
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {  // the levels' offset: 32 * sum over the 16 sub-blocks of sc * bs
          const __m256i bsv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bs + m * (K / 16) + sb * 16));
          is[m] = _mm256_sub_epi32(is[m], _mm256_slli_epi32(_mm256_madd_epi16(sc16, bsv), 5));
        }
      } else {
        uint64_t sc, mn;
        d = f16_at(b);
        dmin = f16_at(b + 2);
        k4_scales(b + 4, sc, mn);
        const __m128i m8 = _mm_cvtsi64_si128(static_cast<int64_t>(mn));
        const __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));  // lanes 2j, 2j + 1: sub-block j's min
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m)  // lane j: m_j * the levels' sum over sub-block j (<= 63 * 32 * 127)
          ms[m] = _mm256_madd_epi16(m16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bs + m * (K / 16) + sb * 16)));
        const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
        const uint8_t* qs = k4_nibbles<TYPE>(b);
        const __m256i qh = k4_fifth_bits<TYPE>(b);
        for (int j = 0; j < 4; ++j) {
#if ISV_GG_AVX512
          if constexpr (kWide && TYPE == kQ4_K) {  // the 32 bytes in both halves, the high half's shifted by 4
            const __m512i bytes =
                _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j)));
            const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
            pieces(_mm512_and_si512(_mm512_srlv_epi16(bytes, shift), _mm512_set1_epi8(0x0F)), scales512(scales, j),
                   64 * j);
            continue;
          }
#endif
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
          __m256i lo, hi;
          k4_levels<TYPE == kQ5_K>(bytes, qh, j, lo, hi);
#if ISV_GG_AVX512
          if constexpr (kWide) {
            pieces(join(lo, hi), scales512(scales, j), 64 * j);
            continue;
          }
#endif
          piece(lo, pick_scales(scales, 2 * j, 2 * j), 64 * j);
          piece(hi, pick_scales(scales, 2 * j + 1, 2 * j + 1), 64 * j + 32);
        }
#if ISV_GG_AVX512
        if constexpr (kWide) halves_to_is();
#endif
      }
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[m]), _mm256_set1_ps(d * a.d8[m * NB + sb]), acc[m]);
        if constexpr (TYPE != kQ6_K)
          acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms[m]), _mm256_set1_ps(dmin * a.d8[m * NB + sb]), acc[m]);
      }
    }
    if (!final) {
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) _mm256_storeu_ps(c->acc[m], acc[m]);
      continue;
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) store(out + m * ldo + n, reduce_add8(acc[m]));
  }
}
#endif

#if ISV_GG_AVX2
// ---- int8 rows, many at once: the K-quants' weight rows 8 at a time, interleaved ------------------
// gg_rows_i8 gives each (activation row, weight row, 32 inputs) a vpmaddubsw and a vpmaddwd (the
// sub-block scale): with a super-block's fixed work per row it ran at ~15 multiply-adds a cycle on
// Zen 3, half of what its two multiply pipes take. From kInterleaveRows<TYPE> activation rows (a prompt
// chunk, a large batch), 8 weight rows' levels are laid out 4 inputs of each row in turn (IlBlock,
// built once per 8 weight rows and read by every activation row), so one vpmaddubsw against 4 inputs
// of an activation row, broadcast, covers 8 weight rows, and the groups of a piece that share each
// weight row's scale add up in int16 before one vpmaddwd: Q4_K 9 multiplies for 256 multiply-adds
// instead of 16, Q5_K 10, Q6_K 12 (llama.cpp's repacked Q4_K kernel works so; it keeps a repacked copy
// of the weights, this packs 8 rows into L2 per call). The sums are the same integers; they reach float
// once a super-block per output instead of in 8 lanes, so an output rounds differently from gg_rows_i8's
// (within the float32 bound of the sum) and a row's last bits depend on whether its call had
// kInterleaveRows rows: --gguf-activations int8 is not batch-invariant (refused with --batch-invariant).
// From this many activation rows; Q6_K's pack costs more a weight row (0.7-1.1x at 16 rows, 1.15-1.4x at
// 64 on Zen 3), Q4_K's and Q5_K's pay off from 16 (Q4_K 1.0-1.25x, 1.3-1.6x at 64)
template <int64_t TYPE>
constexpr int64_t kInterleaveRows = TYPE == kQ6_K ? 32 : 16;

struct IlBlock {  // one K-quant super-block (Q4_K, Q5_K or Q6_K) of 8 weight rows c = 0..7
  __m256i lv[8][8];  // piece p (inputs 32p..), group g (inputs 32p + 4g..): bytes 4c..4c+3 = row c's levels
  __m256i sv[8][2];  // piece p: int16 lanes 2c, 2c+1 = row c's scale of inputs 0-15 [0] and 16-31 [1]
                     // (Q4_K, Q5_K: one scale a piece, [0] only)
  __m256i oc[8];     // int16 lanes 2c, 2c+1 times inputs 16k.. and 16k + 16.. of an activation row's level
                     // sums (bs): Q6_K row c's scales of sub-blocks 2k, 2k + 1 (the offset of 32), Q4_K and
                     // Q5_K row c's min of sub-block k, twice
  __m256 dv;         // lane c: row c's d
  __m256 dminv;      // Q4_K, Q5_K: lane c: row c's dmin
};

// 8 x 8 int32 transpose: r[i] lane j <-> r[j] lane i
inline void transpose8_epi32(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  for (int i = 0; i < 8; i += 4)
    for (int k = 0; k < 2; ++k)
      u[i + k] = _mm256_unpacklo_epi64(t[i + k], t[i + k + 2]), u[i + k + 2] = _mm256_unpackhi_epi64(t[i + k], t[i + k + 2]);
  // u[0..3] hold lanes (0, 4), (2, 6), (1, 5), (3, 7) of rows 0-3, u[4..7] those of rows 4-7
  constexpr int from[4] = {0, 2, 1, 3};
  for (int i = 0; i < 4; ++i) {
    const __m256i lo = u[from[i]], hi = u[from[i] + 4];
    r[i] = _mm256_permute2x128_si256(lo, hi, 0x20), r[i + 4] = _mm256_permute2x128_si256(lo, hi, 0x31);
  }
}

// Super-block sb of the 8 weight rows from `w` (row_bytes apart) into o.
template <int64_t TYPE>
void il_pack(const uint8_t* w, int64_t row_bytes, int64_t sb, IlBlock& o) {
  alignas(32) int16_t sc16[8][2][16], oc16[8][16];
  alignas(32) float d[8], dmin[8] = {};
  __m256i lev[8][8];  // [piece][row]
  for (int c = 0; c < 8; ++c) {
    const uint8_t* b = w + c * row_bytes + sb * kquant_bytes(TYPE);
    if constexpr (TYPE == kQ6_K) {
      d[c] = f16_at(b + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int p = 0; p < 8; ++p) {
        sc16[p][0][2 * c] = sc16[p][0][2 * c + 1] = sc[2 * p];
        sc16[p][1][2 * c] = sc16[p][1][2 * c + 1] = sc[2 * p + 1];
        oc16[p][2 * c] = sc[2 * p], oc16[p][2 * c + 1] = sc[2 * p + 1];
      }
      for (int h = 0; h < 2; ++h) {
        __m256i q[4];
        q6k_levels(b, h, q);
        for (int t = 0; t < 4; ++t) lev[4 * h + t][c] = q[t];
      }
    } else {
      uint64_t sc, mn;
      k4_scales(b + 4, sc, mn);
      d[c] = f16_at(b), dmin[c] = f16_at(b + 2);
      for (int p = 0; p < 8; ++p) {
        sc16[p][0][2 * c] = sc16[p][0][2 * c + 1] = byte_of(sc, p);
        oc16[p][2 * c] = oc16[p][2 * c + 1] = byte_of(mn, p);
      }
      const uint8_t* qs = k4_nibbles<TYPE>(b);
      const __m256i qh = k4_fifth_bits<TYPE>(b);
      for (int j = 0; j < 4; ++j) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
        k4_levels<TYPE == kQ5_K>(bytes, qh, j, lev[2 * j][c], lev[2 * j + 1][c]);
      }
    }
  }
  for (int p = 0; p < 8; ++p) {
    transpose8_epi32(lev[p]);  // lev[p][g] lane c = row c's dword g
    for (int g = 0; g < 8; ++g) _mm256_store_si256(&o.lv[p][g], lev[p][g]);
    for (int h = 0; h < (TYPE == kQ6_K ? 2 : 1); ++h)
      o.sv[p][h] = _mm256_load_si256(reinterpret_cast<const __m256i*>(sc16[p][h]));
    o.oc[p] = _mm256_load_si256(reinterpret_cast<const __m256i*>(oc16[p]));
  }
  o.dv = _mm256_load_ps(d), o.dminv = _mm256_load_ps(dmin);
}

// Activation rows r0 .. r0 + R - 1 times the 8 weight rows of `pk` (all K's super-blocks) -> out[r, 0..7]
template <int64_t TYPE, int R, typename T>
void il_rows(const GgRows& a, const IlBlock* pk, int64_t r0, T* out, int64_t ldo) {
  const int64_t NB = a.K / 256;
  // groups whose int16 sums may add up before a vpmaddwd: a lane of one vpmaddubsw is at most
  // 2 x 15 x 127 (Q4_K, 8 groups: 30480), 2 x 31 x 127 (Q5_K, 4 groups: 31496) or 2 x 63 x 127 (Q6_K,
  // 2 groups: 32004) < 32768
  constexpr int GS = TYPE == kQ6_K ? 2 : TYPE == kQ5_K ? 4 : 8;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < NB; ++sb) {
    const IlBlock& o = pk[sb];
    __m256i is[R];
    for (int r = 0; r < R; ++r) is[r] = _mm256_setzero_si256();
    for (int p = 0; p < 8; ++p) {
#pragma GCC unroll 4
      for (int g0 = 0; g0 < 8; g0 += GS) {
        __m256i t[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) t[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = g0; g < g0 + GS; ++g) {
          const __m256i l = _mm256_load_si256(&o.lv[p][g]);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            int32_t x4;  // inputs 32p + 4g .. + 3 of row r0 + r, broadcast
            std::memcpy(&x4, a.x8 + (r0 + r) * a.l8 + sb * 256 + 32 * p + 4 * g, 4);
            t[r] = _mm256_add_epi16(t[r], _mm256_maddubs_epi16(l, _mm256_set1_epi32(x4)));
            __asm__("" : "+x"(t[r]));  // keeps the chain: gcc would reassociate it into a tree and spill
          }
        }
        const __m256i sv = o.sv[p][TYPE == kQ6_K && g0 >= 4];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(t[r], sv));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      // the levels' sums (bs) times oc: Q6_K's offset of 32 (sc * bs), Q4_K's and Q5_K's mins (m * bs)
      const int16_t* bs = a.bs + (r0 + r) * (a.K / 16) + sb * 16;
      __m256i off = _mm256_setzero_si256();
      for (int k = 0; k < 8; ++k) {
        int32_t b2;
        std::memcpy(&b2, bs + 2 * k, 4);
        off = _mm256_add_epi32(off, _mm256_madd_epi16(o.oc[k], _mm256_set1_epi32(b2)));
      }
      const __m256 d8 = _mm256_set1_ps(a.d8[(r0 + r) * NB + sb]);
      if constexpr (TYPE == kQ6_K) is[r] = _mm256_sub_epi32(is[r], _mm256_slli_epi32(off, 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_mul_ps(o.dv, d8), acc[r]);
      if constexpr (TYPE != kQ6_K) acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(off), _mm256_mul_ps(o.dminv, d8), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float v[8];
    _mm256_store_ps(v, acc[r]);
    for (int c = 0; c < 8; ++c) store(out + (r0 + r) * ldo + c, v[c]);
  }
}

// Output columns [n0, n1) of a K-quant shard for M >= kInterleaveRows<TYPE> int8 rows, 8 weight rows
// at a time; returns the first column not done (fewer than 8 left: gg_rows_i8 takes them).
template <int64_t TYPE, typename T>
int64_t il_shard(const GgRows& a, int64_t M, const uint8_t* w, int64_t row_bytes, T* out, int64_t ldo, int64_t n0,
                 int64_t n1) {
  const int64_t NB = a.K / 256;
  std::vector<IlBlock> pk(NB);  // one tile's pack: K 8192 is 32 x 2.9 KiB, in L2
  int64_t n = n0;
  for (; n + 8 <= n1; n += 8) {
    for (int64_t sb = 0; sb < NB; ++sb) il_pack<TYPE>(w + n * row_bytes, row_bytes, sb, pk[sb]);
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) il_rows<TYPE, 4>(a, pk.data(), r, out + n, ldo);
    switch (M - r) {
      case 3: il_rows<TYPE, 3>(a, pk.data(), r, out + n, ldo); break;
      case 2: il_rows<TYPE, 2>(a, pk.data(), r, out + n, ldo); break;
      case 1: il_rows<TYPE, 1>(a, pk.data(), r, out + n, ldo); break;
    }
  }
  return n;
}
#endif

// The rows of a tile of 32 weight rows, MB activation rows at a time, over K in chunks whose MB
// activation rows (int16) fit in 32 KiB of L1: 8 rows of an 8B's down projection (K 14336) are
// 224 KiB, and one pass over all K read them from L2 once per weight row (half the rate at K 8192
// as at K 2048). One chunk when they fit (a decode row up to K 16384): the same pass as before.
template <int64_t TYPE, int MB, typename T>
void gg_tile(const GgRows& a, const uint8_t* w, int64_t row_bytes, T* out, int64_t ldo, int64_t t0, int64_t t1,
             int64_t last) {
  constexpr int64_t kChunk = 16384 / MB;  // inputs: a multiple of 256 (K-quant blocks) and of 128 (x4 groups)
  const int64_t kend = is_kquant(TYPE) ? a.K : a.K4;
#if ISV_GG_AVX2
  if constexpr (is_kquant(TYPE)) {
    if (a.x8) {
      if (kend <= kChunk) return gg_rows_i8<TYPE, MB, false>(a, w, row_bytes, out, ldo, t0, t1, last, 0, kend, nullptr);
      GgCarry<MB> carry[32];
      for (int64_t k0 = 0; k0 < kend; k0 += kChunk)
        gg_rows_i8<TYPE, MB, true>(a, w, row_bytes, out, ldo, t0, t1, last, k0, std::min(kend, k0 + kChunk), carry);
      return;
    }
  }
#endif
  if (kend <= kChunk) return gg_rows<TYPE, MB, false>(a, w, row_bytes, out, ldo, t0, t1, last, 0, kend, nullptr);
  GgCarry<MB> carry[32];
  for (int64_t k0 = 0; k0 < kend; k0 += kChunk)
    gg_rows<TYPE, MB, true>(a, w, row_bytes, out, ldo, t0, t1, last, k0, std::min(kend, k0 + kChunk), carry);
}

template <int64_t TYPE, typename T>
void gg_shard(const GgRows& rows, int64_t M, const uint8_t* w, int64_t row_bytes, T* out, int64_t ldo, int64_t n0,
              int64_t n1, int64_t last) {
#if ISV_GG_AVX2
  if constexpr (is_kquant(TYPE)) {
    if (rows.amx) n0 = amx_kquant_columns(TYPE, *rows.amx, w, row_bytes, out, ldo, n0, n1);
    if (rows.amx16) n0 = amx_kquant_columns(TYPE, *rows.amx16, w, row_bytes, out, ldo, n0, n1);
    if (rows.x8 && M >= kInterleaveRows<TYPE>) n0 = il_shard<TYPE>(rows, M, w, row_bytes, out, ldo, n0, n1);
  }
#endif
  for (int64_t t0 = n0; t0 < n1; t0 += 32) {  // a tile of weight rows stays in cache for every row group
    const int64_t t1 = std::min(n1, t0 + 32);
    for (int64_t m = 0; m < M;) {
      const int64_t left = M - m;
      T* o = out + m * ldo;
      if (left >= 8) { gg_tile<TYPE, 8>(rows.at(m), w, row_bytes, o, ldo, t0, t1, last); m += 8; }
      else if (left >= 4) { gg_tile<TYPE, 4>(rows.at(m), w, row_bytes, o, ldo, t0, t1, last); m += 4; }
      else if (left >= 2) { gg_tile<TYPE, 2>(rows.at(m), w, row_bytes, o, ldo, t0, t1, last); m += 2; }
      else { gg_tile<TYPE, 1>(rows.at(m), w, row_bytes, o, ldo, t0, t1, last); m += 1; }
    }
  }
}

template <typename T>
void gg_dispatch(int64_t type, const GgRows& rows, int64_t M, const uint8_t* w, int64_t row_bytes, T* out,
                 int64_t ldo, int64_t n0, int64_t n1, int64_t last) {
  switch (type) {
    case kQ4_0: return gg_shard<kQ4_0>(rows, M, w, row_bytes, out, ldo, n0, n1, last);
    case kQ4_1: return gg_shard<kQ4_1>(rows, M, w, row_bytes, out, ldo, n0, n1, last);
    case kQ5_0: return gg_shard<kQ5_0>(rows, M, w, row_bytes, out, ldo, n0, n1, last);
    case kQ5_1: return gg_shard<kQ5_1>(rows, M, w, row_bytes, out, ldo, n0, n1, last);
    case kQ8_0: return gg_shard<kQ8_0>(rows, M, w, row_bytes, out, ldo, n0, n1, last);
    case kQ4_K: return gg_shard<kQ4_K>(rows, M, w, row_bytes, out, ldo, n0, n1, last);
    case kQ5_K: return gg_shard<kQ5_K>(rows, M, w, row_bytes, out, ldo, n0, n1, last);
    case kQ6_K: return gg_shard<kQ6_K>(rows, M, w, row_bytes, out, ldo, n0, n1, last);
  }
}

// One activation row -> int16 levels q = round(x * 32767 / amax) (to nearest even, as nearbyint),
// its scale amax / 32767, and the float32 sum of x over each 32 inputs (K a multiple of 32).
template <typename X>
void gg_quantise_row(const X* xr, int64_t K, int16_t* q, float* dx, float* sx) {
#if defined(__AVX512F__)
  __m512 mx = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(xr + k)));
  const float amax = _mm512_reduce_max_ps(mx);
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = load16(xr + k);
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));  // to nearest even
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm512_cvtepi32_epi16(r));
  }
  for (int64_t b = 0; b < K / 32; ++b)
    sx[b] = _mm512_reduce_add_ps(_mm512_add_ps(load16(xr + 32 * b), load16(xr + 32 * b + 16)));
#elif ISV_GG_AVX2
  __m256 mx = _mm256_setzero_ps();
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t k = 0; k < K; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(load8(xr + k), absmask));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
  for (int64_t k = 0; k < K; k += 16) {  // to nearest even; |level| <= 32767, so the pack never saturates
    const __m256i r0 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xr + k), inv));
    const __m256i r1 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xr + k + 8), inv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(r0, r1), 0xD8));
  }
  for (int64_t b = 0; b < K / 32; ++b)
    sx[b] = reduce_add8(_mm256_add_ps(_mm256_add_ps(load8(xr + 32 * b), load8(xr + 32 * b + 8)),
                                      _mm256_add_ps(load8(xr + 32 * b + 16), load8(xr + 32 * b + 24))));
#else
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(load(xr[k])));
  const float inv = amax > 0.f ? 32767.f / amax : 0.f;
  for (int64_t k = 0; k < K; ++k) q[k] = static_cast<int16_t>(std::nearbyint(load(xr[k]) * inv));
  for (int64_t b = 0; b < K / 32; ++b) {
    float sum = 0.f;
    for (int i = 0; i < 32; ++i) sum += load(xr[b * 32 + i]);
    sx[b] = sum;
  }
#endif
  *dx = amax / 32767.f;
}

// The shards of one weight (meta [S, 4] at mt) checked against K and buf; returns their rows, and
// sets x4 when a shard is a 32-input type (its activations are also laid out in the x4 order).
int64_t gg_check_shards(const int64_t* mt, int64_t S, int64_t K, int64_t K4, int64_t buf_bytes, bool& x4) {
  int64_t total = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t t = mt[4 * s], rows = mt[4 * s + 1], rb = mt[4 * s + 2], off = mt[4 * s + 3];
    const bool known = t == kQ4_0 || t == kQ4_1 || t == kQ5_0 || t == kQ5_1 || t == kQ8_0 || is_kquant(t);
    TORCH_CHECK(known, "gguf_gemm: unsupported ggml type ", t);
    const int64_t want = is_kquant(t) ? K / 256 * kquant_bytes(t) : K4 / 128 * x4_bytes(t);
    TORCH_CHECK(!is_kquant(t) || K % 256 == 0, "gguf_gemm: K-quant blocks need K a multiple of 256, got ", K);
    TORCH_CHECK(rb == want, "gguf_gemm: shard ", s, " has ", rb, " bytes a row, type ", t, " at K ", K, " takes ", want);
    TORCH_CHECK(rows >= 0 && off >= 0 && off + rows * rb <= buf_bytes, "gguf_gemm: shard ", s, " lies outside buf");
    x4 = x4 || !is_kquant(t);
    total += rows;
  }
  return total;
}

#if ISV_GG_AVX2
// Levels q[0, n) (n a multiple of 32) reordered in place: per 32, the 16 at even positions, then the 16 at odd ones.
inline void even_odd(int16_t* q, int64_t n) {
  for (int64_t k = 0; k < n; k += 32) {
    __m256i* p = reinterpret_cast<__m256i*>(q + k);
    const __m256i v0 = _mm256_loadu_si256(p), v1 = _mm256_loadu_si256(p + 1);
    const __m256i e = _mm256_packs_epi32(_mm256_srai_epi32(_mm256_slli_epi32(v0, 16), 16),
                                         _mm256_srai_epi32(_mm256_slli_epi32(v1, 16), 16));
    const __m256i o = _mm256_packs_epi32(_mm256_srai_epi32(v0, 16), _mm256_srai_epi32(v1, 16));
    _mm256_storeu_si256(p, _mm256_permute4x64_epi64(e, 0xD8));
    _mm256_storeu_si256(p + 1, _mm256_permute4x64_epi64(o, 0xD8));
  }
}
#endif

#if ISV_GG_AVX2
inline int32_t sum_i32x8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

// One activation row -> int8 levels per 256 inputs (K a multiple of 256): q = round(x / d8) to nearest
// even, d8 = amax / 127, and the levels' sums per 16 inputs (llama.cpp's quantize_row_q8_K, symmetric).
template <typename X>
void gg_quantise_row_i8(const X* xr, int64_t K, int8_t* q, float* d8, int16_t* bs) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < K / 256; ++b) {
    const X* xb = xr + 256 * b;
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 256; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(load8(xb + i), absmask));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    d8[b] = amax / 127.f;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    for (int i = 0; i < 256; i += 32) {
      __m256i r[4];
      for (int t = 0; t < 4; ++t) r[t] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xb + i + 8 * t), inv));
      // |level| <= 127: the packs never saturate; the two packs interleave the halves, the permute undoes it
      const __m256i p16a = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
      const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 256 * b + i), p8);
      // the sums of inputs i..i+15 and i+16..i+31, from the int16 levels in input order
      const __m256i s16 = _mm256_madd_epi16(_mm256_permute4x64_epi64(p16a, 0xD8), _mm256_set1_epi16(1));
      const __m256i t16 = _mm256_madd_epi16(_mm256_permute4x64_epi64(p16b, 0xD8), _mm256_set1_epi16(1));
      bs[16 * b + i / 16] = static_cast<int16_t>(sum_i32x8(s16));
      bs[16 * b + i / 16 + 1] = static_cast<int16_t>(sum_i32x8(t16));
    }
  }
}
#endif

// The activation rows of one call, quantised once before the weights are read (M x K is tiny next to
// the weights; a prompt chunk's rows are quantised over the pool); every row on its own, so a row's
// levels never depend on the others.
struct GgQuantised {
  std::vector<int16_t> xq, xq4, bs;
  std::vector<float> dx, sx, d8;
  std::vector<int8_t> x8;
  int64_t K, K4, lq, lq4, l8;

  // row m is xc's row src[m] (a gather) where src is given, else its row m; int8: also the int8 rows
  // the K-quant shards then read (K a multiple of 256), their mins included; levels16: the int16 rows
  // (xq, dx, sx), which an int8 call without a 32-input shard never reads
  GgQuantised(const at::Tensor& xc, bool x4, const int64_t* src = nullptr, int64_t M = -1, bool int8 = false,
              bool levels16 = true)
      : K(xc.size(1)), K4((xc.size(1) + 127) / 128 * 128), lq(K + 32), lq4(K4 + 32), l8(K + 64) {
    if (M < 0) M = xc.size(0);
    const int64_t B4 = K4 / 32;
    if (levels16) xq.resize(M * lq), xq4.assign(x4 ? M * lq4 : 0, 0), dx.resize(M), sx.assign(M * B4, 0.f);
    if (int8) x8.resize(M * l8), d8.resize(M * (K / 256)), bs.resize(M * (K / 16));
    const bool f32 = xc.scalar_type() == at::kFloat;
    const float* xf = f32 ? xc.const_data_ptr<float>() : nullptr;
    const uint16_t* xh = f32 ? nullptr : reinterpret_cast<const uint16_t*>(xc.const_data_ptr());
    auto row = [&](int64_t m) {
      const int64_t r = src ? src[m] : m;
#if ISV_GG_AVX2
      if (int8) {
        if (f32) gg_quantise_row_i8(xf + r * K, K, &x8[m * l8], &d8[m * (K / 256)], &bs[m * (K / 16)]);
        else gg_quantise_row_i8(xh + r * K, K, &x8[m * l8], &d8[m * (K / 256)], &bs[m * (K / 16)]);
      }
#endif
      if (!levels16) return;
      int16_t* q = &xq[m * lq];
      if (f32) gg_quantise_row(xf + r * K, K, q, &dx[m], &sx[m * B4]);
      else gg_quantise_row(xh + r * K, K, q, &dx[m], &sx[m * B4]);
      if (x4)  // position p of group g: input 8 * (p / 32) + p % 8 of block 4g + (p % 32) / 8, 8 inputs at a time
        for (int64_t k = 0; k < K; k += 8)
          std::memcpy(&xq4[m * lq4 + k / 128 * 128 + 32 * (k % 32 / 8) + 8 * (k / 32 % 4)], &q[k], 16);
      if constexpr (kXqEvenOdd) {
#if ISV_GG_AVX2
        even_odd(q, K);
        if (x4) even_odd(&xq4[m * lq4], K4);
#endif
      }
    };
    if (M * K < kParallelQuantise) {
      for (int64_t m = 0; m < M; ++m) row(m);
    } else {
      iterserve::parallel_ranges(M, kRanges, [&](int64_t lo, int64_t hi) {
        for (int64_t m = lo; m < hi; ++m) row(m);
      });
    }
  }
  GgRows rows() const {
    return {xq.empty() ? nullptr : xq.data(), xq4.empty() ? nullptr : xq4.data(), dx.empty() ? nullptr : dx.data(),
            sx.empty() ? nullptr : sx.data(), K, K4, lq, lq4,
            l8, x8.empty() ? nullptr : x8.data(), d8.empty() ? nullptr : d8.data(), bs.empty() ? nullptr : bs.data()};
  }
};

// Output columns [lo, hi) of one weight's shards (meta at mt) for M activation rows.
template <typename T>
void gg_columns(const GgRows& rows, int64_t M, const uint8_t* bp, const int64_t* mt, int64_t S, T* out, int64_t ldo,
                int64_t lo, int64_t hi) {
  int64_t first = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t rows_s = mt[4 * s + 1], a = std::max(lo, first), b = std::min(hi, first + rows_s);
    if (a < b) gg_dispatch(mt[4 * s], rows, M, bp + mt[4 * s + 3], mt[4 * s + 2], out + first, ldo, a - first, b - first,
                           rows_s - 1);
    first += rows_s;
  }
}

std::atomic<int64_t> g_amx_calls{0};  // gguf_gemm calls that ran K-quant shards on AMX tiles (gguf_gemm_amx_calls)

void gg_check_x(const at::Tensor& x, const at::Tensor& buf) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be [M, K] float32 or bfloat16");
  TORCH_CHECK(buf.scalar_type() == at::kByte && buf.is_contiguous(), "buf must be contiguous uint8");
  TORCH_CHECK(x.size(1) % 32 == 0 && x.size(1) > 0, "gguf_gemm needs K a multiple of 32");
}

}  // namespace

// x [M, K] float32 or bfloat16; buf uint8 (every shard's rows, see above); meta [S, 4] int64 -> [M, N].
at::Tensor gguf_gemm(const at::Tensor& x, const at::Tensor& buf, const at::Tensor& meta, int64_t N, bool int8,
                     bool amx) {
  gg_check_x(x, buf);
  TORCH_CHECK(!int8 || ISV_GG_AVX2, "gguf_gemm: int8 activations need a build with AVX2 + FMA + F16C");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.dim() == 2 && meta.size(1) == 4 && meta.is_contiguous(),
              "meta must be contiguous [S, 4] int64 (type, rows, bytes per row, offset)");
  const int64_t M = x.size(0), K = x.size(1), S = meta.size(0), K4 = (K + 127) / 128 * 128;
  const int64_t* mt = meta.const_data_ptr<int64_t>();
  bool x4 = false;
  const int64_t total = gg_check_shards(mt, S, K, K4, buf.numel(), x4);
  TORCH_CHECK(total == N, "gguf_gemm: the shards have ", total, " rows, N is ", N);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  bool kq = false;  // int8 rows only where a K-quant shard reads them
  for (int64_t s = 0; s < S; ++s) kq = kq || is_kquant(mt[4 * s]);
  const GgQuantised q(x.contiguous(), x4, nullptr, -1, int8 && kq, !(int8 && kq) || x4);
  GgRows rows = q.rows();
  // K-quant shards on AMX tiles from kAmxMinRows int8 rows (gemm_gguf_amx.cpp), the work split in
  // whole groups of 16 columns, the AMX kernel's unit
  std::unique_ptr<AmxActivations> xa;
  if (amx && int8 && kq && M >= kAmxMinRows && amx_int8_available()) {
    xa = std::make_unique<AmxActivations>(q.x8.data(), q.l8, q.d8.data(), q.bs.data(), M, K);
    g_amx_calls.fetch_add(1, std::memory_order_relaxed);
  }
  // and on int16 rows (the default activations) likewise
  std::unique_ptr<AmxActivations16> xa16;
  if (amx && !int8 && !kXqEvenOdd && kq && M >= kAmxMinRows && amx_int8_available()) {
    xa16 = std::make_unique<AmxActivations16>(q.xq.data(), q.lq, q.dx.data(), q.sx.data(), q.K4 / 32, M, K);
    g_amx_calls.fetch_add(1, std::memory_order_relaxed);
  }
  rows.amx = xa.get();
  rows.amx16 = xa16.get();
  const int64_t unit = xa || xa16 ? 16 : 1;
  const uint8_t* bp = buf.const_data_ptr<uint8_t>();
  auto run = [&](auto* op) {
    iterserve::parallel_ranges((N + unit - 1) / unit, kRanges, [&](int64_t lo, int64_t hi) {
      gg_columns(rows, M, bp, mt, S, op, N, lo * unit, std::min(N, hi * unit));
    });
  };
  if (x.scalar_type() == at::kFloat) run(out.data_ptr<float>());
  else run(reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

// llama.cpp's mul_mat_id: the P activation rows grouped by expert (rows offsets[u] .. offsets[u + 1]
// go through expert experts[u]), each group times its expert's weight, whose shards are meta[e]
// ([E, S, 4]) in buf -> [P, N]. Activation row p is x's row rows[p] where `rows` [P] is given (a
// layer's input gathered per pair while it is quantised), else x's row p. One call for a layer's
// experts: the activations are quantised once and the pool splits (expert, output column) pairs,
// where one gguf_gemm call per expert paid a call, a quantisation and a pool wake-up each (8 experts
// x 32 layers a decode token). Each row's numbers are gguf_gemm's for that expert alone.
at::Tensor gguf_moe_gemm(const at::Tensor& x, const at::Tensor& buf, const at::Tensor& meta, const at::Tensor& experts,
                         const at::Tensor& offsets, int64_t N, const c10::optional<at::Tensor>& rows_in) {
  gg_check_x(x, buf);
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.dim() == 3 && meta.size(2) == 4 && meta.is_contiguous(),
              "meta must be contiguous [E, S, 4] int64 (type, rows, bytes per row, offset)");
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.dim() == 1 && experts.is_contiguous(),
              "experts must be contiguous [U] int64");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.is_contiguous() &&
                  offsets.size(0) == experts.size(0) + 1,
              "offsets must be contiguous [U + 1] int64");
  const int64_t K = x.size(1), E = meta.size(0), S = meta.size(1), U = experts.size(0);
  const int64_t* src = nullptr;
  at::Tensor rows_c;
  if (rows_in.has_value()) {
    rows_c = rows_in->contiguous();
    TORCH_CHECK(rows_c.scalar_type() == at::kLong && rows_c.dim() == 1, "rows must be [P] int64");
    src = rows_c.const_data_ptr<int64_t>();
    for (int64_t p = 0; p < rows_c.size(0); ++p)
      TORCH_CHECK(src[p] >= 0 && src[p] < x.size(0), "gguf_moe_gemm: row ", src[p], " not in 0..", x.size(0) - 1);
  }
  const int64_t P = src ? rows_c.size(0) : x.size(0);
  const int64_t K4 = (K + 127) / 128 * 128;
  const int64_t *mt = meta.const_data_ptr<int64_t>(), *ex = experts.const_data_ptr<int64_t>(),
                *of = offsets.const_data_ptr<int64_t>();
  TORCH_CHECK(U == 0 || (of[0] == 0 && of[U] == P), "gguf_moe_gemm: offsets must run from 0 to the ", P,
              " activation rows");
  bool x4 = false;
  for (int64_t u = 0; u < U; ++u) {
    TORCH_CHECK(ex[u] >= 0 && ex[u] < E, "gguf_moe_gemm: expert ", ex[u], " not in 0..", E - 1);
    TORCH_CHECK(of[u] <= of[u + 1], "gguf_moe_gemm: offsets must not decrease");
    const int64_t total = gg_check_shards(mt + ex[u] * S * 4, S, K, K4, buf.numel(), x4);
    TORCH_CHECK(total == N, "gguf_moe_gemm: expert ", ex[u], "'s shards have ", total, " rows, N is ", N);
  }
  at::Tensor out = at::empty({P, N}, x.options());
  if (P == 0 || N == 0) return out;
  const GgQuantised q(x.contiguous(), x4, src, P);
  const GgRows rows = q.rows();
  const uint8_t* bp = buf.const_data_ptr<uint8_t>();
  auto run = [&](auto* op) {
    // ranges of the U x N (expert, column) pairs, expert-major: a range may span experts
    iterserve::parallel_ranges(U * N, kRanges, [&](int64_t lo, int64_t hi) {
      for (int64_t u = lo / N; u < U && u * N < hi; ++u) {
        const int64_t a = std::max(lo, u * N) - u * N, b = std::min(hi, (u + 1) * N) - u * N;
        if (a < b && of[u + 1] > of[u])
          gg_columns(rows.at(of[u]), of[u + 1] - of[u], bp, mt + ex[u] * S * 4, S, op + of[u] * N, N, a, b);
      }
    });
  };
  if (x.scalar_type() == at::kFloat) run(out.data_ptr<float>());
  else run(reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

// int8 activations for gguf_gemm's K-quant shards (int8=true) in this build
bool gguf_gemm_int8_supported() { return ISV_GG_AVX2; }

// which gguf_gemm path this build runs: "avx512-vnni", "avx2" or "scalar"
std::string gguf_gemm_isa() { return ISV_GG_AVX512 ? "avx512-vnni" : ISV_GG_AVX2 ? "avx2" : "scalar"; }

// gguf_gemm(int8=True, amx=True) runs K-quant shards of kAmxMinRows+ rows on AMX-INT8 tiles here
bool gguf_gemm_amx_available() { return ISV_GG_AVX2 && amx_int8_available(); }

// how many gguf_gemm calls so far ran their K-quant shards on AMX tiles (tests: the path ran)
int64_t gguf_gemm_amx_calls() { return g_amx_calls.load(std::memory_order_relaxed); }

}  // namespace iterserve

// gguf_gemm's K-quant shards (Q4_K, Q5_K, Q6_K) on AMX-INT8 tiles, on int8 activations and on the
// default int16 ones: steps of 16 rows and more (a 16-sequence decode step, speculative verification,
// prompt chunks) from the file's own blocks.
//
// Why: at 16 rows the interleaved AVX2 kernel (gemm_gguf.cpp's il_rows) multiplied ~120 GMAC/s on the
// 2-core AMX Xeon, a 1B's 16-row step 6.6x its compute bound; one tdpbusd multiplies a 16 x 16 x 64 int8
// tile product (16,384 multiply-adds) where a vpdpbusd does 64.
//
// How. C = A . B with A the weights (16 weight rows x 64 inputs), B the activations (s8, in the VNNI
// layout, laid out once a call: AmxActivations) and C int32, 16 weight rows x 16 activation rows. A
// K-quant's scale changes every sub-block (32 inputs for Q4_K / Q5_K, 16 for Q6_K), and a tile product
// sums 64 inputs, so the scales are folded into the weights as they are unpacked: each level times its
// sub-block's integer scale (sc * q: Q4_K <= 945, Q5_K <= 1953, Q6_K in [-8064, 8001]: int16), split
// into a high and a low byte plane (vpmaddubsw on the even and the odd levels, then a byte blend;
// Q4_K by lookup instead: vpermb in the line's 32 products, Q4kLookup).
// Two tile products a line (high plane: tdpbusd, Q6_K's signed tdpbssd; low plane: tdpbusd) add up a
// whole super-block in two accumulators, and 256 * high + low is the sum over the super-block of the
// sub-block products times their scales, exactly (|sum| < 2^28). The mins (Q4_K, Q5_K) and Q6_K's
// offset of 32 come off as integer sums of the activations' level sums (bs) times the sub-block mins or
// scales (vpdpwssd), and a super-block reaches float once per output: acc += float(is) * (d * d8),
// acc -= float(off) * (dmin * d8). Those are il_rows's integers and float operations in il_rows's
// order, so an output is il_rows's bit for bit (tests/test_kquant.py), and a Q4_K / Q5_K call of >=
// kAmxMinRows rows gives the numbers it gave without AMX; Q6_K's between 16 and 31 rows, where
// gg_rows_i8 ran (8 float lanes a row), round in il_rows's order instead.
//
// The weights: for 16 weight rows, a super-block at a time, each row's scaled levels are unpacked into
// 4 lines of 64 bytes in each plane (8 KiB a super-block), the next super-block while the tile unit
// multiplies this one, once for every tile of activation rows. The 16 rows' scales, mins, d and dmin
// are read together (AmxBlock::headers: gathers), the levels row by row. Up to 64 activation rows
// (one pass of the accumulators) two such buffers take turns and stay in L1 with the activation
// tiles (4 KiB a super-block); more rows keep a row group's every super-block for the later passes.
//
// int16 activations (AmxActivations16: gguf_gemm's levels, one scale a row; the down projections under
// int8-except-down, every K-quant projection under int16). Each level is split into a signed high and
// an unsigned low byte, 256 * xh + xl, and a line takes four tile products against the two weight
// planes (tdpbusd / tdpbssd, tdpbuud / tdpbsud) into three accumulators: high . high (x 65536), the two
// crossed ones (x 256) and low . low, each below 2^24, so float32 holds each exactly and the
// super-block's sum is rounded twice (65536 * hh + (256 * mid + ll)), where the int16 vector loop
// rounds one sum per lane. Q6_K's levels are centred as they are folded ((q - 32) * sc), so no offset
// is left; Q4_K's / Q5_K's mins are the int16 path's, dmin * m times the float sum of x over each
// sub-block. Within the int16 path's bound of float64, not its bits (tests/test_kquant.py).
//
// Measured on the 2-core AMX Xeon (docs/profile.md). The first form, a tile product a sub-block,
// each stored and multiplied by its scale in int32 (vpmulld), then added up: 1.8-2.5x the interleaved
// kernel at 16-64 rows for Q4_K, 1.2-2x for Q6_K; bound by the tile stores and the scaling, ~50 cycles
// per 8,192 multiply-adds, and a fifth of its time waited on the cache misses of tile loads from L2.
// This form, against that one (benchmarks/ab_gguf_gemm.py, weights cold): Q4_K 1.14-1.29x at 16 rows
// and 1.34-1.47x at 64, Q6_K 1.33x at 16 rows and 1.79x at 64 (sub-blocks of 16 had taken twice the
// tile products and scaling a weight). On int16 activations, against gemm_gguf.cpp's int16 loop
// (vpdpwssd): 2.2-2.3x at 16 rows, 3.1-4.0x at 32-64 (a 1B's down projections and gate/up), within
// ~15 % of the int8 form at 16 rows. Then (weights cold, the 1B's shapes): the unpacked super-blocks
// in two buffers instead of one a super-block of K (whose 72-290 KiB had every plane store miss L1:
// 1.3x warm), the headers gathered and Q4_K by lookup (~45 instructions a row's super-block where
// ~108 were: 1.1x more): Q4_K 1.26-1.36x at 16 rows, 1.12x at 64; Q6_K 1.11x; int16 1.06-1.12x. At 16
// rows a tile product takes ~5 ns (timed alone: chains of them are no slower than independent ones),
// a super-block's eight ~40 ns, a row group's unpacking of it ~250 ns. The next super-block is
// unpacked a quarter of its rows after each line's products, where all of it had followed the first
// line's (the tile unit then idled behind the unpacking): cold calls, int8 16 rows 1.01-1.08x, the Q6_K
// head 1.06-1.08x, int16 1.01-1.09x at 16-64 rows, int8 at 32-128 rows level, the same bits; the 1B's
// 16-row step 1.006-1.025x (medians of 10 runs in turns, a quiet and a loaded hour; benchmarks/ab_step.py).

#include "gemm_gguf_amx.h"

#include "gguf_blocks.h"
#include "kernel_common.h"
#include "lanes.h"
#include "work_pool.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__linux__)
#define ISV_AMX_INT8 1
#include <immintrin.h>
#else
#define ISV_AMX_INT8 0
#endif

namespace iterserve {
namespace gguf {
namespace {

// n elements, 64-byte aligned, not initialised (AmxActivations writes every element it reads)
template <typename E>
std::unique_ptr<E[], void (*)(void*)> aligned_array(int64_t n) {
  void* p = std::aligned_alloc(64, std::max<int64_t>(64, (n * static_cast<int64_t>(sizeof(E)) + 63) / 64 * 64));
  TORCH_CHECK(p != nullptr, "gguf_gemm: out of memory for the AMX activation tiles");
  return {static_cast<E*>(p), std::free};
}

// fn(u) for each of `units` pieces of the layout, over the pool where the rows' elements are many (as
// GgQuantised quantises them)
template <typename F>
void each_unit(int64_t units, int64_t elements, const F& fn) {
  if (elements < kParallelQuantise) {
    for (int64_t u = 0; u < units; ++u) fn(u);
    return;
  }
  iterserve::parallel_ranges(units, kRanges, [&](int64_t lo, int64_t hi) {
    for (int64_t u = lo; u < hi; ++u) fn(u);
  });
}

#if ISV_AMX_INT8
// out[j]'s lane i = in[i]'s lane j, for 16 x 16 dwords (32-, then 64-bit unpacks within the 128-bit
// lanes, then two shuffles of the lanes)
inline void transpose16_epi32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(u[8 * i + j], u[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(u[8 * i + j], u[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// One block of 64 inputs of a tile's 16 rows (rows[i]: row i's 64 bytes, zero past M) into the tile's
// VNNI form: line j (inputs 4j .. 4j + 3 of the block) holds each row's 4 bytes, row by row: a
// transpose of the 16 x 16 dwords. The 1,024 bytes are contiguous in the layout.
inline void vnni_block(__m512i rows[16], void* dst) {
  transpose16_epi32(rows);
  for (int j = 0; j < 16; ++j) _mm512_store_si512(static_cast<uint8_t*>(dst) + 64 * j, rows[j]);
}
#endif

}  // namespace

// The VNNI layouts are built a block of 64 inputs of 16 rows at a time (vnni_block), over the pool
// where the call is large; the per-row scales and sums in plain loops (a few per 256 inputs). The
// scalar form, 4 bytes a row at a time, took ~130 us of a 16-row call at K 8192 on int16 (its one tile
// on one thread), ~2 ms of the 1B's 16-row step.
AmxActivations::AmxActivations(const int8_t* x8, int64_t l8, const float* d8_in, const int16_t* bs_in, int64_t M_,
                               int64_t K_)
    : M(M_), K(K_), tiles((M_ + 15) / 16), x(aligned_array<int8_t>(tiles * K_ * 16)),
      d8(aligned_array<float>(tiles * (K_ / 256) * 16)), bs(aligned_array<int16_t>(tiles * (K_ / 256) * 256)),
      bs32(aligned_array<int16_t>(tiles * (K_ / 256) * 128)) {
#if ISV_AMX_INT8
  const int64_t NB = K / 256, NL = K / 64;
  if (M % 16) {  // the last tile's rows past M: zeros (every other element is written below)
    const int64_t t = tiles - 1;
    std::memset(d8.get() + t * NB * 16, 0, NB * 16 * sizeof(float));
    std::memset(bs.get() + t * NB * 256, 0, NB * 256 * sizeof(int16_t));
    std::memset(bs32.get() + t * NB * 128, 0, NB * 128 * sizeof(int16_t));
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t t = m / 16, r = m % 16;
    float* dt = d8.get() + t * NB * 16;
    int16_t* bt = bs.get() + t * NB * 256;
    int16_t* b32 = bs32.get() + t * NB * 128;
    for (int64_t sb = 0; sb < NB; ++sb) {
      dt[sb * 16 + r] = d8_in[m * NB + sb];
      const int16_t* b = bs_in + m * (K / 16) + sb * 16;
      for (int p = 0; p < 8; ++p) {
        bt[((sb * 8 + p) * 16 + r) * 2] = b[2 * p];
        bt[((sb * 8 + p) * 16 + r) * 2 + 1] = b[2 * p + 1];
      }
      for (int p = 0; p < 4; ++p) {  // |sum over 32| <= 32 * 127: an int16
        b32[((sb * 4 + p) * 16 + r) * 2] = static_cast<int16_t>(b[4 * p] + b[4 * p + 1]);
        b32[((sb * 4 + p) * 16 + r) * 2 + 1] = static_cast<int16_t>(b[4 * p + 2] + b[4 * p + 3]);
      }
    }
  }
  each_unit(tiles * NL, M * K, [&](int64_t u) {
    const int64_t t = u / NL, b = u % NL;
    __m512i rows[16];
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t m = 16 * t + i;
      rows[i] = m < M ? _mm512_loadu_si512(x8 + m * l8 + 64 * b) : _mm512_setzero_si512();
    }
    vnni_block(rows, x.get() + t * K * 16 + b * 1024);
  });
#else
  (void)x8, (void)l8, (void)d8_in, (void)bs_in;
  TORCH_CHECK(false, "gguf_gemm: AMX activation tiles in a build without AMX-INT8");
#endif
}

AmxActivations16::AmxActivations16(const int16_t* xq, int64_t lq, const float* dx_in, const float* sx_in, int64_t ls,
                                   int64_t M_, int64_t K_)
    : M(M_), K(K_), tiles((M_ + 15) / 16), xh(aligned_array<int8_t>(tiles * K_ * 16)),
      xl(aligned_array<uint8_t>(tiles * K_ * 16)), dx(aligned_array<float>(tiles * 16)),
      sx(aligned_array<float>(tiles * (K_ / 32) * 16)) {
#if ISV_AMX_INT8
  const int64_t NS = K / 32, NL = K / 64;
  if (M % 16) {  // the last tile's rows past M: zeros (every other element is written below)
    const int64_t t = tiles - 1;
    std::memset(dx.get() + t * 16, 0, 16 * sizeof(float));
    std::memset(sx.get() + t * NS * 16, 0, NS * 16 * sizeof(float));
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t t = m / 16, r = m % 16;
    dx[t * 16 + r] = dx_in[m];
    float* st = sx.get() + t * NS * 16;
    for (int64_t j = 0; j < NS; ++j) st[j * 16 + r] = sx_in[m * ls + j];
  }
  // each level q as 256 * xh + xl: xh = q >> 8 (arithmetic), xl = q & 255, a byte plane each
  each_unit(tiles * NL, M * K, [&](int64_t u) {
    const int64_t t = u / NL, b = u % NL;
    __m512i hi[16], lo[16];
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t m = 16 * t + i;
      if (m >= M) {
        hi[i] = lo[i] = _mm512_setzero_si512();
        continue;
      }
      const __m512i v0 = _mm512_loadu_si512(xq + m * lq + 64 * b), v1 = _mm512_loadu_si512(xq + m * lq + 64 * b + 32);
      hi[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(v0, 8))),
                                 _mm512_cvtepi16_epi8(_mm512_srai_epi16(v1, 8)), 1);
      lo[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(v0)), _mm512_cvtepi16_epi8(v1), 1);
    }
    vnni_block(hi, xh.get() + t * K * 16 + b * 1024);
    vnni_block(lo, xl.get() + t * K * 16 + b * 1024);
  });
#else
  (void)xq, (void)lq, (void)dx_in, (void)sx_in, (void)ls;
  TORCH_CHECK(false, "gguf_gemm: AMX activation tiles in a build without AMX-INT8");
#endif
}

#if ISV_AMX_INT8
namespace {

// Tile registers: 0 / 1 the int32 products of the weights' high and low byte planes (16 weight rows x
// 16 activation rows), then 2-4 and 5-7 the high plane, the low plane (A, 16 rows x 64 inputs) and the
// activations (B, 16 x 4 x 16 rows) of 64 inputs, two such in turn.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  AmxConfig() {
    for (int c = 0; c < 8; ++c) colsb[c] = 64, rows[c] = 16;
  }
};

// One line (64 inputs) of both planes into the products; the high plane of Q6_K is signed (tdpbssd),
// Q4_K's and Q5_K's unsigned. One macro per tile set: gcc's tile intrinsics paste their register
// number into the assembly, so it must be a literal.
#define ISV_AMX_LINE(NAME, H, L, B)                                                              \
  template <bool SIGNED_HI>                                                                      \
  inline void NAME(const uint8_t* hi, const uint8_t* lo, const int8_t* b) {                      \
    _tile_loadd(H, hi, 64);                                                                      \
    _tile_loadd(L, lo, 64);                                                                      \
    _tile_loadd(B, b, 64);                                                                       \
    if constexpr (SIGNED_HI) _tile_dpbssd(0, H, B); else _tile_dpbusd(0, H, B);                  \
    _tile_dpbusd(1, L, B);                                                                       \
  }
ISV_AMX_LINE(amx_line_a, 2, 3, 4)
ISV_AMX_LINE(amx_line_b, 5, 6, 7)
#undef ISV_AMX_LINE

// int16 activations (256 * xh + xl: xh signed, xl unsigned) against both weight planes: four tile
// products a line into three accumulators, 0: hi . xh (x 65536), 1: hi . xl + lo . xh (x 256), 2: lo . xl.
// Tiles 3 / 4 the weight planes, 5 / 6 the activation planes.
template <bool SIGNED_HI>
inline void amx16_line(const uint8_t* hi, const uint8_t* lo, const int8_t* xh, const uint8_t* xl) {
  _tile_loadd(3, hi, 64);
  _tile_loadd(4, lo, 64);
  _tile_loadd(5, xh, 64);
  _tile_loadd(6, xl, 64);
  if constexpr (SIGNED_HI) {
    _tile_dpbssd(0, 3, 5);
    _tile_dpbsud(1, 3, 6);
  } else {
    _tile_dpbusd(0, 3, 5);
    _tile_dpbuud(1, 3, 6);
  }
  _tile_dpbusd(1, 4, 5);
  _tile_dpbuud(2, 4, 6);
}

// Where each byte of a line takes its sub-block scale from, for vpshufb within 128-bit lanes over the
// scales as loaded (Q4_K / Q5_K: the 8 scale bytes in every 8; Q6_K: the 16 in every 16): an even byte
// its sub-block's scale, an odd byte zero (0x80), so vpmaddubsw multiplies the even levels alone, and
// the same shifted up a byte the odd ones.
template <int64_t TYPE>
struct ScaleIndex {
  alignas(64) uint8_t idx[4][64] = {};
  constexpr ScaleIndex() {
    for (int g = 0; g < 4; ++g)
      for (int i = 0; i < 64; ++i)
        idx[g][i] = i % 2 ? 0x80 : static_cast<uint8_t>(TYPE == kQ6_K ? 4 * g + i / 16 : 2 * g + i / 32);
  }
};
template <int64_t TYPE>
inline constexpr ScaleIndex<TYPE> kScaleIndex{};  // built by the compiler: no guarded static in the loop

// Q4_K's fold by lookup: a line holds two sub-blocks (2g: inputs 0-31, the low nibbles; 2g + 1: 32-63,
// the high ones) of 16 levels each, so its 32 products sc * q fit one register of words, word 2q + s
// for sub-block 2g + s (vpmaddubsw of `iota` against the two scales), and each plane is one vpermb of
// it: the low byte of word 2q + s is byte 4q + 2s, the high byte the next. The index comes from the
// nibbles by one rotate a dword (the low half's bits 0-3 and the high half's bits 4-7 both to bits
// 2-5) and one vpternlogd ((rot & 0x3c) | 2s, | 1 for the high plane).
struct Q4kLookup {
  alignas(64) uint8_t iota[64] = {};  // word w: level w / 2 against the first scale (w even) or the second
  alignas(64) uint32_t rot[16] = {};  // left by 2 (low half), by 30 (high half)
  alignas(64) uint8_t lo_or[64] = {}, hi_or[64] = {};
  constexpr Q4kLookup() {
    for (int w = 0; w < 32; ++w) iota[2 * w + (w % 2)] = static_cast<uint8_t>(w / 2);
    for (int i = 0; i < 16; ++i) rot[i] = i < 8 ? 2 : 30;
    for (int i = 0; i < 64; ++i) lo_or[i] = i < 32 ? 0 : 2, hi_or[i] = static_cast<uint8_t>(lo_or[i] | 1);
  }
};
inline constexpr Q4kLookup kQ4kLookup{};

// vpshufb controls that turn each dword of 4 bytes (b0 b1 b2 b3) into two int16: (b0, b1) or (b2, b3),
// zero-extended (`zext`) or placed in the words' high bytes for an arithmetic shift (`high`)
struct PairShuffle {
  alignas(64) uint8_t zext[2][64] = {}, high[2][64] = {};
  constexpr PairShuffle() {
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 64; ++i) {
        const auto src = static_cast<uint8_t>(i % 16 / 4 * 4 + 2 * h + i % 4 / 2);  // within the 128-bit lane
        zext[h][i] = i % 2 ? 0x80 : src;
        high[h][i] = i % 2 ? src : 0x80;
      }
  }
};
inline constexpr PairShuffle kPairShuffle{};
#ifdef __AVX512VBMI__
constexpr bool kVbmi = true;  // every AMX Xeon so far has it; without it Q4_K folds as the others do
#else
constexpr bool kVbmi = false;
#endif

// One super-block of 16 weight rows, unpacked: each level times its sub-block's integer scale (Q4_K /
// Q5_K sc * q <= 63 * 31; Q6_K sc * q in [-128 * 63, 127 * 63]: int16), split into a high byte plane
// (hi: Q6_K signed) and a low one (lo: unsigned), lines of 64 inputs in input order, so that a tile
// product sums a whole line (four of them a super-block) and 256 * hi + lo is exactly what the
// sub-block products times their scales added up to; and the int16 pairs that multiply the
// activations' level-sum pairs (mp[row][p], vpdpwssd's: Q4_K / Q5_K the mins of sub-blocks 2p and
// 2p + 1 against the sums over them, Q6_K the scales of sub-blocks 2p and 2p + 1 against the sums
// over those 16 inputs), d and dmin.
//
// I16 (int16 activations, AmxActivations16): Q6_K's levels are centred first, (q - 32) * sc in
// [-4064, 4096], so no offset is left to take off, and Q4_K's / Q5_K's mins are kept as floats,
// mf[row][j] = dmin * m_j, for the float sums of x (gg_rows's mins).
template <int64_t TYPE, bool I16 = false>
struct AmxBlock {
  static constexpr int NP = TYPE == kQ6_K ? 8 : 4;
  alignas(64) uint8_t hi[4][16][64];
  alignas(64) uint8_t lo[4][16][64];
  alignas(64) int32_t mp[NP][16];   // pair p of row f (vpdpwssd's)
  alignas(64) float mf[8][16];      // I16: dmin * m_j of row f
  alignas(64) uint32_t pair[4][16]; // Q4_K / Q5_K: line g's two scales as a word, sc_2g | sc_2g+1 << 8, twice
  alignas(64) float d[16], dmin[16];

  // The 16 rows' scales, mins, d and dmin of their super-blocks at b0 + f * row_bytes, all rows at
  // once (gathers): per row in scalar code they were half the unpacking's instructions.
  void headers(const uint8_t* b0, int64_t row_bytes) {
    const __m512i at = _mm512_mullo_epi32(_mm512_set1_epi32(static_cast<int>(row_bytes)),
                                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const auto words = [](__m512i v, __m512i shuffle) { return _mm512_shuffle_epi8(v, shuffle); };
    if constexpr (TYPE == kQ6_K) {
      // d is the block's last 2 bytes: the dword ending with it (a dword at 208 would read past a
      // tensor's last block, maybe past its mapping)
      const __m512i dd = _mm512_i32gather_epi32(at, b0 + 206, 1);
      _mm512_store_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16))));
      _mm512_store_ps(dmin, _mm512_setzero_ps());
      if constexpr (!I16) {  // int16 folds the offset into the levels
        // pairs (2p, 2p + 1) of the 16 int8 scales at 192, each sign-extended to int16: the byte into a
        // word's high byte, then an arithmetic shift
        for (int k = 0; k < 4; ++k) {
          const __m512i u = _mm512_i32gather_epi32(at, b0 + 192 + 4 * k, 1);
          _mm512_store_si512(mp[2 * k], _mm512_srai_epi16(words(u, _mm512_load_si512(kPairShuffle.high[0])), 8));
          _mm512_store_si512(mp[2 * k + 1], _mm512_srai_epi16(words(u, _mm512_load_si512(kPairShuffle.high[1])), 8));
        }
      }
    } else {
      const __m512i dd = _mm512_i32gather_epi32(at, b0, 1);
      const __m512 dm = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
      _mm512_store_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd)));
      _mm512_store_ps(dmin, dm);
      // k4_scales on 16 rows: sub-blocks 0-3 in u0's / u1's low 6 bits, 4-7 in u2's nibbles and the
      // top 2 bits of u0 / u1
      const __m512i u0 = _mm512_i32gather_epi32(at, b0 + 4, 1), u1 = _mm512_i32gather_epi32(at, b0 + 8, 1),
                    u2 = _mm512_i32gather_epi32(at, b0 + 12, 1);
      const __m512i k1 = _mm512_set1_epi32(0x3f3f3f3f), k2 = _mm512_set1_epi32(0x0f0f0f0f), k3 = _mm512_set1_epi32(0x03030303);
      const __m512i sc[2] = {_mm512_and_si512(u0, k1),
                             _mm512_or_si512(_mm512_and_si512(u2, k2), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), k3), 4))};
      const __m512i mn[2] = {_mm512_and_si512(u1, k1),
                             _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), k2), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), k3), 4))};
      const __m512i low16 = _mm512_set1_epi32(0xFFFF);
      for (int h = 0; h < 2; ++h) {
        const __m512i a = _mm512_and_si512(sc[h], low16), b = _mm512_srli_epi32(sc[h], 16);
        _mm512_store_si512(pair[2 * h], _mm512_or_si512(a, _mm512_slli_epi32(a, 16)));
        _mm512_store_si512(pair[2 * h + 1], _mm512_or_si512(b, _mm512_slli_epi32(b, 16)));
        if constexpr (I16) {
          for (int j = 0; j < 4; ++j)
            _mm512_store_ps(mf[4 * h + j], _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(mn[h], 8 * j), _mm512_set1_epi32(0xFF)))));
        } else {  // pairs (m_2p, m_2p+1) as int16: bytes 0, 1 (2, 3) into the two words' low bytes
          _mm512_store_si512(mp[2 * h], words(mn[h], _mm512_load_si512(kPairShuffle.zext[0])));
          _mm512_store_si512(mp[2 * h + 1], words(mn[h], _mm512_load_si512(kPairShuffle.zext[1])));
        }
      }
    }
  }

  // line g of row f from its 64 levels q (u8, input order) and the scales sv as ScaleIndex reads them
  void fold(int f, int g, __m512i q, __m512i sv) {
    constexpr __mmask64 kOdd = 0xAAAAAAAAAAAAAAAAull;
    const __m512i se = _mm512_shuffle_epi8(sv, _mm512_load_si512(kScaleIndex<TYPE>.idx[g]));
    __m512i e = _mm512_maddubs_epi16(q, se);                          // even inputs' sc * q
    __m512i o = _mm512_maddubs_epi16(q, _mm512_slli_epi16(se, 8));    // odd inputs'
    if constexpr (I16 && TYPE == kQ6_K) {  // - 32 * sc: the levels centred
      const __m512i sc32 = _mm512_slli_epi16(_mm512_srai_epi16(_mm512_slli_epi16(se, 8), 8), 5);
      e = _mm512_sub_epi16(e, sc32), o = _mm512_sub_epi16(o, sc32);
    }
    _mm512_store_si512(lo[g][f], _mm512_mask_blend_epi8(kOdd, e, _mm512_slli_epi16(o, 8)));
    _mm512_store_si512(hi[g][f], _mm512_mask_blend_epi8(kOdd, _mm512_srli_epi16(e, 8), o));
  }

  // Q4_K's line g of row f from its 32 bytes of nibbles qs: the same planes as fold's, by lookup
  // (Q4kLookup) in the products of the line's two scales
  void fold_q4k([[maybe_unused]] int f, [[maybe_unused]] int g, [[maybe_unused]] const uint8_t* qs) {
#ifdef __AVX512VBMI__
    const __m512i table = _mm512_maddubs_epi16(_mm512_load_si512(kQ4kLookup.iota), _mm512_set1_epi32(static_cast<int>(pair[g][f])));
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)));
    const __m512i r = _mm512_rolv_epi32(v, _mm512_load_si512(kQ4kLookup.rot));
    const __m512i m = _mm512_set1_epi8(0x3C);
    constexpr int kAndOr = 0xEA;  // (a & b) | c
    _mm512_store_si512(lo[g][f], _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(r, m, _mm512_load_si512(kQ4kLookup.lo_or), kAndOr), table));
    _mm512_store_si512(hi[g][f], _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(r, m, _mm512_load_si512(kQ4kLookup.hi_or), kAndOr), table));
#endif
  }

  // row f's levels from its super-block's bytes b (headers() read its scales)
  void unpack(int f, const uint8_t* b) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    if constexpr (TYPE == kQ6_K) {
      const __m512i sv = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));  // 16 int8 scales
      const __m512i m30 = _mm512_set1_epi8(0x30);
      // the 16-bit shifts of the high bits: gemm_gguf.cpp's q6k_levels takes them << 4 and << 2 for
      // its q[0] | q[1], as they are and >> 2 for q[2] | q[3]
      const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
      const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
      for (int h = 0; h < 2; ++h) {
        const __m512i l = _mm512_loadu_si512(b + 64 * h);
        const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
        fold(f, 2 * h, _mm512_or_si512(_mm512_and_si512(l, low4), _mm512_and_si512(_mm512_sllv_epi16(hb, up), m30)), sv);
        fold(f, 2 * h + 1, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low4),
                                           _mm512_and_si512(_mm512_srlv_epi16(hb, down), m30)), sv);
      }
    } else if constexpr (TYPE == kQ4_K && kVbmi) {
      for (int g = 0; g < 4; ++g) fold_q4k(f, g, b + 16 + 32 * g);
    } else {
      // the 8 scales as k4_scales gives them (pair[g] holds sub-blocks 2g, 2g + 1 in its low 16 bits)
      const __m512i sv = _mm512_set1_epi64(static_cast<int64_t>(
          (pair[0][f] & 0xFFFF) | (pair[1][f] & 0xFFFF) << 16 | static_cast<uint64_t>((pair[2][f] & 0xFFFF) | (pair[3][f] & 0xFFFF) << 16) << 32));
      // bytes 32g ..: sub-block 2g in the low nibbles, 2g + 1 in the high ones; a line is the 32 bytes
      // twice, the upper half shifted down by 4
      const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
      const uint8_t* qs = b + (TYPE == kQ5_K ? 48 : 16);
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * g)));
        __m512i q = _mm512_and_si512(_mm512_srlv_epi16(v, shift), low4);
        if constexpr (TYPE == kQ5_K) {  // bit 4 of sub-block s's input i: bit s of qh[i]
          const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
          const __m512i t = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (2 * g))),
                                               _mm256_set1_epi8(static_cast<char>(1 << (2 * g + 1))), 1);
          q = _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(qh, t), q, _mm512_set1_epi8(0x10));
        }
        fold(f, g, q, sv);
      }
    }
  }
};

template <int64_t TYPE, typename A, typename T>
int64_t amx_columns(const A& a, const uint8_t* w, int64_t row_bytes, T* out, int64_t ldo, int64_t n0, int64_t n1) {
  constexpr bool I16 = std::is_same_v<A, AmxActivations16>;
  using B = AmxBlock<TYPE, I16>;
  constexpr int64_t BYTES = kquant_bytes(TYPE);
  constexpr int kBlockTiles = 4;  // activation tiles a pass of the accumulators holds
  constexpr int64_t kAhead = 3;   // super-blocks between a row's request into L2 and its unpacking
  const int64_t NB = a.K / 256, nend = n0 + (n1 - n0) / 16 * 16;
  if (nend == n0) return n0;
  thread_local std::vector<B> blocks;  // one group's super-blocks, kept between calls (its pages fault in once)
  if (static_cast<int64_t>(blocks.size()) < NB) blocks.resize(NB);
  B* blk = blocks.data();
  // super-block sb's buffer: where one pass of the accumulators (<= kBlockTiles activation tiles)
  // reads each super-block once, two buffers in turn, which stay in L1 where NB of them (9 KiB each)
  // would not; more passes read each again, so every one is kept
  const bool two_buffers = a.tiles <= kBlockTiles;
  auto buffer = [&](int64_t sb) -> B& { return blk[two_buffers ? sb & 1 : sb]; };
  const AmxConfig cfg;
  _tile_loadconfig(&cfg);
  alignas(64) int32_t ch[16][16], cm[16][16], cl[16][16];
  alignas(64) float acc[kBlockTiles][16][16];
  for (int64_t n = n0; n < nend; n += 16) {
    const uint8_t* wg = w + n * row_bytes;
    const uint8_t* wend = w + nend * row_bytes;
    // super-block sb of the group's 16 rows, unpacked; each row asks for its bytes kAhead super-blocks
    // on, into L2: asked into L1 (2 ahead; 1 and 4 were ~5 % slower) the reads waited more than they
    // overlapped the work (a cold gate/up call 1.30 ms where its work alone takes 0.97 and its bytes
    // 0.74). Into L2, 2-6 ahead timed: 16-row gate/up 1.04-1.11x, the head 1.04-1.09x, K 8192 level to
    // 0.96x; 3 taken, the 1B's 16-row step 64.7 -> 60.6 ms (medians of 7 in turns; docs/profile.md)
    auto unpack = [&](int64_t sb, int f0 = 0, int f1 = 16) {
      B& bk = buffer(sb);
      if (f0 == 0) bk.headers(wg + sb * BYTES, row_bytes);
      for (int f = f0; f < f1; ++f) {
        const uint8_t* src = wg + f * row_bytes + sb * BYTES;
        // the same row's super-block kAhead on, or past its end the next group's row f's
        const uint8_t* next = sb + kAhead < NB ? src + kAhead * BYTES : wg + (16 + f) * row_bytes + (sb + kAhead - NB) * BYTES;
        if (next + BYTES <= wend)
          for (int64_t l = 0; l < BYTES + 63; l += 64) _mm_prefetch(reinterpret_cast<const char*>(next + l), _MM_HINT_T1);
        bk.unpack(f, src);
      }
    };
    for (int64_t t0 = 0; t0 < a.tiles; t0 += kBlockTiles) {
      const int nt = static_cast<int>(std::min<int64_t>(kBlockTiles, a.tiles - t0));
      std::memset(acc, 0, sizeof(acc[0]) * nt);
      if (t0 == 0) unpack(0);
      for (int64_t sb = 0; sb < NB; ++sb) {
        const B& wt = buffer(sb);
        for (int t = 0; t < nt; ++t) {
          if constexpr (I16) {
            const int64_t at = (t0 + t) * a.K * 16 + sb * 256 * 16;  // this super-block's B rows
            const int8_t* xh = a.xh.get() + at;
            const uint8_t* xl = a.xl.get() + at;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            for (int g = 0; g < 4; ++g) {
              amx16_line<TYPE == kQ6_K>(wt.hi[g][0], wt.lo[g][0], xh + 1024 * g, xl + 1024 * g);
              if (t0 == 0 && t == 0 && sb + 1 < NB) unpack(sb + 1, 4 * g, 4 * g + 4);  // as the int8 path's
            }
            _tile_stored(0, ch, 64);
            _tile_stored(1, cm, 64);
            _tile_stored(2, cl, 64);
            const __m512 dx = _mm512_load_ps(a.dx.get() + (t0 + t) * 16);
            const float* sx = a.sx.get() + ((t0 + t) * NB + sb) * 8 * 16;  // [8 sub-blocks][16 rows]
#pragma GCC unroll 2
            for (int f = 0; f < 16; ++f) {
              // 65536 * hh + 256 * mid + ll, each exact in float32 (|.| < 2^24), two roundings
              const __m512 sum = _mm512_fmadd_ps(
                  _mm512_cvtepi32_ps(_mm512_load_si512(ch[f])), _mm512_set1_ps(65536.f),
                  _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cm[f])), _mm512_set1_ps(256.f),
                                  _mm512_cvtepi32_ps(_mm512_load_si512(cl[f]))));
              __m512 v = _mm512_fmadd_ps(sum, _mm512_mul_ps(_mm512_set1_ps(wt.d[f]), dx), _mm512_load_ps(acc[t][f]));
              if constexpr (TYPE != kQ6_K) {
#pragma GCC unroll 8
                for (int j = 0; j < 8; ++j) v = _mm512_fnmadd_ps(_mm512_set1_ps(wt.mf[j][f]), _mm512_load_ps(sx + 16 * j), v);
              }
              _mm512_store_ps(acc[t][f], v);
            }
          } else {
            const int8_t* xb = a.x.get() + (t0 + t) * a.K * 16 + sb * 256 * 16;  // this super-block's B rows
            _tile_zero(0);
            _tile_zero(1);
            // while the tile unit works, the group's first pass unpacks the next super-block, a
            // quarter of its rows after each line's products: its planes are then in L1 for their tile
            // loads, and the stores behind them long done (unpacked just before its products instead:
            // 1.03-1.1x slower at 16 rows)
            const bool ahead = t0 == 0 && t == 0 && sb + 1 < NB;
            amx_line_a<TYPE == kQ6_K>(wt.hi[0][0], wt.lo[0][0], xb);
            if (ahead) unpack(sb + 1, 0, 4);
            amx_line_b<TYPE == kQ6_K>(wt.hi[1][0], wt.lo[1][0], xb + 1024);
            if (ahead) unpack(sb + 1, 4, 8);
            amx_line_a<TYPE == kQ6_K>(wt.hi[2][0], wt.lo[2][0], xb + 2048);
            if (ahead) unpack(sb + 1, 8, 12);
            amx_line_b<TYPE == kQ6_K>(wt.hi[3][0], wt.lo[3][0], xb + 3072);
            if (ahead) unpack(sb + 1, 12, 16);
            _tile_stored(0, ch, 64);
            _tile_stored(1, cl, 64);
            const int16_t* bt = (TYPE == kQ6_K ? a.bs.get() : a.bs32.get()) + ((t0 + t) * NB + sb) * 32 * B::NP;
            const __m512 d8 = _mm512_load_ps(a.d8.get() + ((t0 + t) * NB + sb) * 16);
#pragma GCC unroll 4
            for (int f = 0; f < 16; ++f) {
              const __m512i is = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(ch[f]), 8), _mm512_load_si512(cl[f]));
              __m512i off = _mm512_setzero_si512();
#pragma GCC unroll 8
              for (int p = 0; p < B::NP; ++p)
                off = _mm512_dpwssd_epi32(off, _mm512_load_si512(bt + p * 32), _mm512_set1_epi32(wt.mp[p][f]));
              __m512 v = _mm512_load_ps(acc[t][f]);
              if constexpr (TYPE == kQ6_K) {
                v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(is, _mm512_slli_epi32(off, 5))),
                                    _mm512_mul_ps(_mm512_set1_ps(wt.d[f]), d8), v);
              } else {
                v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(_mm512_set1_ps(wt.d[f]), d8), v);
                v = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(off), _mm512_mul_ps(_mm512_set1_ps(wt.dmin[f]), d8), v);
              }
              _mm512_store_ps(acc[t][f], v);
            }
          }
        }
      }
      // acc[t] is [weight row f][activation row r] and an output row wants its 16 columns together: a
      // gather of them a row, rounded 16 at once (the scalar stores, 256 a row group, were ~5 % of a
      // 16-row gate/up call on the AMX Xeon; the head's 3,072 row groups 10 %)
      const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(16));
      for (int t = 0; t < nt; ++t)
        for (int r = 0; r < 16 && 16 * (t0 + t) + r < a.M; ++r)
          lv_store(out + (16 * (t0 + t) + r) * ldo + n, _mm512_i32gather_ps(column, &acc[t][0][r], 4));
    }
  }
  _tile_release();
  return nend;
}

}  // namespace

bool amx_int8_available() { return amx_tiles_granted(); }

template <typename A, typename T>
int64_t amx_kquant_columns(int64_t type, const A& a, const uint8_t* w, int64_t row_bytes, T* out, int64_t ldo,
                           int64_t n0, int64_t n1) {
  switch (type) {
    case kQ4_K: return amx_columns<kQ4_K>(a, w, row_bytes, out, ldo, n0, n1);
    case kQ5_K: return amx_columns<kQ5_K>(a, w, row_bytes, out, ldo, n0, n1);
    case kQ6_K: return amx_columns<kQ6_K>(a, w, row_bytes, out, ldo, n0, n1);
  }
  return n0;
}

#else  // no AMX-INT8 in this build: gguf_gemm never asks (amx_int8_available)

bool amx_int8_available() { return false; }
template <typename A, typename T>
int64_t amx_kquant_columns(int64_t, const A&, const uint8_t*, int64_t, T*, int64_t, int64_t n0, int64_t) {
  return n0;
}

#endif

template int64_t amx_kquant_columns(int64_t, const AmxActivations&, const uint8_t*, int64_t, float*, int64_t, int64_t,
                                    int64_t);
template int64_t amx_kquant_columns(int64_t, const AmxActivations&, const uint8_t*, int64_t, uint16_t*, int64_t,
                                    int64_t, int64_t);
template int64_t amx_kquant_columns(int64_t, const AmxActivations16&, const uint8_t*, int64_t, float*, int64_t,
                                    int64_t, int64_t);
template int64_t amx_kquant_columns(int64_t, const AmxActivations16&, const uint8_t*, int64_t, uint16_t*, int64_t,
                                    int64_t, int64_t);

}  // namespace gguf
}  // namespace iterserve

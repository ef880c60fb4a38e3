// gguf_gemm's K-quant shards (Q4_K, Q5_K, Q6_K) on int8 activations on AMX-INT8 tiles: steps of 16
// rows and more (a 16-sequence decode step, speculative verification, prompt chunks) from the file's
// own blocks.
//
// Why: at 16 rows the interleaved AVX2 kernel (gemm_gguf.cpp's il_rows) multiplied ~120 GMAC/s on the
// 2-core AMX Xeon, a 1B's 16-row step 6.6x its compute bound; one tdpbusd multiplies a 16 x 16 x 64 int8
// tile product (16,384 multiply-adds) where a vpdpbusd does 64.
//
// How. C = A . B with A the weights (16 weight rows x one sub-block's inputs, u8 levels 0..15 / 0..31 /
// 0..63: what tdpbusd's unsigned operand takes), B the activations (s8, in the VNNI layout, laid out
// once a call: AmxActivations) and C int32, 16 weight rows x 16 activation rows. A K-quant's scale
// changes every sub-block (32 inputs for Q4_K / Q5_K, 16 for Q6_K), so each tile product covers one
// sub-block, is stored, and its 16 rows are multiplied by their integer scales and added up in int32
// over the super-block with AVX-512 (vpmulld); the mins (Q4_K, Q5_K) and Q6_K's offset of 32 come off
// as integer sums of the activations' level sums (bs) times the sub-block mins or scales (vpdpwssd),
// and a super-block reaches float once per output: acc += float(is) * (d * d8), acc -= float(off) *
// (dmin * d8). Those are il_rows's integers and float operations in il_rows's order, so an output is
// il_rows's bit for bit (tests/test_kquant.py), and a Q4_K / Q5_K call of >= kAmxMinRows rows gives
// the numbers it gave without AMX; Q6_K's between 16 and 31 rows, where gg_rows_i8 ran (8 float lanes
// a row), round in il_rows's order instead.
//
// The weights: for 16 weight rows, each row's levels are unpacked into 4 lines of 64 bytes a
// super-block (two sub-blocks a line: an A tile is 16 of those half-lines, stride 64), once for every
// tile of activation rows. The activation tiles of a super-block are 4 KiB each: in L1.
//
// Measured on the 2-core AMX Xeon (docs/profile.md): 1.8-2.5x the interleaved kernel at 16-64 rows
// for Q4_K, 1.2x (16 rows: against gg_rows_i8) to 2x for Q6_K, whose sub-blocks of 16 take twice the
// tile products and scaling a weight. What bounds it at 16 rows is the work per weight outside the
// tiles: unpacking the levels and scales, and scaling each product (vpmulld), ~150 instructions per
// 8,192 multiply-adds; a product itself is one tdpbusd.
#include "gemm_gguf_amx.h"

#include "gguf_blocks.h"
#include "kernel_common.h"
#include "lanes.h"
#include "work_pool.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
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

}  // namespace

AmxActivations::AmxActivations(const int8_t* x8, int64_t l8, const float* d8_in, const int16_t* bs_in, int64_t M_,
                               int64_t K_)
    : M(M_), K(K_), tiles((M_ + 15) / 16), x(aligned_array<int8_t>(tiles * K_ * 16)),
      d8(aligned_array<float>(tiles * (K_ / 256) * 16)), bs(aligned_array<int16_t>(tiles * (K_ / 256) * 256)),
      bs32(aligned_array<int16_t>(tiles * (K_ / 256) * 128)) {
  const int64_t NB = K / 256;
  auto tile = [&](int64_t t) {
    int8_t* xt = x.get() + t * K * 16;
    float* dt = d8.get() + t * NB * 16;
    int16_t* bt = bs.get() + t * NB * 256;
    int16_t* b32 = bs32.get() + t * NB * 128;
    if (16 * t + 16 > M) {  // the last tile's rows past M: zeros (their outputs are never stored; no lane
                            // reads uninitialised memory)
      std::memset(xt, 0, K * 16);
      std::memset(dt, 0, NB * 16 * sizeof(float));
      std::memset(bt, 0, NB * 256 * sizeof(int16_t));
      std::memset(b32, 0, NB * 128 * sizeof(int16_t));
    }
    for (int64_t r = 0; r < 16 && 16 * t + r < M; ++r) {
      const int64_t m = 16 * t + r;
      const int8_t* xr = x8 + m * l8;
      for (int64_t k4 = 0; k4 < K / 4; ++k4) std::memcpy(xt + (k4 * 16 + r) * 4, xr + 4 * k4, 4);
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
  };
  if (M * K < kParallelQuantise) {
    for (int64_t t = 0; t < tiles; ++t) tile(t);
  } else {
    iterserve::parallel_ranges(tiles, kRanges, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) tile(t);
    });
  }
}

#if ISV_AMX_INT8
namespace {

// Tile registers: 0-3 the int32 products (16 x 16), 4 / 5 and 6 / 7 the weights (A, 16 rows x SUB bytes)
// and activations (B, SUB / 4 rows x 64 bytes) of two sub-blocks in turn.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit AmxConfig(int sub) {
    for (int c = 0; c < 4; ++c) colsb[c] = 64, rows[c] = 16;
    for (int a : {4, 6}) colsb[a] = static_cast<uint16_t>(sub), rows[a] = 16;
    for (int b : {5, 7}) colsb[b] = 64, rows[b] = static_cast<uint8_t>(sub / 4);
  }
};

// Sub-block j's tile product into c (16 x 16 int32, rows = weight rows), in product tile j % 4 and
// operand tiles 4 / 5 or 6 / 7 by j % 2. One macro per tile: gcc's tile intrinsics paste their register
// number into the assembly, so it must be a literal.
#define ISV_AMX_PIECE(C, A, B)                          \
  inline void amx_piece_##C(const uint8_t* a, const int8_t* b, int32_t* c) { \
    _tile_zero(C);                                      \
    _tile_loadd(A, a, 64);                              \
    _tile_loadd(B, b, 64);                              \
    _tile_dpbusd(C, A, B);                              \
    _tile_stored(C, c, 64);                             \
  }
ISV_AMX_PIECE(0, 4, 5)
ISV_AMX_PIECE(1, 6, 7)
ISV_AMX_PIECE(2, 4, 5)
ISV_AMX_PIECE(3, 6, 7)
#undef ISV_AMX_PIECE

// One super-block of 16 weight rows, unpacked: the levels (lv: 4 lines of 64 bytes a row), each row's
// integer sub-block scales (sc[row][j]) and the int16 pairs that multiply the activations' level-sum
// pairs (mp[row][p], vpdpwssd's: Q4_K / Q5_K the mins of sub-blocks 2p and 2p + 1 against the sums
// over them, Q6_K the scales of sub-blocks 2p and 2p + 1 against the sums over those 16 inputs), d and
// dmin. Row-major, so each row's come from one widening load and store; a broadcast reads any one.
template <int64_t TYPE>
struct AmxBlock {
  static constexpr int SUB = TYPE == kQ6_K ? 16 : 32, NS = 256 / SUB, NP = NS / 2;
  alignas(64) uint8_t lv[4][16][64];
  alignas(64) int32_t sc[16][NS];
  alignas(64) int32_t mp[16][NP];
  alignas(64) float d[16], dmin[16];

  // where sub-block j's A tile starts (rows 64 bytes apart). Q4_K / Q5_K: line g of a row holds
  // sub-blocks (0, 2), (1, 3), (4, 6), (5, 7) for g = 0..3; Q6_K: line g holds sub-blocks 4g .. 4g + 3.
  const uint8_t* tile(int j) const {
    if constexpr (TYPE == kQ6_K) return &lv[j / 4][0][0] + 16 * (j % 4);
    else return &lv[(j / 4) * 2 + (j % 2)][0][0] + 32 * ((j / 2) % 2);
  }

  // row f's super-block from its bytes b
  void unpack(int f, const uint8_t* b) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    if constexpr (TYPE == kQ6_K) {
      d[f] = f16_at(b + 208), dmin[f] = 0.f;
      const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));  // 16 int8 scales
      _mm512_store_si512(sc[f], _mm512_cvtepi8_epi32(s));
      _mm256_store_si256(reinterpret_cast<__m256i*>(mp[f]), _mm256_cvtepi8_epi16(s));  // pairs (2p, 2p + 1)
      const __m512i m30 = _mm512_set1_epi8(0x30);
      // the 16-bit shifts of the high bits: gemm_gguf.cpp's q6k_levels takes them << 4 and << 2 for
      // its q[0] | q[1], as they are and >> 2 for q[2] | q[3]
      const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
      const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
      for (int h = 0; h < 2; ++h) {
        const __m512i l = _mm512_loadu_si512(b + 64 * h);
        const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
        _mm512_store_si512(lv[2 * h][f], _mm512_or_si512(_mm512_and_si512(l, low4),
                                                         _mm512_and_si512(_mm512_sllv_epi16(hb, up), m30)));
        _mm512_store_si512(lv[2 * h + 1][f], _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low4),
                                                             _mm512_and_si512(_mm512_srlv_epi16(hb, down), m30)));
      }
    } else {
      uint64_t s, mn;
      d[f] = f16_at(b), dmin[f] = f16_at(b + 2);
      k4_scales(b + 4, s, mn);
      _mm256_store_si256(reinterpret_cast<__m256i*>(sc[f]), _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(s))));
      _mm_store_si128(reinterpret_cast<__m128i*>(mp[f]), _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(mn))));
      const uint8_t* qs = b + (TYPE == kQ5_K ? 48 : 16);
      for (int c = 0; c < 2; ++c) {  // bytes 64c ..: sub-blocks 4c, 4c + 2 (low nibbles), 4c + 1, 4c + 3
        const __m512i v = _mm512_loadu_si512(qs + 64 * c);
        __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if constexpr (TYPE == kQ5_K) {  // bit 4 of sub-block s's input i: bit s of qh[i]
          const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
          const int s0 = 4 * c;
          const __m512i tlo = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << s0)),
                                                 _mm256_set1_epi8(static_cast<char>(1 << (s0 + 2))), 1);
          const __m512i thi = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (s0 + 1))),
                                                 _mm256_set1_epi8(static_cast<char>(1 << (s0 + 3))), 1);
          const __m512i bit4 = _mm512_set1_epi8(0x10);
          lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, tlo), lo, bit4);
          hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh, thi), hi, bit4);
        }
        _mm512_store_si512(lv[2 * c][f], lo);
        _mm512_store_si512(lv[2 * c + 1][f], hi);
      }
    }
  }
};

// A group of 16 weight rows, every super-block unpacked (K 2048: 40 KiB, K 14336: 280 KiB: L2), read
// row after row: one sequential stream of the file's bytes. amx_columns asks for the next group's
// bytes into L2 while it computes this one's products (without that, 2.5 against 2.2 ms for a 1B's
// gate_up at 16 rows); unpacked a super-block at a time across the 16 rows instead, the reads jump a
// row's length 16 times a step, which timed the same as this with the L2 requests.
template <int64_t TYPE>
void amx_unpack_group(const uint8_t* wg, int64_t row_bytes, int64_t NB, const uint8_t* wend, AmxBlock<TYPE>* blk) {
  constexpr int64_t BYTES = kquant_bytes(TYPE);
  for (int f = 0; f < 16; ++f) {
    const uint8_t* wr = wg + f * row_bytes;
    for (int64_t sb = 0; sb < NB; ++sb) {
      prefetch_stream(wr + sb * BYTES, BYTES, wend);
      blk[sb].unpack(f, wr + sb * BYTES);
    }
  }
}

template <int64_t TYPE, typename T>
int64_t amx_columns(const AmxActivations& a, const uint8_t* w, int64_t row_bytes, T* out, int64_t ldo, int64_t n0,
                    int64_t n1) {
  using B = AmxBlock<TYPE>;
  constexpr int SUB = B::SUB, NS = B::NS;
  constexpr int kBlockTiles = 4;  // activation tiles a pass of the accumulators holds
  const int64_t NB = a.K / 256, nend = n0 + (n1 - n0) / 16 * 16;
  if (nend == n0) return n0;
  thread_local std::vector<B> blocks;  // one group's super-blocks, kept between calls (its pages fault in once)
  if (static_cast<int64_t>(blocks.size()) < NB) blocks.resize(NB);
  B* blk = blocks.data();
  const AmxConfig cfg(SUB);
  _tile_loadconfig(&cfg);
  alignas(64) int32_t cb[NS][16][16];
  alignas(64) float acc[kBlockTiles][16][16];
  for (int64_t n = n0; n < nend; n += 16) {
    amx_unpack_group<TYPE>(w + n * row_bytes, row_bytes, NB, w + nend * row_bytes, blk);
    for (int64_t t0 = 0; t0 < a.tiles; t0 += kBlockTiles) {
      const int nt = static_cast<int>(std::min<int64_t>(kBlockTiles, a.tiles - t0));
      std::memset(acc, 0, sizeof(acc));
      for (int64_t sb = 0; sb < NB; ++sb) {
        const B& wt = blk[sb];
        // the next group's bytes (16 rows: contiguous) into L2 while this one computes, a 1 / NB
        // share a super-block, so that its unpacking reads cache and not memory
        const uint8_t* ahead = nullptr;
        int64_t ahead_lines = 0;
        if (t0 + kBlockTiles >= a.tiles && n + 16 < nend) {
          const int64_t span = 16 * row_bytes, per = (span + NB - 1) / NB;
          ahead = w + (n + 16) * row_bytes + sb * per;
          ahead_lines = (std::max<int64_t>(0, std::min(per, span - sb * per)) + 63) / 64;
        }
        for (int t = 0; t < nt; ++t) {
          const int8_t* xb = a.x.get() + (t0 + t) * a.K * 16 + sb * 256 * 16;  // this super-block's B rows
          __m512i is[16];
          for (int f = 0; f < 16; ++f) is[f] = _mm512_setzero_si512();
          // every sub-block's product, then their scaling (products interleaved with the scaling, two
          // in flight, timed the same)
          for (int j = 0; j < NS; j += 4) {
            amx_piece_0(wt.tile(j), xb + j * SUB * 16, &cb[j][0][0]);
            amx_piece_1(wt.tile(j + 1), xb + (j + 1) * SUB * 16, &cb[j + 1][0][0]);
            amx_piece_2(wt.tile(j + 2), xb + (j + 2) * SUB * 16, &cb[j + 2][0][0]);
            amx_piece_3(wt.tile(j + 3), xb + (j + 3) * SUB * 16, &cb[j + 3][0][0]);
          }
          for (int j = 0; j < NS; ++j) {
            if (t == 0)  // a few lines with each sub-block's scaling: 36 at once waited for fill buffers
                         // (spread: 1.04x gate/up, 1.07x the Q6_K head at 16 rows; same bits)
              for (int64_t l = j * ahead_lines / NS; l < (j + 1) * ahead_lines / NS; ++l)
                _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * l), _MM_HINT_T1);
            const int32_t(*c)[16] = cb[j];
#pragma GCC unroll 16
            for (int f = 0; f < 16; ++f)
              is[f] = _mm512_add_epi32(is[f], _mm512_mullo_epi32(_mm512_load_si512(c[f]), _mm512_set1_epi32(wt.sc[f][j])));
          }
          const int16_t* bt = (TYPE == kQ6_K ? a.bs.get() : a.bs32.get()) + ((t0 + t) * NB + sb) * 32 * B::NP;
          const __m512 d8 = _mm512_load_ps(a.d8.get() + ((t0 + t) * NB + sb) * 16);
#pragma GCC unroll 4
          for (int f = 0; f < 16; ++f) {
            __m512i off = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int p = 0; p < B::NP; ++p)
              off = _mm512_dpwssd_epi32(off, _mm512_load_si512(bt + p * 32), _mm512_set1_epi32(wt.mp[f][p]));
            __m512 v = _mm512_load_ps(acc[t][f]);
            if constexpr (TYPE == kQ6_K) {
              is[f] = _mm512_sub_epi32(is[f], _mm512_slli_epi32(off, 5));
              v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[f]), _mm512_mul_ps(_mm512_set1_ps(wt.d[f]), d8), v);
            } else {
              v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[f]), _mm512_mul_ps(_mm512_set1_ps(wt.d[f]), d8), v);
              v = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(off), _mm512_mul_ps(_mm512_set1_ps(wt.dmin[f]), d8), v);
            }
            _mm512_store_ps(acc[t][f], v);
          }
        }
      }
      for (int t = 0; t < nt; ++t)
        for (int r = 0; r < 16 && 16 * (t0 + t) + r < a.M; ++r) {
          T* o = out + (16 * (t0 + t) + r) * ldo + n;
          for (int f = 0; f < 16; ++f) store(o + f, acc[t][f][r]);
        }
    }
  }
  _tile_release();
  return nend;
}

template <typename T>
int64_t amx_dispatch(int64_t type, const AmxActivations& a, const uint8_t* w, int64_t row_bytes, T* out, int64_t ldo,
                     int64_t n0, int64_t n1) {
  switch (type) {
    case kQ4_K: return amx_columns<kQ4_K>(a, w, row_bytes, out, ldo, n0, n1);
    case kQ5_K: return amx_columns<kQ5_K>(a, w, row_bytes, out, ldo, n0, n1);
    case kQ6_K: return amx_columns<kQ6_K>(a, w, row_bytes, out, ldo, n0, n1);
  }
  return n0;
}

}  // namespace

bool amx_int8_available() { return amx_tiles_granted(); }

int64_t amx_kquant_columns(int64_t type, const AmxActivations& a, const uint8_t* w, int64_t row_bytes, float* out,
                           int64_t ldo, int64_t n0, int64_t n1) {
  return amx_dispatch(type, a, w, row_bytes, out, ldo, n0, n1);
}
int64_t amx_kquant_columns(int64_t type, const AmxActivations& a, const uint8_t* w, int64_t row_bytes,
                           uint16_t* out, int64_t ldo, int64_t n0, int64_t n1) {
  return amx_dispatch(type, a, w, row_bytes, out, ldo, n0, n1);
}

#else  // no AMX-INT8 in this build: gguf_gemm never asks (amx_int8_available)

bool amx_int8_available() { return false; }
int64_t amx_kquant_columns(int64_t, const AmxActivations&, const uint8_t*, int64_t, float*, int64_t, int64_t n0,
                           int64_t) {
  return n0;
}
int64_t amx_kquant_columns(int64_t, const AmxActivations&, const uint8_t*, int64_t, uint16_t*, int64_t, int64_t n0,
                           int64_t) {
  return n0;
}

#endif

}  // namespace gguf
}  // namespace iterserve

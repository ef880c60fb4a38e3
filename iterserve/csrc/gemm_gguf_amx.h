// gemm_gguf_amx.cpp's interface to gguf_gemm (gemm_gguf.cpp): the K-quant shards of a call on int8
// activations, 16 weight rows at a time on AMX-INT8 tiles, where the build has AMX and Linux lends it.
#pragma once

#include <cstdint>
#include <memory>

namespace iterserve {
namespace gguf {

// A call of at least this many int8 activation rows runs its K-quant shards on AMX (gguf_gemm's `amx`):
// the rows at which gg_shard's interleaved kernel takes over from gg_rows_i8 for Q4_K and Q5_K, whose
// numbers the AMX kernel gives bit for bit (Q6_K's interleaved kernel starts at 32 rows without AMX).
constexpr int64_t kAmxMinRows = 16;

// The int8 activation rows (llama.cpp's Q8_K, GgQuantised's x8 / d8 / bs) laid out for tdpbusd once a
// call, in tiles of 16 rows, the last one padded with zero rows (a product's column is one row's: the
// padding's outputs are computed and dropped):
// - x:  [tiles][K / 4][16][4] int8: a B tile's VNNI form; inputs k .. k + 31 of a tile's rows are
//       the 8 rows of 64 bytes at (k / 4) * 64;
// - d8: [tiles][K / 256][16] float: a super-block's scale of each row, as a vector over the rows;
// - bs: [tiles][K / 256][8][16][2] int16: (bs[2p], bs[2p + 1]) of each row, the levels' sums over
//       inputs 32p .. 32p + 15 and 32p + 16 .. 32p + 31 of the super-block, a vpdpwssd's pairs (Q6_K);
// - bs32: [tiles][K / 256][4][16][2] int16: the sums over inputs 64p .. 64p + 31 and 64p + 32 ..
//       64p + 63 (Q4_K / Q5_K's sub-blocks 2p and 2p + 1).
struct AmxActivations {
  int64_t M, K, tiles;
  std::unique_ptr<int8_t[], void (*)(void*)> x;
  std::unique_ptr<float[], void (*)(void*)> d8;
  std::unique_ptr<int16_t[], void (*)(void*)> bs, bs32;
  // x8 [M, row stride l8], d8 [M, K / 256], bs [M, K / 16]
  AmxActivations(const int8_t* x8, int64_t l8, const float* d8, const int16_t* bs, int64_t M, int64_t K);
};

// The int16 activation rows (gguf_gemm's default: GgQuantised's xq / dx / sx, one scale a row) laid
// out for the tiles once a call, in tiles of 16 rows as AmxActivations, each level q split into
// 256 * xh + xl:
// - xh: [tiles][K / 4][16][4] int8 (q >> 8), xl: the same, uint8 (q & 255);
// - dx: [tiles][16] float: each row's scale;
// - sx: [tiles][K / 32][16] float: the float32 sum of x over each 32 inputs (the Q4_K / Q5_K mins).
struct AmxActivations16 {
  int64_t M, K, tiles;
  std::unique_ptr<int8_t[], void (*)(void*)> xh;
  std::unique_ptr<uint8_t[], void (*)(void*)> xl;
  std::unique_ptr<float[], void (*)(void*)> dx, sx;
  // xq [M, row stride lq] int16 in input order, dx [M], sx [M, row stride ls]
  AmxActivations16(const int16_t* xq, int64_t lq, const float* dx, const float* sx, int64_t ls, int64_t M, int64_t K);
};

// Built with AMX-INT8 and granted the tile state by the OS (asked once).
bool amx_int8_available();

// Output columns [n0, n0 + 16 * j) of a K-quant shard (type Q4_K, Q5_K or Q6_K; row n at w + n *
// row_bytes) for a.M rows into out [M, ldo], float32 or bfloat16 bits; returns the first column not done
// (fewer than 16 left: the caller's loops take them). A: AmxActivations (int8: the interleaved kernel's
// numbers) or AmxActivations16 (int16: four tile products a line, the super-block's sum taken to
// float32 exactly but for two roundings, d * dx once a super-block, the mins as gg_rows takes them:
// dmin * m times the float sum of x over the sub-block). T: float or uint16_t (bf16 bits).
template <typename A, typename T>
int64_t amx_kquant_columns(int64_t type, const A& a, const uint8_t* w, int64_t row_bytes, T* out, int64_t ldo,
                           int64_t n0, int64_t n1);

}  // namespace gguf
}  // namespace iterserve

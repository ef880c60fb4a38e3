// bf16_gemm: every bf16 projection without a quantised twin (decode batches and prefill), from
// weights laid out in tiles of 16 outputs (pack_bf16): 2.2x oneDNN's prepacked GEMM at 16 rows, even
// at 512 (Zen 4). The same layout feeds AMX tiles for steps of many rows where the CPU has AMX.
#include "kernel_common.h"
#include "kernels.h"
#include "lanes.h"
#include "work_pool.h"

#if defined(__linux__)
#endif

#include <algorithm>
#include <cstring>
#include <memory>

namespace iterserve {
namespace {

constexpr int64_t kAheadPairs = 64;  // the weight tile's prefetch distance, 4 KB (8: 16 rows 7.8 vs 5.9 ms)

// MB rows x NT tiles of 16 outputs (NT weight streams side by side, t * K2 * 32 apart)
template <int MB, int NT>
void bf16_tile(const uint32_t* xp, int64_t m0, const uint16_t* wt, int64_t K2, uint16_t* out, int64_t N, int64_t n0) {
#if ISV_BF16_DOT
  __m512 acc[NT][MB];
  for (int j = 0; j < NT; ++j)
    for (int i = 0; i < MB; ++i) acc[j][i] = _mm512_setzero_ps();
  const uint32_t* xr = xp;
  for (int64_t kp = 0; kp < K2; ++kp, xr += MB) {
    __m512bh w[NT];
    for (int j = 0; j < NT; ++j) {
      const uint16_t* wj = wt + j * K2 * 32 + kp * 32;
      _mm_prefetch(reinterpret_cast<const char*>(wj + kAheadPairs * 32), _MM_HINT_T0);
      w[j] = (__m512bh)_mm512_loadu_si512(wj);
    }
#pragma GCC unroll 32
    for (int i = 0; i < MB; ++i) {
      const __m512bh xi = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[i]));
      for (int j = 0; j < NT; ++j) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], w[j], xi);
    }
  }
  for (int j = 0; j < NT; ++j) {
    const int64_t width = std::min<int64_t>(16, N - n0 - 16 * j);
    const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
    for (int i = 0; i < MB; ++i) {
      _mm256_mask_storeu_epi16(out + (m0 + i) * N + n0 + 16 * j, mask, (__m256i)_mm512_cvtneps_pbh(acc[j][i]));
    }
  }
#else
  for (int j = 0; j < NT; ++j)
    for (int i = 0; i < MB; ++i)
      for (int64_t c = 0; c < std::min<int64_t>(16, N - n0 - 16 * j); ++c) {
        float s = 0.f;
        for (int64_t kp = 0; kp < K2; ++kp) {
          const uint32_t pair = xp[kp * MB + i];
          const uint16_t* wk = wt + j * K2 * 32 + kp * 32 + 2 * c;
          s += load(static_cast<uint16_t>(pair & 0xFFFF)) * load(wk[0]) + load(static_cast<uint16_t>(pair >> 16)) * load(wk[1]);
        }
        store(out + (m0 + i) * N + n0 + 16 * j + c, s);
      }
#endif
}

// Row tiles are at most kTallRows high against one output tile (few rows: the weights stream once),
// or kWideRows against kWideTiles output tiles (many rows: the GEMM is bound by arithmetic, and
// more tiles share each broadcast). Registers: 24 + 1 and 3 x 8 + 3 of AVX-512's 32. Measured for
// the 120 projections at 512 rows (Zen 4): 8 x 3 tiles 124 ms, 12 x 2 129, 6 x 4 131, 16 x 1 135,
// oneDNN 120; at 24 rows one 24-row tile 7.7 ms against 8.6 for two of 12.
constexpr int64_t kTallRows = 24, kWideRows = 8, kWideTiles = 3;

template <int NT>
void bf16_tile_rows(int64_t rows, const uint32_t* xp, int64_t m0, const uint16_t* wt, int64_t K2, uint16_t* out,
                    int64_t N, int64_t n0) {
  switch (rows) {
#define ISV_ROWS(R) \
  case R: if constexpr (R <= (NT == 1 ? kTallRows : kWideRows)) return bf16_tile<R, NT>(xp, m0, wt, K2, out, N, n0); break;
    ISV_ROWS(1) ISV_ROWS(2) ISV_ROWS(3) ISV_ROWS(4) ISV_ROWS(5) ISV_ROWS(6) ISV_ROWS(7) ISV_ROWS(8)
    ISV_ROWS(9) ISV_ROWS(10) ISV_ROWS(11) ISV_ROWS(12) ISV_ROWS(13) ISV_ROWS(14) ISV_ROWS(15) ISV_ROWS(16)
    ISV_ROWS(17) ISV_ROWS(18) ISV_ROWS(19) ISV_ROWS(20) ISV_ROWS(21) ISV_ROWS(22) ISV_ROWS(23) ISV_ROWS(24)
#undef ISV_ROWS
  }
}

// ---- the same GEMM on AMX tiles, from the same weight layout ---------------------------------------
// pack_bf16's tile of 16 outputs holds, per pair of inputs, 16 x 2 bf16 = 64 bytes: 16 pairs of it
// (32 inputs) are exactly an AMX B tile in its VNNI form (16 rows of 64 bytes), and 16 rows of x's
// 32 inputs an A tile read in place (stride K). So the tiled layout runs on AMX for steps of many
// rows, where AMX's 16x16x32 tile products beat a vdpbf16ps per row and pair (oneDNN's AMX GEMM was
// 3x our AVX-512 one at 64 rows on the AMX Xeon), and on AVX-512 for few rows, where the weights'
// memory traffic bounds both (ours was 1.3-2x oneDNN's there): one copy of the weights, the faster
// kernel at each step size. Which rows go where is measured (platform/kernel_choice.py). Float32
// accumulation and one rounding to bf16, as the AVX-512 path, in another order: a step of >=
// amx_min_rows rows is not bit-identical to the same rows run alone, so batch_invariant keeps AMX off.
// Linux lends AMX's tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM); the
// tile configuration is per thread, so each range of work loads it and releases it.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define ISV_AMX 1
#else
#define ISV_AMX 0
#endif


#if ISV_AMX
struct alignas(64) TileConfig {  // ldtilecfg's 64 bytes, palette 1: every tile 16 rows x 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// MA x 16 rows of x against NB tiles of 16 outputs: accumulators in tiles 0-3 (row tile i, output
// tile j in 2i + j), x in 4-5, weights in 6-7; c: [MA * 16][NB * 16] float32
template <int MA, int NB>
void amx_block(const uint16_t* x, int64_t K, const uint16_t* wt, int64_t K2, float* c) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, x + k, K * 2);
    if constexpr (MA == 2) _tile_loadd(5, x + 16 * K + k, K * 2);
    _tile_loadd(6, wt + k * 16, 64);
    if constexpr (NB == 2) _tile_loadd(7, wt + K2 * 32 + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MA == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MA == 2 && NB == 2) _tile_dpbf16ps(3, 5, 7);
  }
  constexpr int64_t stride = NB * 16 * 4;
  _tile_stored(0, c, stride);
  if constexpr (NB == 2) _tile_stored(1, c + 16, stride);
  if constexpr (MA == 2) _tile_stored(2, c + 16 * NB * 16, stride);
  if constexpr (MA == 2 && NB == 2) _tile_stored(3, c + 16 * NB * 16 + 16, stride);
}

// rows [m0, m0 + 16 * MA) of x (padded to whole row tiles) x output tiles [t, t + NB)
template <int MA, int NB>
void amx_store_block(const uint16_t* x, int64_t M, int64_t m0, int64_t K, const uint16_t* wp, int64_t t, int64_t N,
                     uint16_t* out) {
  const int64_t K2 = K / 2;
  alignas(64) float c[MA * 16 * NB * 16];
  amx_block<MA, NB>(x + m0 * K, K, wp + t * K2 * 32, K2, c);
  for (int j = 0; j < NB; ++j) {
    const int64_t width = std::min<int64_t>(16, N - 16 * (t + j));
    const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
    for (int64_t i = 0; i < std::min<int64_t>(16 * MA, M - m0); ++i) {
      _mm256_mask_storeu_epi16(out + (m0 + i) * N + 16 * (t + j), mask,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + i * NB * 16 + 16 * j)));
    }
  }
}

void bf16_gemm_amx(const uint16_t* xs, int64_t M, int64_t K, const uint16_t* wp, int64_t N, uint16_t* op) {
  const int64_t tiles = (N + 15) / 16, mt = (M + 15) / 16;
  std::unique_ptr<uint16_t[]> padded;  // x with its last row tile filled with zeros, when M % 16
  if (M % 16) {
    padded.reset(new uint16_t[mt * 16 * K]);
    std::memcpy(padded.get(), xs, M * K * sizeof(uint16_t));
    std::memset(padded.get() + M * K, 0, (mt * 16 - M) * K * sizeof(uint16_t));
    xs = padded.get();
  }
  // pairs of output tiles split over the pool; each pair's weights (2 x K x 32 bytes) stay in the
  // core's cache while every row tile of x goes by
  iterserve::parallel_ranges((tiles + 1) / 2, kRanges, [&](int64_t begin, int64_t end) {
    TileConfig cfg;
    _tile_loadconfig(&cfg);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t t = 2 * p;
      const bool two = t + 1 < tiles;
      for (int64_t r = 0; r < mt; r += 2) {
        const bool tall = r + 1 < mt;
        if (tall && two) amx_store_block<2, 2>(xs, M, 16 * r, K, wp, t, N, op);
        else if (tall) amx_store_block<2, 1>(xs, M, 16 * r, K, wp, t, N, op);
        else if (two) amx_store_block<1, 2>(xs, M, 16 * r, K, wp, t, N, op);
        else amx_store_block<1, 1>(xs, M, 16 * r, K, wp, t, N, op);
      }
    }
    _tile_release();
  });
}
#endif

}  // namespace

bool bf16_gemm_amx_available() {
#if ISV_AMX
  return amx_tiles_granted();
#else
  return false;
#endif
}


// x [M, K] bfloat16; w packed as above for N outputs -> [M, N] bfloat16 (float32 accumulation).
// amx_min_rows > 0: steps of at least that many rows run on AMX tiles where the CPU and the OS allow
// it and K is a multiple of 32 (bf16_gemm_amx_available); 0: never.
at::Tensor bf16_gemm(const at::Tensor& x_in, const at::Tensor& w, int64_t N, int64_t amx_min_rows) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + 15) / 16;
  TORCH_CHECK(K % 2 == 0 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 4 &&
              w.size(0) == tiles && w.size(1) == K / 2 && w.size(2) == 16 && w.size(3) == 2,
              "w must be contiguous [ceil(N/16), K/2, 16, 2] bfloat16 (pack_bf16) with K even");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#if ISV_AMX
  if (amx_min_rows > 0 && M >= amx_min_rows && K % 32 == 0 && bf16_gemm_amx_available()) {
    bf16_gemm_amx(reinterpret_cast<const uint16_t*>(x.const_data_ptr()), M, K,
                  reinterpret_cast<const uint16_t*>(w.const_data_ptr()), N, reinterpret_cast<uint16_t*>(out.data_ptr()));
    return out;
  }
#endif
  // x in row tiles of equal height (12 rows: one pass of 12, not 8 + 4 reading the weights twice),
  // each as [K/2, mb] pairs: a tile's broadcasts for one pair of inputs sit side by side
  const bool wide = M > kTallRows && tiles > 1;
  const int64_t K2 = K / 2, most = wide ? kWideRows : kTallRows;
  const int64_t row_tiles = (M + most - 1) / most, mb = (M + row_tiles - 1) / row_tiles;
  // Not zeroed: a tile of `rows` rows reads only the K2 x rows entries it is given. Prefill's many
  // row tiles are laid out by the pool (done on one thread, this copy and the zeroing took ~0.4 ms
  // of a 0.5 ms call at 1024 rows x 1536 inputs, 48 outputs, the second thread idle meanwhile).
  std::unique_ptr<uint32_t[]> xbuf(new uint32_t[row_tiles * K2 * mb]);
  uint32_t* xw = xbuf.get();
  const uint32_t* xs = reinterpret_cast<const uint32_t*>(x.const_data_ptr());
  auto lay_out = [&](int64_t r) {
    const int64_t rows = std::min(mb, M - r * mb);  // a tile's stride is its height
    for (int64_t i = 0; i < rows; ++i) {
      const uint32_t* src = xs + (r * mb + i) * K2;
      uint32_t* dst = xw + r * K2 * mb + i;
      for (int64_t kp = 0; kp < K2; ++kp) dst[kp * rows] = src[kp];
    }
  };
  if (row_tiles >= 4) {
    iterserve::WorkPool::instance().run(row_tiles, lay_out);
  } else {
    for (int64_t r = 0; r < row_tiles; ++r) lay_out(r);
  }
  const uint32_t* xp = xw;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.const_data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t step = wide ? kWideTiles : 1;
  iterserve::parallel_ranges((tiles + step - 1) / step, kRanges, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t t = p * step;
      for (int64_t r = 0; r < row_tiles; ++r) {
        const int64_t rows = std::min(mb, M - r * mb);
        const uint32_t* xr = xp + r * K2 * mb;
        if (wide && t + kWideTiles <= tiles) bf16_tile_rows<kWideTiles>(rows, xr, r * mb, wp + t * K2 * 32, K2, op, N, t * 16);
        else for (int64_t u = t; u < std::min(tiles, t + step); ++u) bf16_tile_rows<1>(rows, xr, r * mb, wp + u * K2 * 32, K2, op, N, u * 16);
      }
    }
  });
  return out;
}

bool bf16_gemm_is_vectorised() { return ISV_BF16_DOT; }

}  // namespace iterserve

// paged_prefill_attention: a prompt chunk's causal attention against its sequence's paged K/V,
// flash-attention style on AVX512-BF16 (torch's CPU flash kernel was a third of a prefill step).
// Window and soft-cap as in attention_decode.cpp.
#include "kernel_common.h"
#include "kernels.h"
#include "kv_formats.h"
#include "lanes.h"
#include "work_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace iterserve {
namespace {

// ---- prefill attention: a chunk of n queries, causal, against its sequence's paged K/V ----------
// torch's CPU flash attention ran a 1024-token prompt's causal attention at ~40 GFLOP/s here (a
// third of a prefill step; its softmax and the P.V product in separate passes over memory). This
// one keeps a block's scores in L1 and its outputs in registers: per KV head and block of queries
// (all heads of the KV head's group: rows = queries x group, up to 24), it streams the context in
// key blocks of 64 (4 tiles of 16 keys), each in three steps:
// - S = Q.K^T by vdpbf16ps with the keys in the lanes (K laid out [tile][D/2][16][2] once per call,
//   as bf16_gemm's weights), 6 rows x 4 tiles of accumulators per micro-kernel call;
// - an online softmax step per row in float32 (flash attention's running max and sum), one max and
//   one sum reduction per row per 64 keys; P rounded to bf16 (as torch's flash kernel does for bf16
//   inputs);
// - O = alpha O + P.V by vdpbf16ps (V laid out [tile][8 key pairs][D][2]), 6 rows x 4 chunks of 16
//   dims held in registers over the whole key block: each V vector loaded serves 6 rows, and the 24
//   independent accumulators hide vdpbf16ps's latency.
// (A softmax step and P.V per tile of 16 keys, each output chunk a chain of 8 dependent vdpbf16ps
// through memory, ran 2x slower: docs/profile.md.)
// Query j sits at position ctx - n + j and sees keys 0..that position, or with a window W only the
// last W of them: then a block of queries starts at the tile holding its first query's first key
// (only the tiles some query needs are laid out, from the chunk's first query's window on). Only
// key blocks a row sees in part (the diagonal, a window's edge) are masked; a block a row sees none
// of leaves its state as it is. A soft-cap maps the scaled scores through c * tanh(s / c), 16 lanes
// at a time, before the mask.
// Needs AVX512-BF16, bf16 q, head_dim a multiple of 32; bf16 or 8-bit caches (kv_formats.h: their
// rows widened and rounded to bf16 as the chunk's K/V are laid out, the one pass that reads them).
#if ISV_BF16_DOT
inline __m512 exp512_nonpositive(__m512 x) {  // lanes.h's exp_nonpositive, 16 lanes at a time
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23));
  return _mm512_castsi512_ps(bits);
}

// cap * tanh(s / cap), tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) <= 1: no overflow, and
// +-1 once e underflows. Absolute error a few 1e-7 x cap, far below the bf16 rounding of P.
inline __m512 softcap512(__m512 s, float cap, float inv_cap) {
  const __m512 x = _mm512_mul_ps(s, _mm512_set1_ps(inv_cap));
  const __m512 e = exp512_nonpositive(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)), _mm512_set1_ps(cap));
}

constexpr int64_t kAttnRows = 24;  // rows of one block of queries (queries x the group's heads)
constexpr int kKeyTiles = 4;       // 16-key tiles per online-softmax step: 64 keys
constexpr int kKeys = 16 * kKeyTiles;
constexpr int kGroupRows = 6;  // rows per micro-kernel call: 6 x 4 accumulators (tiles or 16-dim chunks)

// f(std::integral_constant<int, r>) for a runtime 1 <= r <= N: the micro-kernels' row and tile counts
// are template arguments, so that their accumulators stay in registers
template <int N, class F>
inline void with_count(int r, F&& f) {
  if constexpr (N > 1) {
    if (r < N) return with_count<N - 1>(r, f);
  }
  f(std::integral_constant<int, N>{});
}

// S[i][16 t + k] = q_i . key (16 t + k) for RB rows and NT tiles: RB x NT accumulators, each key
// pair's NT tile vectors loaded once for all RB rows (their q pairs broadcast). xr: the rows' q pairs,
// [D/2][stride]; kt: the first tile's [D/2][16][2]; s rows kKeys apart.
template <int RB, int NT>
inline void qk_tiles(const uint32_t* xr, int64_t stride, const uint16_t* kt, int64_t D, float* s) {
  __m512 acc[RB][NT];
  for (int i = 0; i < RB; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t kq = 0; kq < D / 2; ++kq, xr += stride) {
    __m512bh w[NT];
    for (int t = 0; t < NT; ++t) w[t] = (__m512bh)_mm512_loadu_si512(kt + t * 16 * D + kq * 32);
    for (int i = 0; i < RB; ++i) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[i]));
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], w[t], x);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int t = 0; t < NT; ++t) _mm512_store_ps(s + i * kKeys + 16 * t, acc[i][t]);
}

// One row's online-softmax step over a key block of NT tiles from key key0: s its raw scores; the
// row sees keys lo..pos; m, l its running max and sum of (scaled, capped) scores. Writes the block's
// P as bf16 key pairs to p and returns the factor its accumulator is to be rescaled by. Only a block
// the row sees in part (the diagonal, a window's edge) pays for the masks; one it sees none of
// leaves the row as it is.
template <int NT>
inline float softmax_step(const float* s, int64_t key0, int64_t lo, int64_t pos, float scale, float softcap,
                          float& m, float& l, uint32_t* p) {
  if (pos < key0 || lo >= key0 + 16 * NT) {
    std::fill(p, p + 8 * NT, 0u);
    return 1.f;
  }
  const bool whole = lo <= key0 && key0 + 16 * NT - 1 <= pos;
  __m512 x[NT];
  __mmask16 valid[NT];
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int t = 0; t < NT; ++t) {
    x[t] = _mm512_mul_ps(_mm512_load_ps(s + 16 * t), _mm512_set1_ps(scale));
    if (softcap > 0.f) x[t] = softcap512(x[t], softcap, 1.f / softcap);
    if (!whole) {
      const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(key0 + 16 * t)),
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      valid[t] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(pos))) &
                 _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(lo)));
      x[t] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[t], x[t]);
    }
    mx = _mm512_max_ps(mx, x[t]);
  }
  const float mnew = std::max(m, _mm512_reduce_max_ps(mx));
  const float alpha = m == -INFINITY ? 0.f : std::exp(m - mnew);  // the first visible block: acc is 0
  __m512 sum = _mm512_setzero_ps();
  __m512 e[NT];
  for (int t = 0; t < NT; ++t) {
    e[t] = exp512_nonpositive(_mm512_sub_ps(x[t], _mm512_set1_ps(mnew)));
    if (!whole) e[t] = _mm512_maskz_mov_ps(valid[t], e[t]);
    sum = _mm512_add_ps(sum, e[t]);
  }
  for (int t = 0; t + 1 < NT; t += 2)
    _mm512_storeu_si512(p + 8 * t, (__m512i)_mm512_cvtne2ps_pbh(e[t + 1], e[t]));
  if (NT % 2) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8 * (NT - 1)), (__m256i)_mm512_cvtneps_pbh(e[NT - 1]));
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = mnew;
  return alpha;
}

// o_i = alpha_i o_i + sum_k P[i][k] V[k] for RB rows and CB 16-dim chunks: RB x CB accumulators held
// in registers over the whole key block, each key pair's CB V vectors loaded once for all RB rows
// (their P pairs broadcast). pp: the rows' P pairs, kKeys / 2 apart; vt: V [pairs][D][2] from the
// first chunk's dims; o: rows D apart, from the first chunk's dims.
template <int RB, int CB>
inline void pv_tiles(const uint32_t* pp, int64_t pairs, const uint16_t* vt, int64_t D, const float* alpha, float* o) {
  __m512 acc[RB][CB];
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < CB; ++c) acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o + i * D + 16 * c), _mm512_set1_ps(alpha[i]));
  for (int64_t kq = 0; kq < pairs; ++kq) {
    __m512bh v[CB];
    for (int c = 0; c < CB; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vt + kq * 2 * D + 32 * c);
    for (int i = 0; i < RB; ++i) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[i * kKeys / 2 + kq]));
      for (int c = 0; c < CB; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], v[c], x);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < CB; ++c) _mm512_storeu_ps(o + i * D + 16 * c, acc[i][c]);
}

// The running state of a block of rows: row i is query position pos[i] (keys lo[i]..pos[i]), its q
// pairs in q [D/2][rows]; acc [rows][D] its unnormalised output, m, l its softmax's max and sum.
struct PrefillRows {
  int64_t rows;
  const uint32_t* q;
  const int64_t* pos;
  int64_t lo[kAttnRows];
  float m[kAttnRows], l[kAttnRows], alpha[kAttnRows];
  float* acc;
  alignas(64) float s[kAttnRows][kKeys];
  alignas(64) uint32_t p[kAttnRows][kKeys / 2];
};

// One key block (NT tiles from key key0; kt, vt its laid-out K and V) for every row: S in row groups,
// the softmax step row by row, then O += P.V in row groups and chunks of 64 (or 32) dims.
template <int NT>
void prefill_key_block(PrefillRows& b, const uint16_t* kt, const uint16_t* vt, int64_t key0, int64_t D, float scale,
                       float softcap) {
  const int64_t groups = (b.rows + kGroupRows - 1) / kGroupRows;  // of equal height: 20 = 4 x 5, not 3 x 6 + 2
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = g * b.rows / groups, r1 = (g + 1) * b.rows / groups;
    with_count<kGroupRows>(static_cast<int>(r1 - r0), [&](auto rb) {
      qk_tiles<decltype(rb)::value, NT>(b.q + r0, b.rows, kt, D, b.s[r0]);
    });
  }
  for (int64_t i = 0; i < b.rows; ++i)
    b.alpha[i] = softmax_step<NT>(b.s[i], key0, b.lo[i], b.pos[i], scale, softcap, b.m[i], b.l[i], b.p[i]);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = g * b.rows / groups, r1 = (g + 1) * b.rows / groups;
    with_count<kGroupRows>(static_cast<int>(r1 - r0), [&](auto rb) {
      constexpr int RB = decltype(rb)::value;
      int64_t d = 0;
      for (; d + 64 <= D; d += 64) pv_tiles<RB, 4>(b.p[r0], 8 * NT, vt + 2 * d, D, b.alpha + r0, b.acc + r0 * D + d);
      if (d < D) pv_tiles<RB, 2>(b.p[r0], 8 * NT, vt + 2 * d, D, b.alpha + r0, b.acc + r0 * D + d);
    });
  }
}

// One block of `rows` rows (row i at position row_pos[i]; q pairs qp [D/2][rows]) against key tiles
// [first_tile, first_tile + tiles), in key blocks of kKeyTiles tiles (the last one shorter): kp/vp
// the KV head's laid-out tiles from first_tile on; acc [rows][D] scratch; out rows [n, H, D].
// window, softcap: as paged_prefill_attention's.
void prefill_block(int64_t rows, const uint32_t* qp, const int64_t* row_pos, const uint16_t* kp, const uint16_t* vp,
                   int64_t first_tile, int64_t tiles, int64_t D, float scale, int64_t window, float softcap,
                   float* acc, uint16_t* const* out_rows) {
  PrefillRows b;
  b.rows = rows, b.q = qp, b.pos = row_pos, b.acc = acc;
  for (int64_t i = 0; i < rows; ++i) {
    b.m[i] = -INFINITY, b.l[i] = 0.f;
    b.lo[i] = window > 0 ? std::max<int64_t>(0, row_pos[i] - window + 1) : 0;
  }
  std::fill(acc, acc + rows * D, 0.f);
  for (int64_t t = 0; t < tiles; t += kKeyTiles) {
    with_count<kKeyTiles>(static_cast<int>(std::min<int64_t>(kKeyTiles, tiles - t)), [&](auto nt) {
      prefill_key_block<decltype(nt)::value>(b, kp + t * 16 * D, vp + t * 16 * D, (first_tile + t) * 16, D, scale,
                                             softcap);
    });
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float inv = b.l[i] > 0.f ? 1.f / b.l[i] : 0.f;
    for (int64_t d = 0; d < D; ++d) store(out_rows[i] + d, acc[i * D + d] * inv);
  }
}

// Tile t (16 positions) of KV head h laid out for the micro-kernels: keys as [D/2][16][2], values as
// [8][D][2], bf16; positions outside [first_key, ctx) stay as they are (zero). A bf16 cache's bits
// are copied; an 8-bit cache's rows are widened (kv_formats.h) and rounded to bf16 here.
template <typename C>
void lay_out_tile(const void* k_cache, const void* v_cache, const int64_t* tp, int64_t h, int64_t t,
                  int64_t first_key, int64_t ctx, int64_t D, int64_t BS, int64_t KVH, uint16_t* kt, uint16_t* vt) {
  const C* kc = static_cast<const C*>(k_cache);
  const C* vc = static_cast<const C*>(v_cache);
  const int64_t row = D / kValuesPer<C>, token_stride = KVH * row, block_stride = BS * token_stride;
  thread_local std::vector<float> kf, vf;
  kf.resize(D);
  vf.resize(D);
  for (int64_t j = std::max<int64_t>(0, first_key - t * 16); j < 16 && t * 16 + j < ctx; ++j) {
    const int64_t pos = t * 16 + j;
    const C* kr = kc + tp[pos / BS] * block_stride + (pos % BS) * token_stride + h * row;
    const C* vr = vc + tp[pos / BS] * block_stride + (pos % BS) * token_stride + h * row;
    if constexpr (std::is_same_v<C, uint16_t>) {
      for (int64_t d = 0; d < D; ++d) {
        kt[((d / 2) * 16 + j) * 2 + d % 2] = kr[d];
        vt[((j / 2) * D + d) * 2 + j % 2] = vr[d];
      }
    } else {
      load_row(kr, D, kf.data());
      load_row(vr, D, vf.data());
      for (int64_t d = 0; d < D; ++d) {
        store(kt + ((d / 2) * 16 + j) * 2 + d % 2, kf[d]);
        store(vt + ((j / 2) * D + d) * 2 + j % 2, vf[d]);
      }
    }
  }
}
#endif

}  // namespace

// q [n, H, D] bf16 (the chunk's queries, at positions ctx - n .. ctx - 1); caches [num_blocks,
// block_size, KVH, D] bf16 or 8-bit (q8_0: D / 32 * 34 bytes a row) holding the sequence's first ctx tokens (this chunk's written);
// block_table [width] int64 -> [n, H, D] bf16. window, softcap: see attention_decode.cpp (0: off).
at::Tensor paged_prefill_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, int64_t ctx, double scale, int64_t window,
                                   double softcap) {
  TORCH_CHECK(ISV_BF16_DOT, "paged_prefill_attention needs a build with AVX512-BF16");
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [n, H, D] and the caches [num_blocks, block_size, kv_heads, D]");
  TORCH_CHECK(q_in.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == v_cache.scalar_type() &&
              k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q must be bfloat16, the caches contiguous and of one dtype");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor table = block_table.contiguous();
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(D % 32 == 0 && H % KVH == 0 && H / KVH <= 24,
              "head_dim must be a multiple of 32; at most 24 query heads per KV head");
  const KVFormat fmt = kv_format(k_cache, D);
  TORCH_CHECK(fmt != KVFormat::kFloat, "the caches must be bfloat16 or 8-bit (kv_formats.h), not float32");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 1, "block_table must be a 1-d int64 tensor");
  TORCH_CHECK(n <= ctx && ctx <= table.size(0) * BS, "need n <= ctx <= the block table's capacity");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: off)");
  TORCH_CHECK(ctx < INT32_MAX, "context too long");  // key positions are compared as int32 lanes
  // the first key any query sees: the first query's window's (no key before it is read)
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, ctx - n - window + 1) : 0;
  const int64_t* tp = table.const_data_ptr<int64_t>();
  for (int64_t j = first_key / BS; j < (ctx + BS - 1) / BS; ++j)
    TORCH_CHECK(tp[j] >= 0 && tp[j] < k_cache.size(0), "block id ", tp[j], " is outside the cache");
  at::Tensor out = at::empty_like(q);
  if (n == 0) return out;
#if ISV_BF16_DOT
  const int64_t G = H / KVH, D2 = D / 2, t0 = first_key / 16, tiles = (ctx + 15) / 16 - t0;
  const int64_t qb = std::max<int64_t>(1, kAttnRows / G), qblocks = (n + qb - 1) / qb;
  // tiles t0 .. of K as [KVH][tile][D/2][16][2] and of V as [KVH][tile][8][D][2], zero outside
  // [first_key, ctx)
  std::vector<uint16_t> kp(KVH * tiles * 16 * D, 0), vp(KVH * tiles * 16 * D, 0);
  WorkPool::instance().run(KVH * tiles, [&](int64_t item) {
    const int64_t h = item / tiles, t = t0 + item % tiles;
    uint16_t* kt = kp.data() + item * 16 * D;
    uint16_t* vt = vp.data() + item * 16 * D;
    const void* kc = k_cache.const_data_ptr();
    const void* vc = v_cache.const_data_ptr();
    switch (fmt) {
      case KVFormat::kE4M3: lay_out_tile<Fp8E4M3>(kc, vc, tp, h, t, first_key, ctx, D, BS, KVH, kt, vt); break;
      case KVFormat::kE5M2: lay_out_tile<Fp8E5M2>(kc, vc, tp, h, t, first_key, ctx, D, BS, KVH, kt, vt); break;
      case KVFormat::kQ8: lay_out_tile<Q8Block>(kc, vc, tp, h, t, first_key, ctx, D, BS, KVH, kt, vt); break;
      default: lay_out_tile<uint16_t>(kc, vc, tp, h, t, first_key, ctx, D, BS, KVH, kt, vt); break;
    }
  });
  const uint16_t* qs = ptr<uint16_t>(q);
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float sc = static_cast<float>(scale);
  // one KV head at a time (its laid-out K/V, 2 x ctx x D bf16, stay in L2), the longest blocks (last
  // queries) first, so the pool's threads finish together
  WorkPool::instance().run(KVH * qblocks, [&](int64_t item) {
    thread_local std::vector<uint32_t> qp;
    thread_local std::vector<float> acc;
    const int64_t h = item / qblocks, b = qblocks - 1 - item % qblocks;
    const int64_t q0 = b * qb, nq = std::min(qb, n - q0), rows = nq * G;
    qp.assign(D2 * rows, 0);
    acc.resize(rows * D);
    int64_t row_pos[kAttnRows];
    uint16_t* out_rows[kAttnRows];
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t qi = q0 + r / G, head = h * G + r % G;
      row_pos[r] = ctx - n + qi;
      out_rows[r] = op + (qi * H + head) * D;
      const uint32_t* src = reinterpret_cast<const uint32_t*>(qs + (qi * H + head) * D);
      for (int64_t kq = 0; kq < D2; ++kq) qp[kq * rows + r] = src[kq];
    }
    // tiles from the one holding the block's first query's first key to its last query's position
    const int64_t first = window > 0 ? std::max<int64_t>(0, row_pos[0] - window + 1) / 16 : 0;
    const int64_t end = row_pos[rows - 1] / 16 + 1;
    const int64_t skip = (h * tiles + first - t0) * 16 * D;
    prefill_block(rows, qp.data(), row_pos, kp.data() + skip, vp.data() + skip, first, end - first, D, sc, window,
                  static_cast<float>(softcap), acc.data(), out_rows);
  });
#endif
  return out;
}

}  // namespace iterserve

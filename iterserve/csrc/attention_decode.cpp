// paged_decode_attention: one query row per sequence against its paged K/V blocks, read in place.
// The torch path copies every sequence's blocks into a padded tensor (index_select) and runs masked
// SDPA over the copy: ~15 small ops per layer, each waking the second thread. Takes a layer's sliding
// window (W > 0: a query at position p sees keys max(0, p - W + 1) .. p; the keys before are never
// read, nor their blocks' ids checked: they may be freed) and its logit soft-cap (c > 0: each scaled
// score s becomes c * tanh(s / c) before the softmax), as Hugging Face defines them for Mistral and
// Gemma 2 / 3; 0 turns either off. float32 or bf16 q; float32, bf16 or 8-bit caches (kv_formats.h:
// fp8 e4m3 / e5m2, q8_0 blocks), each value widened in registers as its row is read; float32
// accumulation.
#include "kernel_common.h"
#include "kernels.h"
#include "kv_formats.h"
#include "lanes.h"
#include "work_pool.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace iterserve {
namespace {

// q . k and acc += p * v over one head's D values (float q/acc; k, v float or bf16 bits). Written
// over the lanes (lanes.h) when D is a multiple of a vector (16 floats on AVX-512, 8 on AVX2): the
// vectoriser left the bf16 loops scalar, and the float32 dot too (it may not reorder a float sum).
// A dot keeps kDotChains accumulators: AVX2's one FMA chain would wait on its own latency, so it
// runs two (even and odd vectors, added before the reduction); AVX-512 runs one. The scalar build
// keeps the plain loops.
#if defined(__AVX512F__)
constexpr int kDotChains = 1;
#else
constexpr int kDotChains = 2;
#endif

template <typename C>
inline float dot(const float* q, const C* k, int64_t D) {
#if ISV_LANES
  if (D % kLW == 0) {
    LVec a0 = lv_zero(), a1 = lv_zero();
    int64_t d = 0;
    if constexpr (kDotChains == 2) {
      for (; d + 2 * kLW <= D; d += 2 * kLW) {
        a0 = lv_fma(lv_load(q + d), lv_load(k + d), a0);
        a1 = lv_fma(lv_load(q + d + kLW), lv_load(k + d + kLW), a1);
      }
    }
    for (; d < D; d += kLW) a0 = lv_fma(lv_load(q + d), lv_load(k + d), a0);
    return lv_sum(kDotChains == 2 ? lv_add(a0, a1) : a0);
  }
#endif
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += q[d] * load(k[d]);
  return s;
}

template <typename C>
inline void axpy(float p, const C* v, float* acc, int64_t D) {
#if ISV_LANES
  if (D % kLW == 0) {
    const LVec pv = lv_set1(p);
    for (int64_t d = 0; d < D; d += kLW) lv_store(acc + d, lv_fma(pv, lv_load(v + d), lv_load(acc + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) acc[d] += p * load(v[d]);
}

// The GQA group's query heads share each key and value load: GB heads (one pass; a group of more
// than kMaxPass heads runs in passes of near-equal size) take their GB dot products from one read
// of a key, and their GB axpys from one read of a value. Before, each (sequence, query head) was
// its own work item and re-read its group's K/V: the cache streamed at ~9 GB/s (Zen 5). Per head
// the arithmetic and its order are the old ones, so results are bit-identical to one head at a time.
#if defined(__AVX512F__)
#define ISV_DECODE_REGS_64 1  // decode_heads' register accumulators for head_dim 64
constexpr int kMaxPass = 8;  // 8 accumulators + the key: well inside 32 zmm registers
#else
#define ISV_DECODE_REGS_64 0
constexpr int kMaxPass = 4;  // two accumulators a head on AVX2: 8 of the 16 ymm registers
#endif

#if ISV_LANES
// s[g] = lv_sum(v[g]) for the GB heads, four at a time by lv_sum4 (the same bits): one reduction per
// head and key was most of the scores' work (a GQA group of 4: 4 FMAs a head a key at head_dim 64)
template <int GB>
inline void sum_group(const LVec* v, float* s) {
  int g = 0;
  for (; g + 4 <= GB; g += 4) lv_sum4(v[g], v[g + 1], v[g + 2], v[g + 3], s + g);
  for (; g < GB; ++g) s[g] = lv_sum(v[g]);
}
#endif

// s[g] = q[g] . k for the GB query rows q (stride D; float) against one key (float or bf16 bits),
// each head's chains and order as dot()'s.
template <int GB, typename C>
inline void dot_group(const float* q, const C* k, int64_t D, float* s) {
#if ISV_LANES
  if (D % kLW == 0) {
    LVec a0[GB], a1[GB];
    for (int g = 0; g < GB; ++g) a0[g] = a1[g] = lv_zero();
    int64_t d = 0;
    if constexpr (kDotChains == 2) {
      for (; d + 2 * kLW <= D; d += 2 * kLW) {
        const LVec k0 = lv_load(k + d), k1 = lv_load(k + d + kLW);
        for (int g = 0; g < GB; ++g) {
          a0[g] = lv_fma(lv_load(q + g * D + d), k0, a0[g]);
          a1[g] = lv_fma(lv_load(q + g * D + d + kLW), k1, a1[g]);
        }
      }
    }
    for (; d < D; d += kLW) {
      const LVec k0 = lv_load(k + d);
      for (int g = 0; g < GB; ++g) a0[g] = lv_fma(lv_load(q + g * D + d), k0, a0[g]);
    }
    if constexpr (kDotChains == 2)
      for (int g = 0; g < GB; ++g) a0[g] = lv_add(a0[g], a1[g]);
    sum_group<GB>(a0, s);
    return;
  }
#endif
  for (int g = 0; g < GB; ++g) s[g] = dot(q + g * D, k, D);
}

// acc[g] += p[g] * v for the GB accumulator rows acc (stride D) from one read of v.
template <int GB, typename C>
inline void axpy_group(const float* p, const C* v, float* acc, int64_t D) {
#if ISV_LANES
  if (D % kLW == 0) {
    LVec pv[GB];
    for (int g = 0; g < GB; ++g) pv[g] = lv_set1(p[g]);
    for (int64_t d = 0; d < D; d += kLW) {
      const LVec vv = lv_load(v + d);
      for (int g = 0; g < GB; ++g) lv_store(acc + g * D + d, lv_fma(pv[g], vv, lv_load(acc + g * D + d)));
    }
    return;
  }
#endif
  for (int g = 0; g < GB; ++g) axpy(p[g], v, acc + g * D, D);
}



// The same four over a q8_0 row (D / 32 blocks): each vector of int8 values is widened and scaled in
// registers (d * q is exact in float32), then used exactly as dot / axpy use a float32 row's vector,
// in the same chains and order: the results are those of the float32 row the blocks dequantise to.
inline float q8_scale(const Q8Block& b) {
#if defined(__F16C__)
  return _cvtsh_ss(b.d);
#else
  return half_to_float(b.d);
#endif
}
#if ISV_LANES
inline LVec lv_q8(const Q8Block& b, int i, LVec s) { return lv_mul(lv_load_i8(b.qs + i), s); }
#endif

inline float dot(const float* q, const Q8Block* k, int64_t D) {
#if ISV_LANES
  LVec a[2] = {lv_zero(), lv_zero()};
  for (int64_t b = 0; b < D / 32; ++b) {
    const LVec s = lv_set1(q8_scale(k[b]));
    for (int i = 0; i < 32; i += kLW) {
      LVec& acc = a[kDotChains == 2 ? (i / kLW) & 1 : 0];
      acc = lv_fma(lv_load(q + 32 * b + i), lv_q8(k[b], i, s), acc);
    }
  }
  return lv_sum(kDotChains == 2 ? lv_add(a[0], a[1]) : a[0]);
#else
  float s = 0.f;
  for (int64_t b = 0; b < D / 32; ++b) {
    const float sc = q8_scale(k[b]);
    for (int i = 0; i < 32; ++i) s += q[32 * b + i] * (sc * static_cast<float>(k[b].qs[i]));
  }
  return s;
#endif
}

inline void axpy(float p, const Q8Block* v, float* acc, int64_t D) {
#if ISV_LANES
  const LVec pv = lv_set1(p);
  for (int64_t b = 0; b < D / 32; ++b) {
    const LVec s = lv_set1(q8_scale(v[b]));
    for (int i = 0; i < 32; i += kLW) {
      float* a = acc + 32 * b + i;
      lv_store(a, lv_fma(pv, lv_q8(v[b], i, s), lv_load(a)));
    }
  }
#else
  for (int64_t b = 0; b < D / 32; ++b) {
    const float sc = q8_scale(v[b]);
    for (int i = 0; i < 32; ++i) acc[32 * b + i] += p * (sc * static_cast<float>(v[b].qs[i]));
  }
#endif
}

template <int GB>
inline void dot_group(const float* q, const Q8Block* k, int64_t D, float* s) {
#if ISV_LANES
  LVec a0[GB], a1[GB];
  for (int g = 0; g < GB; ++g) a0[g] = a1[g] = lv_zero();
  for (int64_t b = 0; b < D / 32; ++b) {
    const LVec sc = lv_set1(q8_scale(k[b]));
    for (int i = 0; i < 32; i += kLW) {
      const LVec kv = lv_q8(k[b], i, sc);
      const int64_t d = 32 * b + i;
      if (kDotChains == 2 && (i / kLW) & 1) {
        for (int g = 0; g < GB; ++g) a1[g] = lv_fma(lv_load(q + g * D + d), kv, a1[g]);
      } else {
        for (int g = 0; g < GB; ++g) a0[g] = lv_fma(lv_load(q + g * D + d), kv, a0[g]);
      }
    }
  }
  if constexpr (kDotChains == 2)
    for (int g = 0; g < GB; ++g) a0[g] = lv_add(a0[g], a1[g]);
  sum_group<GB>(a0, s);
#else
  for (int g = 0; g < GB; ++g) s[g] = dot(q + g * D, k, D);
#endif
}

template <int GB>
inline void axpy_group(const float* p, const Q8Block* v, float* acc, int64_t D) {
#if ISV_LANES
  LVec pv[GB];
  for (int g = 0; g < GB; ++g) pv[g] = lv_set1(p[g]);
  for (int64_t b = 0; b < D / 32; ++b) {
    const LVec sc = lv_set1(q8_scale(v[b]));
    for (int i = 0; i < 32; i += kLW) {
      const LVec vv = lv_q8(v[b], i, sc);
      const int64_t d = 32 * b + i;
      for (int g = 0; g < GB; ++g) lv_store(acc + g * D + d, lv_fma(pv[g], vv, lv_load(acc + g * D + d)));
    }
  }
#else
  for (int g = 0; g < GB; ++g) axpy(p[g], v, acc + g * D, D);
#endif
}

#if defined(__AVX512F__)
// a head_dim-64 row as four vectors of floats, for decode_heads' register accumulators
template <typename C>
inline void load_row64(const C* v, __m512* r) {
  for (int j = 0; j < 4; ++j) r[j] = lv_load(v + 16 * j);
}
inline void load_row64(const Q8Block* v, __m512* r) {
  for (int b = 0; b < 2; ++b) {
    const __m512 s = _mm512_set1_ps(q8_scale(v[b]));
    r[2 * b] = lv_q8(v[b], 0, s);
    r[2 * b + 1] = lv_q8(v[b], 16, s);
  }
}
#endif

#if defined(__AVX512F__)
// acc[g] += p[g * keys + i] * v_i over n value rows v_i of head_dim 64 (stride token_stride), the
// accumulators held in registers across the rows. Its own function with the accumulators copied in and
// out: inlined into decode_heads' loop, gcc kept them in registers but stored all GB x 4 to the
// stack after every row (its store motion failed), 16 stores a key at GB 4.
template <int GB, typename C>
[[gnu::noinline]] void v_block64(const C* v, int64_t n, int64_t token_stride, const float* p, int64_t keys,
                                 __m512 (&acc)[GB][4]) {
  __m512 a[GB][4];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = acc[g][j];
  for (int64_t i = 0; i < n; ++i, v += token_stride) {
    __m512 vr[4];
    load_row64(v, vr);
    for (int g = 0; g < GB; ++g) {
      const __m512 pv = _mm512_set1_ps(p[g * keys + i]);
      for (int j = 0; j < 4; ++j) a[g][j] = _mm512_fmadd_ps(pv, vr[j], a[g][j]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < 4; ++j) acc[g][j] = a[g][j];
}
#endif

// A block's rows of one KV head (BS token rows token_stride apart, `row_bytes` each) asked into
// cache ahead of their use. The decode loops walk a block's keys (then values) one token row at a
// time, 1 KiB or more apart; once the step's weights have pushed the KV out of cache, each row was
// a wait on memory (2-2.5x slower at 16 rows, docs/profile.md). So each loop asks for the rows
// kAheadBlocks blocks ahead as it enters a block, and the first blocks of both before the scores.
constexpr int64_t kAheadBlocks = 2;
template <typename C>
inline void prefetch_block_rows(const C* rows, int64_t BS, int64_t token_stride, int64_t row_bytes) {
#if defined(__AVX512F__) || ISV_AVX2_FMA
  for (int64_t o = 0; o < BS; ++o) prefetch(rows + o * token_stride, row_bytes);
#endif
}

// One pass: query heads h0 .. h0 + GB - 1 (all of KV head kvh) of sequence b.
template <int GB, typename T, typename C>
void decode_heads(const T* q, const C* k_cache, const C* v_cache, const int64_t* table, int64_t len,
                  int64_t first, T* out, int64_t b, int64_t h0, int64_t kvh, int64_t H, int64_t D, int64_t BS,
                  int64_t token_stride, int64_t block_stride, float scale, float softcap, int64_t ldq) {
  thread_local std::vector<float> qf, acc, scores;  // a thread keeps its scratch across items
  qf.resize(GB * D);
  acc.resize(GB * D);
  for (int g = 0; g < GB; ++g) {
    const T* qrow = q + b * ldq + (h0 + g) * D;
    int64_t d = 0;
#if ISV_LANES
    for (; d + kLW <= D; d += kLW) lv_store(qf.data() + g * D + d, lv_mul(lv_load(qrow + d), lv_set1(scale)));
#endif
    for (; d < D; ++d) qf[g * D + d] = load(qrow[d]) * scale;
  }
  const int64_t keys = len - first;
  scores.resize(GB * keys);
  float* sc = scores.data();  // sc[g * keys + i]: head h0 + g's score of the key at position first + i
  float mx[GB], s[GB];
  for (int g = 0; g < GB; ++g) mx[g] = -INFINITY;
  const int64_t row = D / kValuesPer<C>;  // elements of C in one head's row
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(C)), last_block = (len - 1) / BS;
  for (int64_t j = first / BS; len > first && j < std::min(last_block + 1, first / BS + kAheadBlocks); ++j) {
    // the first key blocks, and the first value blocks for after the scores
    prefetch_block_rows(k_cache + table[j] * block_stride + kvh * row, BS, token_stride, row_bytes);
    prefetch_block_rows(v_cache + table[j] * block_stride + kvh * row, BS, token_stride, row_bytes);
  }
  // the keys a block at a time: slots [o0, o1) of the block holding position t0 (o0 > 0 only in
  // the window's first block)
  for (int64_t t0 = first; t0 < len;) {
    const int64_t o0 = t0 % BS, o1 = std::min(BS, o0 + len - t0);
    const C* kb = k_cache + table[t0 / BS] * block_stride + kvh * row;
    if (t0 / BS + kAheadBlocks <= last_block)
      prefetch_block_rows(k_cache + table[t0 / BS + kAheadBlocks] * block_stride + kvh * row, BS, token_stride, row_bytes);
    for (int64_t o = o0; o < o1; ++o, ++t0) {
      dot_group<GB>(qf.data(), kb + o * token_stride, D, s);
      for (int g = 0; g < GB; ++g) {
        if (softcap > 0.f) s[g] = softcap * std::tanh(s[g] / softcap);
        sc[g * keys + t0 - first] = s[g];
        mx[g] = std::max(mx[g], s[g]);
      }
    }
  }
  float inv[GB];
  for (int g = 0; g < GB; ++g) {
    float* row = sc + g * keys;
    const float m = mx[g];
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < keys; ++i) {
      row[i] = exp_nonpositive(row[i] - m);
      sum += row[i];
    }
    inv[g] = len > 0 ? 1.f / sum : 0.f;
  }
  std::fill(acc.begin(), acc.end(), 0.f);
#if defined(__AVX512F__)
  // head_dim 64 (SmolLM2, Llama 3.2 1B): the GB x 4 accumulators stay in registers for the whole
  // value loop instead of a load and store per head per value; same FMAs, same order
  if constexpr (GB <= 6) {
    if (D == 64) {
      __m512 a[GB][4];
      for (int g = 0; g < GB; ++g)
        for (int j = 0; j < 4; ++j) a[g][j] = _mm512_setzero_ps();
      for (int64_t t0 = first; t0 < len;) {
        const int64_t o0 = t0 % BS, o1 = std::min(BS, o0 + len - t0);
        const C* vb = v_cache + table[t0 / BS] * block_stride + kvh * row;
        if (t0 / BS + kAheadBlocks <= last_block)
          prefetch_block_rows(v_cache + table[t0 / BS + kAheadBlocks] * block_stride + kvh * row, BS, token_stride, row_bytes);
        v_block64<GB>(vb + o0 * token_stride, o1 - o0, token_stride, sc + t0 - first, keys, a);
        t0 += o1 - o0;
      }
      for (int g = 0; g < GB; ++g)
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc.data() + g * D + 16 * j, a[g][j]);
    }
  }
#endif
  float p[GB];
  for (int64_t t0 = first; t0 < len && !(ISV_DECODE_REGS_64 && GB <= 6 && D == 64);) {
    const int64_t o0 = t0 % BS, o1 = std::min(BS, o0 + len - t0);
    const C* vb = v_cache + table[t0 / BS] * block_stride + kvh * row;
    if (t0 / BS + kAheadBlocks <= last_block)
      prefetch_block_rows(v_cache + table[t0 / BS + kAheadBlocks] * block_stride + kvh * row, BS, token_stride, row_bytes);
    for (int64_t o = o0; o < o1; ++o, ++t0) {
      for (int g = 0; g < GB; ++g) p[g] = sc[g * keys + t0 - first];
      axpy_group<GB>(p, vb + o * token_stride, acc.data(), D);
    }
  }
  for (int g = 0; g < GB; ++g) {
    T* orow = out + (b * H + h0 + g) * D;
    int64_t d = 0;
#if ISV_LANES  // the same products and roundings as store()'s, a vector at a time
    for (; d + kLW <= D; d += kLW) lv_store(orow + d, lv_mul(lv_load(acc.data() + g * D + d), lv_set1(inv[g])));
#endif
    for (; d < D; ++d) store(orow + d, acc[g * D + d] * inv[g]);
  }
}

// T: the element type of q/out (float or bf16 bits); C: of the caches.
template <typename T, typename C>
void decode_attention_impl(const T* q, const C* k_cache, const C* v_cache, const int64_t* tables,
                           const int64_t* lens, T* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                           int64_t BS, int64_t table_width, float scale, int64_t window, float softcap,
                           int64_t ldq) {
  const int64_t group = H / KVH;
  const int64_t token_stride = KVH * (D / kValuesPer<C>);  // elements of C between consecutive slots
  const int64_t block_stride = BS * token_stride;
  const int64_t passes = (group + kMaxPass - 1) / kMaxPass;
  // one item = one (sequence, KV head, pass over its query heads); each row's result is its own
  // arithmetic only, whatever else shares the call (the batch-invariant backend relies on it)
  WorkPool::instance().run(B * KVH * passes, [&](int64_t item) {
    const int64_t b = item / (KVH * passes), kvh = item / passes % KVH, pass = item % passes;
    // passes of near-equal size: heads [lo, hi) of the group
    const int64_t lo = pass * group / passes, hi = (pass + 1) * group / passes;
    const int64_t len = lens[b];
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;  // the window's first key
    const int64_t* table = tables + b * table_width;
    const int64_t h0 = kvh * group + lo;
#define ISV_PASS(N)                                                                                            \
  case N:                                                                                                      \
    decode_heads<N>(q, k_cache, v_cache, table, len, first, out, b, h0, kvh, H, D, BS, token_stride,           \
                    block_stride, scale, softcap, ldq);                                                        \
    break
    switch (hi - lo) {
      ISV_PASS(1); ISV_PASS(2); ISV_PASS(3); ISV_PASS(4);
#if defined(__AVX512F__)
      ISV_PASS(5); ISV_PASS(6); ISV_PASS(7); ISV_PASS(8);
#endif
      default: break;  // unreachable: 1 <= hi - lo <= kMaxPass (and no torch calls off the calling thread)
    }
#undef ISV_PASS
  });
}

}  // namespace

// q [B, H, D]; caches [num_blocks, block_size, KVH, D] (q8_0: D / 32 * 34 bytes a row); block_tables [B, width] int64;
// context_lens [B] int64 (tokens in cache, this step's included) -> [B, H, D] in q's dtype. window,
// softcap: see the top of this file (0: off).
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t window, double softcap) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [B, H, D] and the caches [num_blocks, block_size, kv_heads, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "the caches must be contiguous and of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  const at::Tensor q = dense_heads(q_in);  // rows may be strided
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0, "the GQA ratio does not match the caches");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  const KVFormat fmt = kv_format(k_cache, D);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && lens.numel() == B, "one table row and length per sequence");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: off)");
  at::Tensor out = at::empty({B, H, D}, q.options());
  if (B == 0) return out;
  const int64_t* lp = lens.const_data_ptr<int64_t>();
  const int64_t* tp = tables.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= tables.size(1) * BS, "context length ", lp[b], " exceeds its block table");
    const int64_t first = window > 0 ? std::max<int64_t>(0, lp[b] - window) : 0;  // blocks before: never read
    for (int64_t j = first / BS; j < (lp[b] + BS - 1) / BS; ++j)
      TORCH_CHECK(tp[b * tables.size(1) + j] >= 0 && tp[b * tables.size(1) + j] < k_cache.size(0),
                  "block id ", tp[b * tables.size(1) + j], " is outside the cache");
  }
  const auto qt = q.scalar_type();
#define ISV_CALL(T, C)                                                                                       \
  decode_attention_impl<T, C>(ptr<T>(q), reinterpret_cast<const C*>(k_cache.const_data_ptr()),              \
                              reinterpret_cast<const C*>(v_cache.const_data_ptr()), tp,                     \
                              lp, reinterpret_cast<T*>(out.data_ptr()), B, H, KVH, D, BS, tables.size(1),    \
                              static_cast<float>(scale), window, static_cast<float>(softcap), q.stride(0))
#define ISV_CACHES(T)                                                                                        \
  switch (fmt) {                                                                                             \
    case KVFormat::kFloat: ISV_CALL(T, float); break;                                                        \
    case KVFormat::kBF16: ISV_CALL(T, uint16_t); break;                                                      \
    case KVFormat::kE4M3: ISV_CALL(T, Fp8E4M3); break;                                                       \
    case KVFormat::kE5M2: ISV_CALL(T, Fp8E5M2); break;                                                       \
    case KVFormat::kQ8: ISV_CALL(T, Q8Block); break;                                                         \
  }
  if (qt == at::kBFloat16) {
    ISV_CACHES(uint16_t);
  } else {
    ISV_CACHES(float);
  }
#undef ISV_CACHES
#undef ISV_CALL
  return out;
}

}  // namespace iterserve

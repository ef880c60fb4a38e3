// CPU kernels for the parts of a decode step where torch's own kernels leave time on the table.
// Built on first use by iterserve/platform/cpu_kernels.py (torch.utils.cpp_extension, -O3
// -march=native); the engine falls back to its torch path when the build is not possible.
//
// paged_decode_attention: one query row per sequence against its blocks, read in place.
//   The torch path copies every sequence's blocks into a padded tensor (index_select) and runs
//   masked SDPA over the copy: ~15 small ops per layer, each waking the second thread.
// Both attention kernels take a layer's sliding window (window W > 0: a query at position p sees
//   keys max(0, p - W + 1) .. p; the keys before are never read, nor their blocks' ids checked: they
//   may be freed) and its logit soft-cap (softcap c > 0: each scaled score s becomes c * tanh(s / c)
//   before the softmax), as Hugging Face defines them for Mistral and Gemma 2 / 3; 0 turns either off.
// q4_gemm: the projections of steps of <= 8 rows from 4-bit weights (GGUF Q4_1 levels), where
//   reading the weights bounds the step.
// q8_0_gemm: the LM head in GGUF's Q8_0 layout (int8 weights, one float scale per 32), for steps of
//   a few rows.
// gguf_gemm: the decode twins of a GGUF checkpoint, from the file's own blocks (Q4_K, Q5_K, Q6_K,
//   Q8_0, Q5_0, Q5_1, Q4_0, Q4_1), several block types per fused projection.
// bf16_gemm: every other bf16 projection (decode batches and prefill), from weights laid out in
//   tiles of 16 outputs; 2.2x oneDNN's prepacked GEMM at 16 rows, even at 512 (Zen 4). The same
//   layout feeds AMX tiles for steps of many rows where the CPU has AMX.
// paged_prefill_attention: a prompt chunk's causal attention against its sequence's paged K/V,
//   flash-attention style on AVX512-BF16 (torch's CPU flash kernel was a third of a prefill step).
// rms_norm: RMSNorm of bf16 rows in one pass (eager torch runs it as eight ops); add_rms_norm: a
//   residual add and the norm after it, in one pass.
// silu_and_mul, rope: the gated MLP's SiLU-and-multiply and RoPE over q and k, one pass each, with
//   torch's bits (eager torch: 3 and 7 ops with their temporaries).
// f32_bf16w_gemm: float32 projections from bf16 weights on CPUs without fast bf16 (AVX2 + FMA):
//   half the bytes of a float32 weight, and none of MKL's small-M overhead.
// lora_sgmv: multi-LoRA deltas, each row through its own adapter slot's A and B only.
// All of them split their work through work_pool.h (why not torch's OpenMP pool: see there).
//
// Plain C++ loops written for the compiler's vectoriser (`omp simd`), so the file builds on any
// CPU gcc targets, with AVX-512 (and, for CPUs without it, AVX2) intrinsics where the vectoriser
// fell short; float32 accumulation.
#include <torch/extension.h>

#include "work_pool.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using iterserve::WorkPool;

inline float load(float x) { return x; }
inline float load(uint16_t bits) {  // bfloat16 -> float32 is a 16-bit shift
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// AVX2 + FMA (every x86-64 CPU of the last decade, AVX-512 ones too): the float32 x bf16-weight
// GEMM and the decode attention's float32 paths where AVX-512 is missing
#if defined(__AVX2__) && defined(__FMA__)
#define ISV_AVX2_FMA 1
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bfloat16 -> float32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#define ISV_AVX2_FMA 0
#endif
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (std::isnan(x)) { *p = 0x7fc0; return; }
  u += 0x7fff + ((u >> 16) & 1);
  *p = static_cast<uint16_t>(u >> 16);
}

// exp(x) for x <= 0 in plain arithmetic, so that `omp simd` loops vectorise it (std::exp stays a
// scalar call; it was the largest part of a batch-16 layer). Range reduction to 2^n * exp(r),
// |r| <= ln2/2, and a degree-6 polynomial: relative error ~2e-7, below float32's own rounding of
// the softmax sums. x is clamped at -87 (e^-87 ~ 1.6e-38: nothing a softmax sum can tell from 0).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504089f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

// q . k and acc += p * v over one head's D values (float q/acc; k, v float or bf16 bits). Written
// out for AVX-512 when D is a multiple of 16 (else AVX2 when a multiple of 8): the vectoriser left
// the bf16 loops scalar, and the float32 dot too (it may not reorder a float sum).
template <typename C>
inline float dot(const float* q, const C* k, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif ISV_AVX2_FMA
  if (D % 8 == 0) {  // two accumulators: one FMA chain would wait on its own latency
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), a1);
    }
    if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
    return reduce_add8(_mm256_add_ps(a0, a1));
  }
#endif
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += q[d] * load(k[d]);
  return s;
}

template <typename C>
inline void axpy(float p, const C* v, float* acc, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(acc + d)));
    return;
  }
#elif ISV_AVX2_FMA
  if (D % 8 == 0) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(acc + d)));
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

// s[g] = q[g] . k for the GB query rows q (stride D; float) against one key (float or bf16 bits).
template <int GB, typename C>
inline void dot_group(const float* q, const C* k, int64_t D, float* s) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 a[GB];
    for (int g = 0; g < GB; ++g) a[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 kv = load16(k + d);
      for (int g = 0; g < GB; ++g) a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), kv, a[g]);
    }
    for (int g = 0; g < GB; ++g) s[g] = _mm512_reduce_add_ps(a[g]);
    return;
  }
#elif ISV_AVX2_FMA
  if (D % 8 == 0) {  // two accumulators a head, as dot() has
    __m256 a0[GB], a1[GB];
    for (int g = 0; g < GB; ++g) a0[g] = a1[g] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      const __m256 k0 = load8(k + d), k1 = load8(k + d + 8);
      for (int g = 0; g < GB; ++g) {
        a0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), k0, a0[g]);
        a1[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d + 8), k1, a1[g]);
      }
    }
    if (d < D) {
      const __m256 k0 = load8(k + d);
      for (int g = 0; g < GB; ++g) a0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), k0, a0[g]);
    }
    for (int g = 0; g < GB; ++g) s[g] = reduce_add8(_mm256_add_ps(a0[g], a1[g]));
    return;
  }
#endif
  for (int g = 0; g < GB; ++g) s[g] = dot(q + g * D, k, D);
}

// acc[g] += p[g] * v for the GB accumulator rows acc (stride D) from one read of v.
template <int GB, typename C>
inline void axpy_group(const float* p, const C* v, float* acc, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 pv[GB];
    for (int g = 0; g < GB; ++g) pv[g] = _mm512_set1_ps(p[g]);
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 vv = load16(v + d);
      for (int g = 0; g < GB; ++g)
        _mm512_storeu_ps(acc + g * D + d, _mm512_fmadd_ps(pv[g], vv, _mm512_loadu_ps(acc + g * D + d)));
    }
    return;
  }
#elif ISV_AVX2_FMA
  if (D % 8 == 0) {
    __m256 pv[GB];
    for (int g = 0; g < GB; ++g) pv[g] = _mm256_set1_ps(p[g]);
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 vv = load8(v + d);
      for (int g = 0; g < GB; ++g)
        _mm256_storeu_ps(acc + g * D + d, _mm256_fmadd_ps(pv[g], vv, _mm256_loadu_ps(acc + g * D + d)));
    }
    return;
  }
#endif
  for (int g = 0; g < GB; ++g) axpy(p[g], v, acc + g * D, D);
}

#if defined(__AVX512F__) || ISV_AVX2_FMA
// Asks for `bytes` from p into cache, a 64-byte line at a time.
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}

// A weight stream read `bytes` at a time from p asks for the lines kStreamAhead bytes further on
// (none at or past `end`). Asking for whole rows 16 rows ahead, as the other GEMMs do, put the
// request 74 KB ahead for a 4.6 KB row (a 1B's Q4_K down projection, K = 8192), out of L1 before
// its use, and sent a row's 18-72 requests at once (docs/profile.md: 1.32-1.43x at one activation
// row on the down projections, 1.04-1.26x on the others).
constexpr int64_t kStreamAhead = 4096;
inline void prefetch_stream(const uint8_t* p, int64_t bytes, const uint8_t* end) {
  const uint8_t* a = p + kStreamAhead;
  for (int64_t off = 0; off < bytes + 63 && a + off < end; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(a + off), _MM_HINT_T0);
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
                  int64_t token_stride, int64_t block_stride, float scale, float softcap) {
  thread_local std::vector<float> qf, acc, scores;  // a thread keeps its scratch across items
  qf.resize(GB * D);
  acc.resize(GB * D);
  for (int g = 0; g < GB; ++g) {
    const T* qrow = q + (b * H + h0 + g) * D;
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load(qrow[d]) * scale;
  }
  const int64_t keys = len - first;
  scores.resize(GB * keys);
  float* sc = scores.data();  // sc[g * keys + i]: head h0 + g's score of the key at position first + i
  float mx[GB], s[GB];
  for (int g = 0; g < GB; ++g) mx[g] = -INFINITY;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(C)), last_block = (len - 1) / BS;
  for (int64_t j = first / BS; len > first && j < std::min(last_block + 1, first / BS + kAheadBlocks); ++j) {
    // the first key blocks, and the first value blocks for after the scores
    prefetch_block_rows(k_cache + table[j] * block_stride + kvh * D, BS, token_stride, row_bytes);
    prefetch_block_rows(v_cache + table[j] * block_stride + kvh * D, BS, token_stride, row_bytes);
  }
  // the keys a block at a time: slots [o0, o1) of the block holding position t0 (o0 > 0 only in
  // the window's first block)
  for (int64_t t0 = first; t0 < len;) {
    const int64_t o0 = t0 % BS, o1 = std::min(BS, o0 + len - t0);
    const C* kb = k_cache + table[t0 / BS] * block_stride + kvh * D;
    if (t0 / BS + kAheadBlocks <= last_block)
      prefetch_block_rows(k_cache + table[t0 / BS + kAheadBlocks] * block_stride + kvh * D, BS, token_stride, row_bytes);
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
        const C* vb = v_cache + table[t0 / BS] * block_stride + kvh * D;
        if (t0 / BS + kAheadBlocks <= last_block)
          prefetch_block_rows(v_cache + table[t0 / BS + kAheadBlocks] * block_stride + kvh * D, BS, token_stride, row_bytes);
        for (int64_t o = o0; o < o1; ++o, ++t0) {
          const C* v = vb + o * token_stride;
          const __m512 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
          for (int g = 0; g < GB; ++g) {
            const __m512 pv = _mm512_set1_ps(sc[g * keys + t0 - first]);
            a[g][0] = _mm512_fmadd_ps(pv, v0, a[g][0]);
            a[g][1] = _mm512_fmadd_ps(pv, v1, a[g][1]);
            a[g][2] = _mm512_fmadd_ps(pv, v2, a[g][2]);
            a[g][3] = _mm512_fmadd_ps(pv, v3, a[g][3]);
          }
        }
      }
      for (int g = 0; g < GB; ++g)
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc.data() + g * D + 16 * j, a[g][j]);
    }
  }
#endif
  float p[GB];
  for (int64_t t0 = first; t0 < len && !(ISV_DECODE_REGS_64 && GB <= 6 && D == 64);) {
    const int64_t o0 = t0 % BS, o1 = std::min(BS, o0 + len - t0);
    const C* vb = v_cache + table[t0 / BS] * block_stride + kvh * D;
    if (t0 / BS + kAheadBlocks <= last_block)
      prefetch_block_rows(v_cache + table[t0 / BS + kAheadBlocks] * block_stride + kvh * D, BS, token_stride, row_bytes);
    for (int64_t o = o0; o < o1; ++o, ++t0) {
      for (int g = 0; g < GB; ++g) p[g] = sc[g * keys + t0 - first];
      axpy_group<GB>(p, vb + o * token_stride, acc.data(), D);
    }
  }
  for (int g = 0; g < GB; ++g) {
    T* orow = out + (b * H + h0 + g) * D;
    for (int64_t d = 0; d < D; ++d) store(orow + d, acc[g * D + d] * inv[g]);
  }
}

// T: the element type of q/out (float or bf16 bits); C: of the caches.
template <typename T, typename C>
void decode_attention_impl(const T* q, const C* k_cache, const C* v_cache, const int64_t* tables,
                           const int64_t* lens, T* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                           int64_t BS, int64_t table_width, float scale, int64_t window, float softcap) {
  const int64_t group = H / KVH;
  const int64_t token_stride = KVH * D;   // elements between consecutive slots
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
                    block_stride, scale, softcap);                                                             \
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

template <typename T>
const T* ptr(const at::Tensor& t) { return reinterpret_cast<const T*>(t.const_data_ptr()); }

// q [B, H, D]; caches [num_blocks, block_size, KVH, D]; block_tables [B, width] int64;
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
  const at::Tensor q = q_in.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head_dim or the GQA ratio does not match the caches");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && lens.numel() == B, "one table row and length per sequence");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: off)");
  at::Tensor out = at::empty_like(q);
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
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  TORCH_CHECK((qt == at::kFloat || qt == at::kBFloat16) && (ct == at::kFloat || ct == at::kBFloat16),
              "float32 or bfloat16 only");
#define ISV_CALL(T, C)                                                                                       \
  decode_attention_impl<T, C>(ptr<T>(q), ptr<C>(k_cache), ptr<C>(v_cache), tp,                              \
                              lp, reinterpret_cast<T*>(out.data_ptr()), B, H, KVH, D, BS, tables.size(1),    \
                              static_cast<float>(scale), window, static_cast<float>(softcap))
  if (qt == at::kBFloat16 && ct == at::kBFloat16) ISV_CALL(uint16_t, uint16_t);
  else if (qt == at::kFloat && ct == at::kBFloat16) ISV_CALL(float, uint16_t);
  else if (qt == at::kBFloat16 && ct == at::kFloat) ISV_CALL(uint16_t, float);
  else ISV_CALL(float, float);
#undef ISV_CALL
  return out;
}

// Rows of a quantised weight are a few hundred bytes: the GEMMs below ask for the row this many
// ahead, or each row's loads wait on memory (120 projections at 1 row: 3.9 vs 5.1 ms, Zen 4).
constexpr int64_t kPrefetchRows = 16;
constexpr int64_t kRanges = 16;  // a GEMM's output rows, split for the work pool

// ---- Q8_0 GEMM: out[m, n] = sum_k x[m, k] * w[n, k] * scale[n, k / 32] --------------------------------
// MB rows of x share each weight group as it is widened to float; the accumulators stay 32 wide
// until the end of the row, as in llama.cpp's Q8_0 dot. On AVX-512 written with intrinsics (the
// vectoriser made the portable loop 5x slower: 4.9 vs 0.84 ms for a 49152 x 576 head at 1 row).
template <int MB, typename T>
void q8_0_rows(const float* x, int64_t K, const int8_t* w, const float* scales, T* out, int64_t N,
               int64_t n0, int64_t n1) {
  constexpr int Q = 32;
  const int64_t groups = K / Q;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * K;
    const float* sr = scales + n * groups;
#if defined(__AVX512F__)
    const int64_t ahead = std::min(n + kPrefetchRows, N - 1);
    prefetch(w + ahead * K, K);
    prefetch(scales + ahead * groups, groups * sizeof(float));
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 s = _mm512_set1_ps(sr[g]);
      const __m512 w0 = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + g * Q)))));
      const __m512 w1 = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + g * Q + 16)))));
      for (int m = 0; m < MB; ++m) {
        const float* xr = x + m * K + g * Q;
        acc[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[m]);
        acc[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) store(out + m * N + n, _mm512_reduce_add_ps(acc[m]));
#else
    float acc[MB] = {};
    for (int64_t g = 0; g < groups; ++g) {
      for (int m = 0; m < MB; ++m) {
        const float* xr = x + m * K + g * Q;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int i = 0; i < Q; ++i) s += static_cast<float>(wr[g * Q + i]) * xr[i];
        acc[m] += s * sr[g];
      }
    }
    for (int m = 0; m < MB; ++m) store(out + m * N + n, acc[m]);
#endif
  }
}

template <typename T>
void q8_0_gemm_impl(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scales, T* out, int64_t N) {
  // a few long ranges (interleaved short chunks broke the hardware prefetcher's streams: 1.09 vs
  // 0.75 ms for a 49152 x 576 head), walked 64 rows at a time so every x row reuses them from cache
  iterserve::parallel_ranges(N, kRanges, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += 64) {
      const int64_t n1 = std::min(end, n0 + 64);
      for (int64_t m = 0; m < M;) {
        const int64_t left = M - m;
        if (left >= 4) { q8_0_rows<4>(x + m * K, K, w, scales, out + m * N, N, n0, n1); m += 4; }
        else if (left >= 2) { q8_0_rows<2>(x + m * K, K, w, scales, out + m * N, N, n0, n1); m += 2; }
        else { q8_0_rows<1>(x + m * K, K, w, scales, out + m * N, N, n0, n1); m += 1; }
      }
    }
  });
}

// x [M, K] float32 or bfloat16; w [N, K] int8; scales [N, K / 32] float32 -> [M, N] in x's dtype.
at::Tensor q8_0_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be [M, K] float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && w.dim() == 2 && w.size(1) == K && w.scalar_type() == at::kChar && w.is_contiguous(),
              "w must be contiguous [N, K] int8 with K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / 32),
              "scales must be contiguous [N, K / 32] float32");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  if (x.scalar_type() == at::kFloat)
    q8_0_gemm_impl(xf.const_data_ptr<float>(), M, K, w.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                   out.data_ptr<float>(), N);
  else
    q8_0_gemm_impl(xf.const_data_ptr<float>(), M, K, w.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                   reinterpret_cast<uint16_t*>(out.data_ptr()), N);
  return out;
}

// ---- Q4 GEMM (GGUF Q4_1 levels): w[n, k] = d[n, b] * q[n, k] + m[n, b], q in 0..15, b = k / 32 ------
// Decoding a few sequences reads every weight once per token, so the weights stay 4-bit. Each
// activation row is quantised to int16 with one scale (dx: 2^-15 of the row's largest value, so an
// element's absolute error stays below what bf16 rounding gives it unless it is 100x smaller than
// the row's largest, where its share of the dot is as small), and each 32-weight block is one
// s16 x s16 dot instruction (AVX512-VNNI vpdpwssd):
//   sum_k x w = dx * sum_b d_b sum_{k in b} q xq  +  sum_b m_b sum_{k in b} x.
// (llama.cpp quantises activations to int8 per 32: twice the dot rate, but on this model the logits
// then drifted ~4x further from float32 than with bf16 activations.)
// Layout, made by pack_q4_1 (cpu_linear.py): qs [N, K/2] uint8, chunk c's byte i = q[64c+i] | q[64c+32+i] << 4;
// d and m [N, K/32] float16 (GGUF's own types).
// the instructions q4_rows's fast path needs (else AVX2 + FMA); q4_gemm_is_vectorised() reports
// either to Python
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ISV_Q4_VNNI 1
#else
#define ISV_Q4_VNNI 0
#endif

struct Q4Rows {  // quantised activation rows
  const int16_t* xq;  // [M, K]
  const float* dx;    // [M]: one scale a row
  const float* sx;    // [M, K/32]: the exact float sum of x over each block
  int64_t K;
  Q4Rows at(int64_t m) const { return {xq + m * K, dx + m, sx + m * (K / 32), K}; }
};

template <int MB, typename T>
void q4_rows(const Q4Rows& a, const uint8_t* qs, const at::Half* d, const at::Half* mn, T* out, int64_t N,
             int64_t n0, int64_t n1) {
  const int64_t K = a.K, chunks = K / 64, blocks = K / 32;
#if ISV_Q4_VNNI
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = qs + n * (K / 2);
    const at::Half* dr = d + n * blocks;
    const at::Half* mr = mn + n * blocks;
    const int64_t ahead = std::min(n + kPrefetchRows, N - 1);
    prefetch(qs + ahead * (K / 2), K / 2);
    prefetch(d + ahead * blocks, blocks * sizeof(at::Half));
    prefetch(mn + ahead * blocks, blocks * sizeof(at::Half));
    float mins[MB] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const float mb = static_cast<float>(mr[b]);
      for (int m = 0; m < MB; ++m) mins[m] += mb * a.sx[m * blocks + b];
    }
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + c * 32));
      const __m512i w0 = _mm512_cvtepu8_epi16(_mm256_and_si256(bytes, low4));
      const __m512i w1 = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4));
      const __m512 d0 = _mm512_set1_ps(static_cast<float>(dr[2 * c])), d1 = _mm512_set1_ps(static_cast<float>(dr[2 * c + 1]));
      for (int m = 0; m < MB; ++m) {
        const int16_t* xr = a.xq + m * K + c * 64;
        const __m512i s0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(xr));
        const __m512i s1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w1, _mm512_loadu_si512(xr + 32));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), d0, acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), d1, acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m)
      store(out + m * N + n, _mm512_reduce_add_ps(acc[m]) * a.dx[m] + mins[m]);
  }
#elif ISV_AVX2_FMA
  // AVX2 (float32 engines on CPUs without AVX-512): the same sums, each 32-weight block widened to
  // int16 and multiplied by vpmaddwd (pairs of s16 x s16 into s32, 4 products a lane at most:
  // 4 x 15 x 32767, far from overflow). Every loop over the accumulators is unrolled, as in
  // f32_bf16w_tile (else gcc keeps them in memory).
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = qs + n * (K / 2);
    const at::Half* dr = d + n * blocks;
    const at::Half* mr = mn + n * blocks;
    const int64_t ahead = std::min(n + kPrefetchRows, N - 1);
    prefetch(qs + ahead * (K / 2), K / 2);
    prefetch(d + ahead * blocks, blocks * sizeof(at::Half));
    prefetch(mn + ahead * blocks, blocks * sizeof(at::Half));
    float mins[MB] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const float mb = static_cast<float>(mr[b]);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) mins[m] += mb * a.sx[m * blocks + b];
    }
    __m256 acc[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + c * 32));
      const __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      const __m256i w0a = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));
      const __m256i w0b = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
      const __m256i w1a = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));
      const __m256i w1b = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
      const __m256 d0 = _mm256_set1_ps(static_cast<float>(dr[2 * c])), d1 = _mm256_set1_ps(static_cast<float>(dr[2 * c + 1]));
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m256i* xr = reinterpret_cast<const __m256i*>(a.xq + m * K + c * 64);
        const __m256i s0 = _mm256_add_epi32(_mm256_madd_epi16(w0a, _mm256_loadu_si256(xr)),
                                            _mm256_madd_epi16(w0b, _mm256_loadu_si256(xr + 1)));
        const __m256i s1 = _mm256_add_epi32(_mm256_madd_epi16(w1a, _mm256_loadu_si256(xr + 2)),
                                            _mm256_madd_epi16(w1b, _mm256_loadu_si256(xr + 3)));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), d0, acc[m]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), d1, acc[m]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) store(out + m * N + n, reduce_add8(acc[m]) * a.dx[m] + mins[m]);
  }
#else
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = qs + n * (K / 2);
    float acc[MB] = {}, macc[MB] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c = b / 2, h = b % 2;
      const float db = static_cast<float>(d[n * blocks + b]), mb = static_cast<float>(mn[n * blocks + b]);
      for (int m = 0; m < MB; ++m) {
        int32_t isum = 0;
        for (int i = 0; i < 32; ++i) {
          const int q = h ? qr[c * 32 + i] >> 4 : qr[c * 32 + i] & 0x0F;
          isum += q * a.xq[m * K + b * 32 + i];
        }
        acc[m] += db * static_cast<float>(isum);
        macc[m] += mb * a.sx[m * blocks + b];
      }
    }
    for (int m = 0; m < MB; ++m) store(out + m * N + n, acc[m] * a.dx[m] + macc[m]);
  }
#endif
}

// x [M, K] float32 or bfloat16; qs [N, K/2] uint8; d, m [N, K/32] float16 -> [M, N] in x's dtype.
at::Tensor q4_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mn) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be [M, K] float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  TORCH_CHECK(K % 64 == 0 && qs.dim() == 2 && qs.size(1) == K / 2 && qs.scalar_type() == at::kByte &&
              qs.is_contiguous(), "qs must be contiguous [N, K/2] uint8 with K a multiple of 64");
  for (const at::Tensor* t : {&d, &mn})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == N * (K / 32),
                "scales and mins must be contiguous [N, K/32] float16");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  // the activations, quantised once on the calling thread (M x K is tiny next to the weights)
  std::vector<int16_t> xq(M * K);
  std::vector<float> dx(M), sx(M * (K / 32));
  const float* xp = xf.const_data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (int64_t k = 0; k < K; ++k) xq[m * K + k] = static_cast<int16_t>(std::nearbyint(xr[k] * inv));
    dx[m] = amax / 32767.f;
    for (int64_t b = 0; b < K / 32; ++b) {
      float sum = 0.f;
      for (int i = 0; i < 32; ++i) sum += xr[b * 32 + i];
      sx[m * (K / 32) + b] = sum;
    }
  }
  const Q4Rows rows{xq.data(), dx.data(), sx.data(), K};
  const uint8_t* qp = qs.const_data_ptr<uint8_t>();
  const at::Half* dp = d.const_data_ptr<at::Half>();
  const at::Half* mp = mn.const_data_ptr<at::Half>();
  auto run = [&](auto* op) {
    iterserve::parallel_ranges(N, kRanges, [&](int64_t begin, int64_t end) {  // as in q8_0_gemm
      for (int64_t n0 = begin; n0 < end; n0 += 32) {
        const int64_t n1 = std::min(end, n0 + 32);
        for (int64_t m = 0; m < M;) {
          const int64_t left = M - m;
          if (left >= 8) { q4_rows<8>(rows.at(m), qp, dp, mp, op + m * N, N, n0, n1); m += 8; }
          else if (left >= 4) { q4_rows<4>(rows.at(m), qp, dp, mp, op + m * N, N, n0, n1); m += 4; }
          else if (left >= 2) { q4_rows<2>(rows.at(m), qp, dp, mp, op + m * N, N, n0, n1); m += 2; }
          else { q4_rows<1>(rows.at(m), qp, dp, mp, op + m * N, N, n0, n1); m += 1; }
        }
      }
    });
  };
  if (x.scalar_type() == at::kFloat) run(out.data_ptr<float>());
  else run(reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

bool q4_gemm_is_vectorised() { return ISV_Q4_VNNI || ISV_AVX2_FMA; }


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
enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

constexpr bool is_kquant(int64_t t) { return t == kQ4_K || t == kQ5_K || t == kQ6_K; }
constexpr int64_t kquant_bytes(int64_t t) { return t == kQ4_K ? 144 : t == kQ5_K ? 176 : 210; }  // per 256 inputs
constexpr int64_t x4_header(int64_t t) {  // bytes before a group's levels
  return 8 + ((t == kQ4_1 || t == kQ5_1) ? 8 : 0) + ((t == kQ5_0 || t == kQ5_1) ? 16 : 0);
}
constexpr int64_t x4_bytes(int64_t t) { return x4_header(t) + (t == kQ8_0 ? 128 : 64); }  // per 128 inputs
constexpr bool has_min(int64_t t) { return t == kQ4_1 || t == kQ5_1 || t == kQ4_K || t == kQ5_K; }
constexpr int x4_offset(int64_t t) { return t == kQ4_0 ? 8 : t == kQ5_0 ? 16 : 0; }  // level - offset

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

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and mins from their 12 packed bytes, a byte each in
// two words (llama.cpp's get_scale_min_k4, on whole words: no byte stores for a vector load to wait on)
inline void k4_scales(const uint8_t* q, uint64_t& sc, uint64_t& mn) {
  uint32_t u[3];
  std::memcpy(u, q, 12);
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  sc = (u[0] & k1) | static_cast<uint64_t>((u[2] & k2) | (((u[0] >> 6) & k3) << 4)) << 32;
  mn = (u[1] & k1) | static_cast<uint64_t>(((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4)) << 32;
}
inline int16_t byte_of(uint64_t v, int i) { return static_cast<int16_t>((v >> (8 * i)) & 0xFF); }

struct GgRows {  // the quantised activation rows
  const int16_t* xq;   // [M, K], in input order (K-quant blocks)
  const int16_t* xq4;  // [M, K4], each 128 inputs in the x4 order (32-input blocks); null when unused
  const float* dx;     // [M]: one scale a row
  const float* sx;     // [M, K4 / 32]: float32 sum of x over each 32 inputs (not quantised), zero past K
  int64_t K, K4;
  GgRows at(int64_t m) const {
    return {xq + m * K, xq4 ? xq4 + m * K4 : nullptr, dx + m, sx + m * (K4 / 32), K, K4};
  }
};

#if ISV_GG_AVX512 || ISV_GG_AVX2
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
    const __m256i m8 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn)));
    const __m256 mv = _mm256_mul_ps(_mm256_set1_ps(f16_at(b + 2)), _mm256_cvtepi32_ps(m8));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) k[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(a.sx + m * B4 + sb * 8), k[m]);
  }
  // group g of four 32-input blocks, whose four f16 mins sit at gb + 8
  void add_blocks(const uint8_t* gb, const GgRows& a, int64_t B4, int64_t g) {
    const __m128 mv = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gb + 8)));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) b4[m] = _mm_fmadd_ps(mv, _mm_loadu_ps(a.sx + m * B4 + 4 * g), b4[m]);
  }
  float total(int m) const {
    if constexpr (!has_min(TYPE)) return 0.f;
    else if constexpr (is_kquant(TYPE)) return -reduce_add8(k[m]);
    else return reduce_add8(_mm256_insertf128_ps(_mm256_setzero_ps(), b4[m], 0));
  }
};
#endif

// Out[m, n] for n in [n0, n1) of one shard: w its first row, `last` its last row index (prefetch).
template <int64_t TYPE, int MB, typename T>
void gg_rows(const GgRows& a, const uint8_t* w, int64_t row_bytes, T* out, int64_t ldo, int64_t n0, int64_t n1,
             int64_t last) {
  const int64_t K = a.K, B4 = a.K4 / 32;
  constexpr bool KQ = is_kquant(TYPE);
  [[maybe_unused]] const uint8_t* wend = w + (last + 1) * row_bytes;  // the shard's end
#if ISV_GG_AVX512
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m512 acc[MB];
    GgMins<TYPE, MB> mins;
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    if constexpr (KQ) {
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* b = wr + sb * kquant_bytes(TYPE);
        prefetch_stream(b, kquant_bytes(TYPE), wend);
        // NA int32 accumulators a row (few rows: a single chain of dependent dots would bound the loop)
        constexpr int NA = MB == 1 ? 4 : MB == 2 ? 2 : 1;
        __m512i is[MB][NA];
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m)
          for (int i = 0; i < NA; ++i) is[m][i] = _mm512_setzero_si512();
        float d;
        if constexpr (TYPE == kQ6_K) {
          const uint8_t *ql = b, *qh = b + 128;
          d = f16_at(b + 208);
          const __m512i sc = _mm512_castsi256_si512(
              _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
          const __m256i m30 = _mm256_set1_epi8(0x30);
          for (int h = 0; h < 2; ++h) {
            const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30)),
                _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(hb, m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30))};
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
                                                    _mm512_loadu_si512(a.xq + m * K + sb * 256 + 128 * h + 32 * s));
            }
          }
        } else {
          uint64_t sc, mn;
          d = f16_at(b);
          k4_scales(b + 4, sc, mn);
          mins.add_kquant(b, mn, a, B4, sb);
          const uint8_t* qs = b + (TYPE == kQ5_K ? 48 : 16);
          __m256i qh = _mm256_setzero_si256();
          if constexpr (TYPE == kQ5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
          const __m256i m10 = _mm256_set1_epi8(0x10);
          const __m512i scz = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
          for (int j = 0; j < 4; ++j) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
            __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            if constexpr (TYPE == kQ5_K) {  // bit s of qh[i]: bit 4 of sub-block s's input i
              const int s = 2 * j;  // s <= 6: shift left by 4 - s or right by s - 4, then keep bit 4
              const __m256i h0 = s <= 4 ? _mm256_slli_epi16(qh, 4 - s) : _mm256_srli_epi16(qh, s - 4);
              const __m256i h1 = s + 1 <= 4 ? _mm256_slli_epi16(qh, 3 - s) : _mm256_srli_epi16(qh, s - 3);
              lo = _mm256_or_si256(lo, _mm256_and_si256(h0, m10));
              hi = _mm256_or_si256(hi, _mm256_and_si256(h1, m10));
            }
            const __m512i s0 = _mm512_permutexvar_epi16(_mm512_set1_epi16(2 * j), scz);  // sub-block 2j's scale
            const __m512i s1 = _mm512_permutexvar_epi16(_mm512_set1_epi16(2 * j + 1), scz);
            const __m512i w0 = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(lo), s0);
            const __m512i w1 = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(hi), s1);
#pragma GCC unroll 8
            for (int m = 0; m < MB; ++m) {
              const int16_t* xr = a.xq + m * K + sb * 256 + 64 * j;
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
      for (int64_t g = 0; g < a.K4 / 128; ++g) {
        const uint8_t* gb = wr + g * x4_bytes(TYPE);
        prefetch_stream(gb, x4_bytes(TYPE), wend);
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
          const int16_t* xr = a.xq4 + m * a.K4 + g * 128;
          __m512i i0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wv[0], _mm512_loadu_si512(xr));
          __m512i i1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wv[1], _mm512_loadu_si512(xr + 32));
          i0 = _mm512_dpwssd_epi32(i0, wv[2], _mm512_loadu_si512(xr + 64));
          i1 = _mm512_dpwssd_epi32(i1, wv[3], _mm512_loadu_si512(xr + 96));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), dv, acc[m]);
        }
        if constexpr (has_min(TYPE)) mins.add_blocks(gb, a, B4, g);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) store(out + m * ldo + n, _mm512_reduce_add_ps(acc[m]) * a.dx[m] + mins.total(m));
  }
#elif ISV_GG_AVX2
  // AVX2 (+ F16C): the same integer sums on 16 lanes, vpmaddwd + vpaddd; two int32 accumulators a
  // super-block (inputs 0-15 and 16-31 of every 32), so no lane sums more than 16 products.
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m256 acc[MB];
    GgMins<TYPE, MB> mins;
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    if constexpr (KQ) {
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* b = wr + sb * kquant_bytes(TYPE);
        prefetch_stream(b, kquant_bytes(TYPE), wend);
        __m256i is0[MB], is1[MB];
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) is0[m] = _mm256_setzero_si256(), is1[m] = _mm256_setzero_si256();
        // one 32-input piece: levels (32 u8, input order) times its two 16-input scales, at input offset off
        auto piece = [&](__m256i q, int16_t s0, int16_t s1, int64_t off, int sub) {
          __m256i w0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q));
          __m256i w1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1));
          if (sub) w0 = _mm256_sub_epi16(w0, _mm256_set1_epi16(sub)), w1 = _mm256_sub_epi16(w1, _mm256_set1_epi16(sub));
          w0 = _mm256_mullo_epi16(w0, _mm256_set1_epi16(s0));
          w1 = _mm256_mullo_epi16(w1, _mm256_set1_epi16(s1));
#pragma GCC unroll 8
          for (int m = 0; m < MB; ++m) {
            const __m256i* xr = reinterpret_cast<const __m256i*>(a.xq + m * K + sb * 256 + off);
            is0[m] = _mm256_add_epi32(is0[m], _mm256_madd_epi16(w0, _mm256_loadu_si256(xr)));
            is1[m] = _mm256_add_epi32(is1[m], _mm256_madd_epi16(w1, _mm256_loadu_si256(xr + 1)));
          }
        };
        float d;
        if constexpr (TYPE == kQ6_K) {
          const uint8_t *ql = b, *qh = b + 128;
          const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
          d = f16_at(b + 208);
          const __m256i m30 = _mm256_set1_epi8(0x30);
          for (int h = 0; h < 2; ++h) {
            const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30)),
                _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(hb, m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30))};
            for (int s = 0; s < 4; ++s) piece(q[s], sc[8 * h + 2 * s], sc[8 * h + 2 * s + 1], 128 * h + 32 * s, 32);
          }
        } else {
          uint64_t sc, mn;
          d = f16_at(b);
          k4_scales(b + 4, sc, mn);
          mins.add_kquant(b, mn, a, B4, sb);
          const uint8_t* qs = b + (TYPE == kQ5_K ? 48 : 16);
          __m256i qh = _mm256_setzero_si256();
          if constexpr (TYPE == kQ5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
          const __m256i m10 = _mm256_set1_epi8(0x10);
          for (int j = 0; j < 4; ++j) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
            __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            if constexpr (TYPE == kQ5_K) {
              const int s = 2 * j;
              const __m256i h0 = s <= 4 ? _mm256_slli_epi16(qh, 4 - s) : _mm256_srli_epi16(qh, s - 4);
              const __m256i h1 = s + 1 <= 4 ? _mm256_slli_epi16(qh, 3 - s) : _mm256_srli_epi16(qh, s - 3);
              lo = _mm256_or_si256(lo, _mm256_and_si256(h0, m10));
              hi = _mm256_or_si256(hi, _mm256_and_si256(h1, m10));
            }
            piece(lo, byte_of(sc, 2 * j), byte_of(sc, 2 * j), 64 * j, 0);
            piece(hi, byte_of(sc, 2 * j + 1), byte_of(sc, 2 * j + 1), 64 * j + 32, 0);
          }
        }
        const __m256 dv = _mm256_set1_ps(d);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m)
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is1[m]), dv,
                                   _mm256_fmadd_ps(_mm256_cvtepi32_ps(is0[m]), dv, acc[m]));
      }
    } else {
      const __m256i lo2 = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0), hi2 = _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2);
      for (int64_t g = 0; g < a.K4 / 128; ++g) {
        const uint8_t* gb = wr + g * x4_bytes(TYPE);
        prefetch_stream(gb, x4_bytes(TYPE), wend);
        const __m256 d4 = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gb))));
        const __m256 dA = _mm256_permutevar8x32_ps(d4, lo2), dB = _mm256_permutevar8x32_ps(d4, hi2);
        const uint8_t* lv = gb + x4_header(TYPE);
        __m256i q[4];  // the 4 x 32 positions' levels as u8 (i8 for Q8_0)
        if constexpr (TYPE == kQ8_0) {
          for (int j = 0; j < 4; ++j) q[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lv + 32 * j));
        } else {
          const uint8_t* hbits = gb + 8 + (has_min(TYPE) ? 8 : 0);
          for (int c = 0; c < 2; ++c) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lv + 32 * c));
            q[2 * c] = _mm256_and_si256(bytes, low4);
            q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            if constexpr (TYPE == kQ5_0 || TYPE == kQ5_1) {
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
        }
        __m256i wa[4], wb[4];  // positions 0-15 (blocks 0, 1) and 16-31 (blocks 2, 3) of each 32, as int16
        for (int j = 0; j < 4; ++j) {
          if constexpr (TYPE == kQ8_0) {
            wa[j] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q[j]));
            wb[j] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q[j], 1));
          } else {
            const __m256i off = _mm256_set1_epi16(x4_offset(TYPE));
            wa[j] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(q[j])), off);
            wb[j] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(q[j], 1)), off);
          }
        }
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          const __m256i* xr = reinterpret_cast<const __m256i*>(a.xq4 + m * a.K4 + g * 128);
          __m256i ia = _mm256_madd_epi16(wa[0], _mm256_loadu_si256(xr));
          __m256i ib = _mm256_madd_epi16(wb[0], _mm256_loadu_si256(xr + 1));
          for (int j = 1; j < 4; ++j) {
            ia = _mm256_add_epi32(ia, _mm256_madd_epi16(wa[j], _mm256_loadu_si256(xr + 2 * j)));
            ib = _mm256_add_epi32(ib, _mm256_madd_epi16(wb[j], _mm256_loadu_si256(xr + 2 * j + 1)));
          }
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), dB, _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), dA, acc[m]));
        }
        if constexpr (has_min(TYPE)) mins.add_blocks(gb, a, B4, g);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) store(out + m * ldo + n, reduce_add8(acc[m]) * a.dx[m] + mins.total(m));
  }
#else
  // portable: the same integer sums, one input at a time
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    float acc[MB] = {}, mins[MB] = {};
    if constexpr (KQ) {
      for (int64_t sb = 0; sb < K / 256; ++sb) {
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
            for (int m = 0; m < MB; ++m) is[m] += wq * a.xq[m * K + sb * 256 + i];
          }
        } else {
          uint64_t sc, mn;
          d = f16_at(b);
          const float dmin = f16_at(b + 2);
          k4_scales(b + 4, sc, mn);
          const uint8_t* qs = b + (TYPE == kQ5_K ? 48 : 16);
          for (int i = 0; i < 256; ++i) {
            const int j = i / 64, l = i % 32, s = i / 32;
            int q = (i % 64) < 32 ? qs[32 * j + l] & 0xF : qs[32 * j + l] >> 4;
            if constexpr (TYPE == kQ5_K) q |= ((b[16 + l] >> s) & 1) << 4;
            const int32_t wq = q * byte_of(sc, s);
            for (int m = 0; m < MB; ++m) is[m] += wq * a.xq[m * K + sb * 256 + i];
          }
          for (int s = 0; s < 8; ++s)
            for (int m = 0; m < MB; ++m) mins[m] -= dmin * static_cast<float>(byte_of(mn, s)) * a.sx[m * B4 + sb * 8 + s];
        }
        for (int m = 0; m < MB; ++m) acc[m] += d * static_cast<float>(is[m]);
      }
    } else {
      for (int64_t g = 0; g < a.K4 / 128; ++g) {
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
    for (int m = 0; m < MB; ++m) store(out + m * ldo + n, acc[m] * a.dx[m] + mins[m]);
  }
#endif
}

template <int64_t TYPE, typename T>
void gg_shard(const GgRows& rows, int64_t M, const uint8_t* w, int64_t row_bytes, T* out, int64_t ldo, int64_t n0,
              int64_t n1, int64_t last) {
  for (int64_t t0 = n0; t0 < n1; t0 += 32) {  // a tile of weight rows stays in cache for every row group
    const int64_t t1 = std::min(n1, t0 + 32);
    for (int64_t m = 0; m < M;) {
      const int64_t left = M - m;
      T* o = out + m * ldo;
      if (left >= 8) { gg_rows<TYPE, 8>(rows.at(m), w, row_bytes, o, ldo, t0, t1, last); m += 8; }
      else if (left >= 4) { gg_rows<TYPE, 4>(rows.at(m), w, row_bytes, o, ldo, t0, t1, last); m += 4; }
      else if (left >= 2) { gg_rows<TYPE, 2>(rows.at(m), w, row_bytes, o, ldo, t0, t1, last); m += 2; }
      else { gg_rows<TYPE, 1>(rows.at(m), w, row_bytes, o, ldo, t0, t1, last); m += 1; }
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

// x [M, K] float32 or bfloat16; buf uint8 (every shard's rows, see above); meta [S, 4] int64 -> [M, N].
at::Tensor gguf_gemm(const at::Tensor& x, const at::Tensor& buf, const at::Tensor& meta, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be [M, K] float32 or bfloat16");
  TORCH_CHECK(buf.scalar_type() == at::kByte && buf.is_contiguous(), "buf must be contiguous uint8");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.dim() == 2 && meta.size(1) == 4 && meta.is_contiguous(),
              "meta must be contiguous [S, 4] int64 (type, rows, bytes per row, offset)");
  const int64_t M = x.size(0), K = x.size(1), S = meta.size(0);
  TORCH_CHECK(K % 32 == 0 && K > 0, "gguf_gemm needs K a multiple of 32");
  const int64_t K4 = (K + 127) / 128 * 128;
  const int64_t* mt = meta.const_data_ptr<int64_t>();
  int64_t total = 0;
  bool x4 = false;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t t = mt[4 * s], rows = mt[4 * s + 1], rb = mt[4 * s + 2], off = mt[4 * s + 3];
    const bool known = t == kQ4_0 || t == kQ4_1 || t == kQ5_0 || t == kQ5_1 || t == kQ8_0 || is_kquant(t);
    TORCH_CHECK(known, "gguf_gemm: unsupported ggml type ", t);
    const int64_t want = is_kquant(t) ? K / 256 * kquant_bytes(t) : K4 / 128 * x4_bytes(t);
    TORCH_CHECK(!is_kquant(t) || K % 256 == 0, "gguf_gemm: K-quant blocks need K a multiple of 256, got ", K);
    TORCH_CHECK(rb == want, "gguf_gemm: shard ", s, " has ", rb, " bytes a row, type ", t, " at K ", K, " takes ", want);
    TORCH_CHECK(rows >= 0 && off >= 0 && off + rows * rb <= buf.numel(), "gguf_gemm: shard ", s, " lies outside buf");
    x4 = x4 || !is_kquant(t);
    total += rows;
  }
  TORCH_CHECK(total == N, "gguf_gemm: the shards have ", total, " rows, N is ", N);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // the activations, quantised once on the calling thread as q4_gemm does (M x K is tiny next to the weights)
  const int64_t B4 = K4 / 32;
  std::vector<int16_t> xq(M * K), xq4(x4 ? M * K4 : 0, 0);
  std::vector<float> dx(M), sx(M * B4, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    if (x.scalar_type() == at::kFloat)
      gg_quantise_row(xc.const_data_ptr<float>() + m * K, K, &xq[m * K], &dx[m], &sx[m * B4]);
    else
      gg_quantise_row(reinterpret_cast<const uint16_t*>(xc.const_data_ptr()) + m * K, K, &xq[m * K], &dx[m], &sx[m * B4]);
    if (x4)  // position p of group g: input 8 * (p / 32) + p % 8 of block 4g + (p % 32) / 8, 8 inputs at a time
      for (int64_t k = 0; k < K; k += 8)
        std::memcpy(&xq4[m * K4 + k / 128 * 128 + 32 * (k % 32 / 8) + 8 * (k / 32 % 4)], &xq[m * K + k], 16);
  }
  const GgRows rows{xq.data(), x4 ? xq4.data() : nullptr, dx.data(), sx.data(), K, K4};
  const uint8_t* bp = buf.const_data_ptr<uint8_t>();
  auto run = [&](auto* op) {
    iterserve::parallel_ranges(N, kRanges, [&](int64_t begin, int64_t end) {  // as in q8_0_gemm
      int64_t first = 0;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t rows_s = mt[4 * s + 1], lo = std::max(begin, first), hi = std::min(end, first + rows_s);
        if (lo < hi)
          gg_dispatch(mt[4 * s], rows, M, bp + mt[4 * s + 3], mt[4 * s + 2], op + first, N, lo - first, hi - first,
                      rows_s - 1);
        first += rows_s;
      }
    });
  };
  if (x.scalar_type() == at::kFloat) run(out.data_ptr<float>());
  else run(reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

// which gguf_gemm path this build runs: "avx512-vnni", "avx2" or "scalar"
std::string gguf_gemm_isa() { return ISV_GG_AVX512 ? "avx512-vnni" : ISV_GG_AVX2 ? "avx2" : "scalar"; }


// ---- bf16 GEMM: out[m, n] = sum_k x[m, k] * w[n, k], float32 accumulation --------------------------
// At 16 rows oneDNN's prepacked bf16 GEMM ran the 120 projections at ~240 GFLOP/s here (13.5-14.5
// ms), on OpenMP threads that sleep between calls (OMP_WAIT_POLICY=PASSIVE), so every call first
// wakes one. This kernel holds a tile of rows' accumulators in registers while a tile of 16 outputs'
// weights streams by once: per pair of inputs, one 64-byte weight load feeds one vdpbf16ps per row,
// with the row's input pair broadcast from a copy of x laid out [row tile][K/2][rows] (one cache
// line per pair at 16 rows). 16 rows: 5.9-6.2 ms, 34 GB/s of weights, about the memory bandwidth.
// Layout, made by pack_bf16 (cpu_linear.py): w [ceil(N/16), K/2, 16, 2] bfloat16, zero-padded.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define ISV_BF16_DOT 1
#else
#define ISV_BF16_DOT 0
#endif

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

bool bf16_gemm_amx_available() {
#if ISV_AMX
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h, the AMX tile data
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

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


// ---- float32 x bf16-weight GEMM (AVX2 + FMA): out[m, n] = sum_k x[m, k] * w[n, k] -----------------
// For float32 engines on CPUs without fast bf16 (no AVX512-BF16): a decode step reads every weight
// once, so storing the weights as bf16 halves the bytes read, and widening bf16 to float32 is a
// 16-bit shift. (MKL's float32 GEMM is also slow at a few rows on AMD: docs/profile.md.)
// Layout, made by pack_bf16_f32 (cpu_linear.py): w [ceil(N/16), K, 16] bfloat16, zero-padded; in a
// tile's 16 values for input k, position 2j holds output j and 2j+1 output 8+j, so one 32-byte load
// read as 8 uint32 gives outputs 0..7 by a shift left (even halves) and 8..15 by masking the low
// halves away (odd ones), with no lane shuffles. MB rows x 16 outputs of accumulators (2 x MB of
// AVX2's 16 registers), each x value broadcast from its row; the tile's weights stay in cache
// across the row blocks of a larger M.
constexpr int64_t kF32Rows = 6;  // 12 accumulators + 2 weights + 1 broadcast of AVX2's 16 registers

template <int MB>
void f32_bf16w_tile(const float* x, int64_t K, const uint16_t* wt, float* out, int64_t N, int64_t n0) {
  const int64_t width = std::min<int64_t>(16, N - n0);
#if ISV_AVX2_FMA
  // Every loop over the accumulators is unrolled (the pragmas): otherwise gcc keeps the arrays in
  // memory and stores them at every k, which halved the speed. For 1-3 rows, two sets of
  // accumulators take even and odd k, so that 4+ FMA chains hide the FMA's latency.
  constexpr int S = MB <= 3 ? 2 : 1;
  __m256 lo[S][MB], hi[S][MB];
#pragma GCC unroll 16
  for (int i = 0; i < S * MB; ++i) lo[i / MB][i % MB] = hi[i / MB][i % MB] = _mm256_setzero_ps();
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t k = 0;
  auto step = [&](int64_t kk, __m256* l, __m256* h) __attribute__((always_inline)) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + kk * 16));
    const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(w, odd));
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m256 xi = _mm256_broadcast_ss(x + i * K + kk);
      l[i] = _mm256_fmadd_ps(w0, xi, l[i]);
      h[i] = _mm256_fmadd_ps(w1, xi, h[i]);
    }
  };
  for (; k + S <= K; k += S) {
    _mm_prefetch(reinterpret_cast<const char*>(wt + (k + 32) * 16), _MM_HINT_T0);
#pragma GCC unroll 2
    for (int u = 0; u < S; ++u) step(k + u, lo[u], hi[u]);
  }
  for (; k < K; ++k) step(k, lo[0], hi[0]);
  alignas(32) float res[MB][16];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) {
    __m256 l = lo[0][i], h = hi[0][i];
#pragma GCC unroll 2
    for (int u = 1; u < S; ++u) l = _mm256_add_ps(l, lo[u][i]), h = _mm256_add_ps(h, hi[u][i]);
    _mm256_store_ps(res[i], l);
    _mm256_store_ps(res[i] + 8, h);
  }
  for (int i = 0; i < MB; ++i) std::memcpy(out + i * N + n0, res[i], width * sizeof(float));
#else
  for (int i = 0; i < MB; ++i)
    for (int64_t c = 0; c < width; ++c) {
      const int64_t pos = c < 8 ? 2 * c : 2 * (c - 8) + 1;  // where output c sits in the tile
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[i * K + k] * load(wt[k * 16 + pos]);
      out[i * N + n0 + c] = s;
    }
#endif
}

void f32_bf16w_tile_rows(int64_t rows, const float* x, int64_t K, const uint16_t* wt, float* out, int64_t N,
                         int64_t n0) {
  switch (rows) {
#define ISV_ROWS(R) case R: return f32_bf16w_tile<R>(x, K, wt, out, N, n0);
    ISV_ROWS(1) ISV_ROWS(2) ISV_ROWS(3) ISV_ROWS(4) ISV_ROWS(5) ISV_ROWS(6)
#undef ISV_ROWS
  }
}

// x [M, K] float32; w packed as above for N outputs -> [M, N] float32.
at::Tensor f32_bf16w_gemm(const at::Tensor& x_in, const at::Tensor& w, int64_t N) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be [M, K] float32");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + 15) / 16;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 3 && w.size(0) == tiles &&
              w.size(1) == K && w.size(2) == 16, "w must be contiguous [ceil(N/16), K, 16] bfloat16 (pack_bf16_f32)");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // row blocks of equal height (7 rows: 4 + 3, not 6 + 1)
  const int64_t blocks = (M + kF32Rows - 1) / kF32Rows, mb = (M + blocks - 1) / blocks;
  const float* xp = x.const_data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.const_data_ptr());
  float* op = out.data_ptr<float>();
  iterserve::parallel_ranges(tiles, kRanges, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m = 0; m < M; m += mb)
        f32_bf16w_tile_rows(std::min(mb, M - m), xp + m * K, K, wp + t * K * 16, op + m * N, N, t * 16);
  });
  return out;
}

bool f32_bf16w_gemm_is_vectorised() { return ISV_AVX2_FMA; }


// ---- RMSNorm in bf16, in Hugging Face's order of rounding -------------------------------------
// out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))), x widened to float32: one pass per row instead of
// eager torch's eight ops (cast, pow, mean, add, rsqrt, mul, cast, mul), each a call with its own
// dispatch and its own pass over memory (61 norms a step). Each row is computed alone, in one fixed
// order, whatever the row count (batch-invariant); only the sum of squares' order differs from
// torch's, which can move the normalised x by one bf16 ulp (the output, rounded again after the
// weight, by up to two).
// unit_offset: Gemma's form, whose weight is stored as an offset from 1, in Gemma's own order of
// rounding (transformers' GemmaRMSNorm scales in float32 and rounds once): out = bf16(x * r * (1 + w)).
void rms_norm_row(const uint16_t* xr, const uint16_t* wp, uint16_t* orow, int64_t H, float e, bool unit_offset) {
  float ss = 0.f;
  int64_t d = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= H; d += 16) {
    const __m512 v = load16(xr + d);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; d < H; ++d) ss += load(xr[d]) * load(xr[d]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + e);
  if (unit_offset) {
    for (int64_t c = 0; c < H; ++c) store(orow + c, load(xr[c]) * r * (1.f + load(wp[c])));
    return;
  }
  for (int64_t c = 0; c < H; ++c) {
    uint16_t y;
    store(&y, load(xr[c]) * r);
    store(orow + c, load(wp[c]) * load(y));
  }
}

// a decode step's few rows inline (waking the pool costs more than they take); prefill rows spread
template <typename F>
void norm_rows(int64_t T, const F& row) {
  if (T < 64) {
    for (int64_t t = 0; t < T; ++t) row(t);
  } else {
    WorkPool::instance().run((T + 31) / 32, [&](int64_t c) {
      for (int64_t t = c * 32; t < std::min(T, c * 32 + 32); ++t) row(t);
    });
  }
}

void check_norm_args(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
              w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(),
              "x must be [T, H] bfloat16 and the weight [H] bfloat16");
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps, bool unit_offset) {
  check_norm_args(x_in, w);
  const at::Tensor x = x_in.contiguous();
  const int64_t H = x.size(1);
  at::Tensor out = at::empty_like(x);
  const uint16_t* xp = ptr<uint16_t>(x);
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  norm_rows(x.size(0), [&](int64_t t) {
    rms_norm_row(xp + t * H, ptr<uint16_t>(w), op + t * H, H, static_cast<float>(eps), unit_offset);
  });
  return out;
}

// The residual add and the RMSNorm after it (a decoder layer's `x = x + a; h = norm(x)`) in one pass
// per row: (s, rms_norm(s)) with s = bf16(x + a), torch's add (the sum in float32, rounded once), and
// the norm above on s while its row is in L1. Eager torch reads x and a, writes s, reads s again:
// 2048 x 576 0.20 vs 0.30 ms (add + the norm kernel), 1 row 3.6 vs 4.4 us.
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& a_in, const at::Tensor& w,
                                     double eps, bool unit_offset) {
  check_norm_args(x_in, w);
  TORCH_CHECK(a_in.sizes() == x_in.sizes() && a_in.scalar_type() == at::kBFloat16, "a must be x's shape, bfloat16");
  const at::Tensor x = x_in.contiguous(), a = a_in.contiguous();
  const int64_t H = x.size(1);
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  const uint16_t *xp = ptr<uint16_t>(x), *ap = ptr<uint16_t>(a);
  uint16_t *sp = reinterpret_cast<uint16_t*>(sum.data_ptr()), *op = reinterpret_cast<uint16_t*>(out.data_ptr());
  norm_rows(x.size(0), [&](int64_t t) {
    const uint16_t *xr = xp + t * H, *ar = ap + t * H;
    uint16_t* sr = sp + t * H;
    for (int64_t c = 0; c < H; ++c) store(sr + c, load(xr[c]) + load(ar[c]));
    rms_norm_row(sr, ptr<uint16_t>(w), op + t * H, H, static_cast<float>(eps), unit_offset);
  });
  return {sum, out};
}

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
// Needs AVX512-BF16, bf16 q and caches, head_dim a multiple of 32.
#if ISV_BF16_DOT
inline __m512 exp512_nonpositive(__m512 x) {  // exp_nonpositive above, 16 lanes at a time
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
#endif

// q [n, H, D] bf16 (the chunk's queries, at positions ctx - n .. ctx - 1); caches [num_blocks,
// block_size, KVH, D] bf16 holding the sequence's first ctx tokens (this chunk's written);
// block_table [width] int64 -> [n, H, D] bf16. window, softcap: see the top of this file (0: off).
at::Tensor paged_prefill_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, int64_t ctx, double scale, int64_t window,
                                   double softcap) {
  TORCH_CHECK(ISV_BF16_DOT, "paged_prefill_attention needs a build with AVX512-BF16");
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [n, H, D] and the caches [num_blocks, block_size, kv_heads, D]");
  TORCH_CHECK(q_in.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and the caches must be bfloat16, the caches contiguous");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor table = block_table.contiguous();
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 32 == 0 && H % KVH == 0 && H / KVH <= 24,
              "head_dim must match the caches and be a multiple of 32; at most 24 query heads per KV head");
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
  const uint16_t* kc = ptr<uint16_t>(k_cache);
  const uint16_t* vc = ptr<uint16_t>(v_cache);
  const int64_t token_stride = KVH * D, block_stride = BS * token_stride;
  // tiles t0 .. of K as [KVH][tile][D/2][16][2] and of V as [KVH][tile][8][D][2], zero outside
  // [first_key, ctx)
  std::vector<uint16_t> kp(KVH * tiles * 16 * D, 0), vp(KVH * tiles * 16 * D, 0);
  WorkPool::instance().run(KVH * tiles, [&](int64_t item) {
    const int64_t h = item / tiles, t = t0 + item % tiles;
    uint16_t* kt = kp.data() + item * 16 * D;
    uint16_t* vt = vp.data() + item * 16 * D;
    for (int64_t j = std::max<int64_t>(0, first_key - t * 16); j < 16 && t * 16 + j < ctx; ++j) {
      const int64_t pos = t * 16 + j;
      const uint16_t* kr = kc + tp[pos / BS] * block_stride + (pos % BS) * token_stride + h * D;
      const uint16_t* vr = vc + tp[pos / BS] * block_stride + (pos % BS) * token_stride + h * D;
      for (int64_t d = 0; d < D; ++d) {
        kt[((d / 2) * 16 + j) * 2 + d % 2] = kr[d];
        vt[((j / 2) * D + d) * 2 + j % 2] = vr[d];
      }
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

// ---- multi-LoRA deltas: each row through its own adapter slot's A and B (SGMV / BGMV style) ------
// out[r] += B[s] (A[s] x[r]) for s = row_slot[r] >= 0, in place; rows with slot -1 are untouched.
// A [slots, S*R, in] stacks a fused module's S projections' A; B [slots, S*R, N] is block-diagonal
// (projection j's R rows feed only its columns [bounds[j], bounds[j+1])), scaling folded in. Only
// the diagonal blocks are read: torch's masked path multiplied every row by every slot's A and by
// the whole B, slots x S times the arithmetic, ~12 ms of a 16-row SmolLM2-135M step over 4 adapters.
// Rows are grouped by slot, up to four at a time, so each A and B vector loaded serves four rows;
// float32 accumulation, one rounding into out. The vector type is AVX-512's, AVX2's, or one float
// (the scalar build: the same loops, each "vector" a single lane).
#if defined(__AVX512F__)
using LVec = __m512;
constexpr int64_t kLW = 16;
inline LVec lv_zero() { return _mm512_setzero_ps(); }
inline LVec lv_set1(float v) { return _mm512_set1_ps(v); }
inline LVec lv_fma(LVec a, LVec b, LVec c) { return _mm512_fmadd_ps(a, b, c); }
inline LVec lv_add(LVec a, LVec b) { return _mm512_add_ps(a, b); }
inline LVec lv_load(const float* p) { return _mm512_loadu_ps(p); }
inline LVec lv_load(const uint16_t* p) { return load16(p); }
inline float lv_sum(LVec v) { return _mm512_reduce_add_ps(v); }
inline void lv_store(float* p, LVec v) { _mm512_storeu_ps(p, v); }
// each lane's bf16 bits (in its low 16): round to nearest even, NaN to a quiet NaN, as store()
inline __m512i lv_bf16_bits(LVec v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
}
inline void lv_store(uint16_t* p, LVec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(lv_bf16_bits(v)));
}
#elif ISV_AVX2_FMA
using LVec = __m256;
constexpr int64_t kLW = 8;
inline LVec lv_zero() { return _mm256_setzero_ps(); }
inline LVec lv_set1(float v) { return _mm256_set1_ps(v); }
inline LVec lv_fma(LVec a, LVec b, LVec c) { return _mm256_fmadd_ps(a, b, c); }
inline LVec lv_add(LVec a, LVec b) { return _mm256_add_ps(a, b); }
inline LVec lv_load(const float* p) { return _mm256_loadu_ps(p); }
inline LVec lv_load(const uint16_t* p) { return load8(p); }
inline float lv_sum(LVec v) { return reduce_add8(v); }
inline void lv_store(float* p, LVec v) { _mm256_storeu_ps(p, v); }
inline void lv_store(uint16_t* p, LVec v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int i = 0; i < 8; ++i) store(p + i, f[i]);
}
#else
using LVec = float;
constexpr int64_t kLW = 1;
inline LVec lv_zero() { return 0.f; }
inline LVec lv_set1(float v) { return v; }
inline LVec lv_fma(LVec a, LVec b, LVec c) { return a * b + c; }
inline LVec lv_add(LVec a, LVec b) { return a + b; }
template <typename C>
inline LVec lv_load(const C* p) { return load(*p); }
inline float lv_sum(LVec v) { return v; }
template <typename C>
inline void lv_store(C* p, LVec v) { store(p, v); }
#endif

// NR rows of one slot (rows[0..NR)): xf holds them widened to float [NR, K]; h gets A x [NR, SR].
template <int NR, typename T, typename C>
void lora_rows(const int64_t* rows, const float* xf, const C* a, const C* b, const std::vector<int64_t>& bounds,
               int64_t R, int64_t K, int64_t N, float* h, T* out) {
  const int64_t SR = static_cast<int64_t>(bounds.size() - 1) * R;
  for (int64_t k = 0; k < SR; ++k) {  // shrink: h[r, k] = A[k] . x[r]
    const C* ak = a + k * K;
    LVec acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = lv_zero();
    int64_t i = 0;
    for (; i + kLW <= K; i += kLW) {
      const LVec av = lv_load(ak + i);
      for (int r = 0; r < NR; ++r) acc[r] = lv_fma(av, lv_load(xf + r * K + i), acc[r]);
    }
    for (int r = 0; r < NR; ++r) {
      float sum = lv_sum(acc[r]);
      for (int64_t t = i; t < K; ++t) sum += load(ak[t]) * xf[r * K + t];
      h[r * SR + k] = sum;
    }
  }
  for (size_t j = 0; j + 1 < bounds.size(); ++j) {  // expand: projection j's R values into its columns
    const C* bj = b + static_cast<int64_t>(j) * R * N;
    const float* hj = h + static_cast<int64_t>(j) * R;
    const int64_t lo = bounds[j], hi = bounds[j + 1];
    int64_t c = lo;
    for (; c + kLW <= hi; c += kLW) {
      LVec acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = lv_zero();
      for (int64_t t = 0; t < R; ++t) {
        const LVec bv = lv_load(bj + t * N + c);
        for (int r = 0; r < NR; ++r) acc[r] = lv_fma(lv_set1(hj[r * SR + t]), bv, acc[r]);
      }
      for (int r = 0; r < NR; ++r) {
        T* o = out + rows[r] * N + c;
        lv_store(o, lv_add(lv_load(o), acc[r]));
      }
    }
    for (; c < hi; ++c) {
      for (int r = 0; r < NR; ++r) {
        float sum = 0.f;
        for (int64_t t = 0; t < R; ++t) sum += hj[r * SR + t] * load(bj[t * N + c]);
        T* o = out + rows[r] * N + c;
        store(o, load(*o) + sum);
      }
    }
  }
}

template <typename T, typename C>
void lora_sgmv_impl(const T* x, const C* a, const C* b, const int32_t* row_slot, int64_t T_rows, int64_t slots,
                    int64_t K, int64_t N, int64_t R, const std::vector<int64_t>& bounds, T* out) {
  const int64_t SR = static_cast<int64_t>(bounds.size() - 1) * R;
  std::vector<int64_t> order;  // the adapter rows, grouped by slot
  std::vector<std::pair<int64_t, int64_t>> items;  // (first index into order, row count): <= 4 rows of one slot
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t first = static_cast<int64_t>(order.size());
    for (int64_t r = 0; r < T_rows; ++r)
      if (row_slot[r] == s) order.push_back(r);
    for (int64_t i = first; i < static_cast<int64_t>(order.size()); i += 4)
      items.emplace_back(i, std::min<int64_t>(4, static_cast<int64_t>(order.size()) - i));
  }
  auto item = [&](int64_t n) {
    thread_local std::vector<float> xf, h;
    const auto [first, count] = items[n];
    const int64_t* rows = order.data() + first;
    const int64_t s = row_slot[rows[0]];
    xf.resize(4 * K);
    h.resize(4 * SR);
    for (int64_t r = 0; r < count; ++r)
      for (int64_t i = 0; i < K; ++i) xf[r * K + i] = load(x[rows[r] * K + i]);
    const C* as = a + s * SR * K;
    const C* bs = b + s * SR * N;
    if (count == 4) {
      lora_rows<4>(rows, xf.data(), as, bs, bounds, R, K, N, h.data(), out);
      return;
    }
    int64_t r = 0;
    if (count >= 2) {
      lora_rows<2>(rows, xf.data(), as, bs, bounds, R, K, N, h.data(), out);
      r = 2;
    }
    if (r < count) lora_rows<1>(rows + r, xf.data() + r * K, as, bs, bounds, R, K, N, h.data(), out);
  };
  // FMAs per row: SR * K to shrink, R * N to expand. Below ~64k FMAs in all (a few us), waking the
  // pool's second thread costs more than it saves: a 1-row step's projections run inline.
  const int64_t work = static_cast<int64_t>(order.size()) * (SR * K + R * N);
  if (items.size() > 1 && work >= (1 << 16)) {
    WorkPool::instance().run(static_cast<int64_t>(items.size()), item);
  } else {
    for (size_t n = 0; n < items.size(); ++n) item(static_cast<int64_t>(n));
  }
}

// x [T, K], a [slots, S*R, K], b [slots, S*R, N], row_slot [T] int32, bounds: S+1 column offsets
// (0 .. N), out [T, N] contiguous, updated in place. x/out float32 or bf16, a/b float32 or bf16.
void lora_sgmv(const at::Tensor& x_in, const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& row_slot_in,
               const std::vector<int64_t>& bounds, at::Tensor& out) {
  TORCH_CHECK(a_in.dim() == 3 && b_in.dim() == 3 && a_in.size(0) == b_in.size(0) && a_in.size(1) == b_in.size(1) &&
              a_in.scalar_type() == b_in.scalar_type(), "a must be [slots, S*R, in], b [slots, S*R, out], one dtype");
  const int64_t slots = a_in.size(0), SR = a_in.size(1), K = a_in.size(2), N = b_in.size(2);
  TORCH_CHECK(bounds.size() >= 2 && SR % static_cast<int64_t>(bounds.size() - 1) == 0 && bounds.front() == 0 &&
              bounds.back() == N, "bounds must be S+1 column offsets from 0 to out's width");
  for (size_t j = 0; j + 1 < bounds.size(); ++j) TORCH_CHECK(bounds[j] <= bounds[j + 1], "bounds must not decrease");
  TORCH_CHECK(out.is_contiguous() && out.numel() % N == 0 && x_in.numel() == out.numel() / N * K &&
              x_in.scalar_type() == out.scalar_type(), "out must be contiguous [T, out], x [T, in], one dtype");
  const int64_t T_rows = out.numel() / N;
  TORCH_CHECK(row_slot_in.scalar_type() == at::kInt && row_slot_in.numel() == T_rows, "row_slot must be [T] int32");
  const auto ft = out.scalar_type(), wt = a_in.scalar_type();
  TORCH_CHECK((ft == at::kFloat || ft == at::kBFloat16) && (wt == at::kFloat || wt == at::kBFloat16),
              "x/out and a/b must be float32 or bfloat16");
  const at::Tensor x = x_in.contiguous(), a = a_in.contiguous(), b = b_in.contiguous(),
                   row_slot = row_slot_in.contiguous();
  const int64_t R = SR / static_cast<int64_t>(bounds.size() - 1);
  const int32_t* rs = ptr<int32_t>(row_slot);
  for (int64_t r = 0; r < T_rows; ++r) TORCH_CHECK(rs[r] < slots, "row_slot out of range");
  auto run = [&](auto* op, const auto* wa) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(op)>>;
    using C = std::remove_const_t<std::remove_pointer_t<decltype(wa)>>;
    lora_sgmv_impl<T, C>(ptr<T>(x), wa, ptr<C>(b), rs, T_rows, slots, K, N, R, bounds, op);
  };
  auto by_weight = [&](auto* op) {
    if (wt == at::kFloat) run(op, ptr<float>(a));
    else run(op, ptr<uint16_t>(a));
  };
  if (ft == at::kFloat) by_weight(reinterpret_cast<float*>(out.data_ptr()));
  else by_weight(reinterpret_cast<uint16_t*>(out.data_ptr()));
}


// ---- element-wise steps of a layer: the gated MLP's SiLU-and-multiply, RoPE ----------------------
// Eager torch runs each as several ops, each a dispatch, a pass over memory and a temporary: the
// MLP's split + silu + mul (two [T, F] temporaries), RoPE's slices + neg + cat + two muls + add (five
// temporaries) for q and k. Here each is one pass. Both keep torch's order of rounding (bf16 inputs
// rounded to bf16 after each op torch runs as its own, float32 ones never fused into an FMA), and
// SiLU takes exp from SLEEF's expf_u10 formula, the one torch's vectorised silu calls: the outputs
// are torch's bits (tests/test_cpu_elementwise.py; torch's own scalar tail, std::exp, may differ in
// the last float32 bit, which a bf16 output rounds away but a rare tie). Each element alike whatever
// its row or column (batch-invariant). A few rows run inline on the calling thread: a decode step
// would pay more to wake the pool than the work takes (kElemInline). SmolLM2-135M shapes, bf16, 2-core
// Zen 5 VM, per layer: SiLU-and-multiply of 2048 x 1536 0.86 vs torch's 1.55 ms (32 rows: 23 vs
// 166 us, torch's OpenMP wake-up), RoPE of 2048 x 12 heads 0.19 vs 1.17 ms, 1 row 1.0 vs 19 us.
constexpr int64_t kElemInline = 32768;  // elements below which a call stays on the calling thread
constexpr int64_t kElemChunk = 16384;   // elements per pool chunk (whole rows)

#if defined(__AVX512F__)
inline LVec lv_mul(LVec a, LVec b) { return _mm512_mul_ps(a, b); }
inline LVec lv_div(LVec a, LVec b) { return _mm512_div_ps(a, b); }
inline LVec lv_neg(LVec a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a),
                                                                         _mm512_set1_epi32(INT32_MIN))); }
inline LVec lv_round_bf16(LVec v) {  // to the nearest bf16 (ties to even), NaN to a quiet NaN; as store() does
  return _mm512_castsi512_ps(_mm512_slli_epi32(lv_bf16_bits(v), 16));
}
inline LVec lv_expf_u10(LVec d) {  // SLEEF's xexpf, lane for lane (see exp_sleef below)
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137f)));
  const __m512 qf = _mm512_cvtepi32_ps(q);
  __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
  s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
  __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
  u = _mm512_add_ps(_mm512_set1_ps(1.f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  const __m512i h = _mm512_srai_epi32(q, 1), bias = _mm512_set1_epi32(0x7f);
  u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(h, bias), 23)));
  u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(q, h), bias), 23)));
  u = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.f), _CMP_NLT_UQ), u);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_set1_ps(100.f), d, _CMP_LT_OQ), u,
                              _mm512_set1_ps(INFINITY));
}
#elif ISV_AVX2_FMA
inline LVec lv_mul(LVec a, LVec b) { return _mm256_mul_ps(a, b); }
inline LVec lv_div(LVec a, LVec b) { return _mm256_div_ps(a, b); }
inline LVec lv_neg(LVec a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.f)); }
inline LVec lv_round_bf16(LVec v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                     _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                          _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
inline LVec lv_expf_u10(LVec d) {
  const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137f)));
  const __m256 qf = _mm256_cvtepi32_ps(q);
  __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
  s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
  __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
  u = _mm256_add_ps(_mm256_set1_ps(1.f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
  const __m256i h = _mm256_srai_epi32(q, 1), bias = _mm256_set1_epi32(0x7f);
  u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23)));
  u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(q, h), bias), 23)));
  u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.f), _CMP_LT_OQ), u);
  return _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(_mm256_set1_ps(100.f), d, _CMP_LT_OQ));
}
#endif

// SLEEF's expf_u10 (xexpf, 1-ulp) in one lane: the vector forms above, and the columns past the last
// whole vector, so that every column of a row gets the same bits.
inline float exp_sleef(float d) {
  if (std::isnan(d)) return d;
  if (d < -104.f) return 0.f;
  if (d > 100.f) return INFINITY;
  const int32_t q = static_cast<int32_t>(std::nearbyint(d * 1.442695040888963407359924681001892137f));
  const float qf = static_cast<float>(q);
  float s = std::fma(qf, -0.693145751953125f, d);
  s = std::fma(qf, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = std::fma(u, s, 0.00139304355252534151077271f);
  u = std::fma(u, s, 0.00833336077630519866943359f);
  u = std::fma(u, s, 0.0416664853692054748535156f);
  u = std::fma(u, s, 0.166666671633720397949219f);
  u = std::fma(u, s, 0.5f);
  u = 1.f + std::fma(s * s, u, s);
  auto pow2i = [](int32_t e) {
    const int32_t bits = (e + 0x7f) << 23;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  };
  return u * pow2i(q >> 1) * pow2i(q - (q >> 1));
}

// The value rounded to T, as torch leaves it between two of its ops: to bf16 for bf16 data; for
// float32 data a value the compiler may not fuse into an FMA with the next op (gcc contracts a*b + c
// by default), which torch's separate ops never do.
template <typename T, typename V>
inline V as_stored(V v) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    if constexpr (std::is_same_v<V, float>) {
      uint16_t b;
      store(&b, v);
      return load(b);
    } else {
      return lv_round_bf16(v);
    }
  } else {
#if defined(__x86_64__) && defined(__GNUC__)
    asm("" : "+v"(v));
#else
    volatile V keep = v;
    v = keep;
#endif
    return v;
  }
}

// Runs rows [0, T) through row(t), inline when small, else in chunks of whole rows on the pool.
template <typename F>
void for_rows(int64_t T, int64_t row_elems, const F& row) {
  if (T * row_elems < kElemInline) {
    for (int64_t t = 0; t < T; ++t) row(t);
    return;
  }
  const int64_t per = std::max<int64_t>(1, kElemChunk / std::max<int64_t>(1, row_elems));
  WorkPool::instance().run((T + per - 1) / per, [&](int64_t c) {
    for (int64_t t = c * per; t < std::min(T, c * per + per); ++t) row(t);
  });
}

// out[t, j] = silu(g[t, j]) * u[t, j] with g, u the halves of x[t] = [g | u]: silu(v) = v / (1 + exp(-v))
// in float32 (torch's formula), rounded to T, then the product rounded to T.
template <typename T>
void silu_and_mul_row(const T* g, const T* u, T* o, int64_t F) {
  int64_t j = 0;
#if defined(__AVX512F__) || ISV_AVX2_FMA
  const LVec one = lv_set1(1.f);
  for (; j + kLW <= F; j += kLW) {
    const LVec v = lv_load(g + j);
    const LVec s = as_stored<T>(lv_div(v, lv_add(one, lv_expf_u10(lv_neg(v)))));
    lv_store(o + j, lv_mul(s, lv_load(u + j)));
  }
#endif
  for (; j < F; ++j) {
    const float v = load(g[j]);
    store(o + j, as_stored<T>(v / (1.f + exp_sleef(-v))) * load(u[j]));
  }
}

// x [T, 2F] (rows may be strided, columns contiguous) -> [T, F] of x's dtype (float32 or bf16).
at::Tensor silu_and_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % 2 == 0, "x must be [T, 2F]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t T = x.size(0), F = x.size(1) / 2, ld = x.stride(0);
  at::Tensor out = at::empty({T, F}, x.options());
  auto run = [&](auto* op) {
    using E = std::remove_pointer_t<decltype(op)>;
    const E* xp = ptr<E>(x);
    for_rows(T, F, [&](int64_t t) { silu_and_mul_row<E>(xp + t * ld, xp + t * ld + F, op + t * F, F); });
  };
  if (x.scalar_type() == at::kFloat) run(reinterpret_cast<float*>(out.data_ptr()));
  else run(reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

// One head's row of RoPE in Hugging Face's rotate-half form over its first 2 * half channels:
// out = x * cos + rot * sin, rot = (-x2, x1), each product and the sum rounded to T as torch's
// separate ops do (a bf16 x bf16 product is exact in float32, so bf16 rounds it once, as torch);
// channels 2 * half .. D pass through (partial rotary).
template <typename T>
void rope_row(const T* x, const T* c, const T* s, T* o, int64_t half, int64_t D) {
  const T* x2 = x + half;
  int64_t i = 0;
#if defined(__AVX512F__) || ISV_AVX2_FMA
  for (; i + kLW <= half; i += kLW) {
    const LVec a = lv_load(x + i), b = lv_load(x2 + i);
    lv_store(o + i, lv_add(as_stored<T>(lv_mul(a, lv_load(c + i))),
                           as_stored<T>(lv_mul(lv_neg(b), lv_load(s + i)))));
    lv_store(o + half + i, lv_add(as_stored<T>(lv_mul(b, lv_load(c + half + i))),
                                  as_stored<T>(lv_mul(a, lv_load(s + half + i)))));
  }
#endif
  for (; i < half; ++i) {
    const float a = load(x[i]), b = load(x2[i]);
    store(o + i, as_stored<T>(a * load(c[i])) + as_stored<T>(-b * load(s[i])));
    store(o + half + i, as_stored<T>(b * load(c[half + i])) + as_stored<T>(a * load(s[half + i])));
  }
  if (2 * half < D) std::memcpy(o + 2 * half, x + 2 * half, (D - 2 * half) * sizeof(T));
}

// x [T, H, D] (heads and rows may be strided: q and k as one view of the fused QKV output), cos and
// sin [T, rd] of x's dtype, rd even and <= D -> a new contiguous [T, H, D].
at::Tensor rope(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x_in.dim() == 3 && cos_in.dim() == 2 && sin_in.sizes() == cos_in.sizes() &&
              cos_in.size(0) == x_in.size(0), "x must be [T, heads, D], cos and sin [T, rd]");
  const auto st = x_in.scalar_type();
  TORCH_CHECK((st == at::kFloat || st == at::kBFloat16) && cos_in.scalar_type() == st && sin_in.scalar_type() == st,
              "x, cos and sin must be all float32 or all bfloat16");
  const int64_t T = x_in.size(0), H = x_in.size(1), D = x_in.size(2), rd = cos_in.size(1);
  TORCH_CHECK(rd % 2 == 0 && rd <= D, "the rotary dim must be even and at most head_dim");
  const at::Tensor x = x_in.stride(2) == 1 ? x_in : x_in.contiguous();
  const at::Tensor c = cos_in.stride(1) == 1 ? cos_in : cos_in.contiguous();
  const at::Tensor s = sin_in.stride(1) == 1 ? sin_in : sin_in.contiguous();
  at::Tensor out = at::empty({T, H, D}, x.options());
  const int64_t sx = x.stride(0), sh = x.stride(1), sc = c.stride(0), ss = s.stride(0);
  auto run = [&](auto* op) {
    using E = std::remove_pointer_t<decltype(op)>;
    const E *xp = ptr<E>(x), *cp = ptr<E>(c), *sp = ptr<E>(s);
    for_rows(T, H * D, [&](int64_t t) {
      for (int64_t h = 0; h < H; ++h)
        rope_row<E>(xp + t * sx + h * sh, cp + t * sc, sp + t * ss, op + (t * H + h) * D, rd / 2, D);
    });
  };
  if (st == at::kFloat) run(reinterpret_cast<float*>(out.data_ptr()));
  else run(reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_sgmv", &lora_sgmv, "out[r] += B[s] (A[s] x[r]) for each row's adapter slot s = row_slot[r] >= 0, "
        "in place, from the diagonal blocks of B only (layout in cpu_kernels.cpp)");
  m.def("pool_threads", [] { return WorkPool::instance().num_threads(); }, "threads of the kernels' work pool");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query per sequence against its paged K/V, read in place; window and softcap 0: off (see cpu_kernels.cpp)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "a chunk's queries, causal, against its sequence's paged K/V (bf16, AVX512-BF16); window and softcap 0: "
        "off (see cpu_kernels.cpp)", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("ctx"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows in Hugging Face's order of rounding; unit_offset: Gemma's "
        "(1 + w) form (see cpu_kernels.cpp)", py::arg("x"), py::arg("w"), py::arg("eps"),
        py::arg("unit_offset") = false);
  m.def("add_rms_norm", &add_rms_norm, "(x + a, rms_norm(x + a)) of bf16 rows: a residual add and the norm after "
        "it in one pass (see cpu_kernels.cpp)", py::arg("x"), py::arg("a"), py::arg("w"), py::arg("eps"),
        py::arg("unit_offset") = false);
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :F]) * x[:, F:] of x [T, 2F] (float32 or bf16) in torch's order "
        "of rounding (see cpu_kernels.cpp)", py::arg("x"));
  m.def("rope", &rope, "rotate-half RoPE of x [T, heads, D] by cos, sin [T, rd] (partial when rd < D) in torch's "
        "order of rounding; a new contiguous tensor (see cpu_kernels.cpp)", py::arg("x"), py::arg("cos"), py::arg("sin"));
  m.def("q4_gemm", &q4_gemm, "x @ w.T for 4-bit w (GGUF Q4_1 levels; layout in cpu_kernels.cpp)");
  m.def("q4_gemm_is_vectorised", &q4_gemm_is_vectorised, "whether q4_gemm was built with AVX512-VNNI or AVX2 + FMA");
  m.def("bf16_gemm", &bf16_gemm, "x @ w.T for bf16 w packed by pack_bf16 (layout in cpu_kernels.cpp); steps of "
        ">= amx_min_rows (> 0) rows on AMX tiles where available", py::arg("x"), py::arg("w"), py::arg("N"),
        py::arg("amx_min_rows") = 0);
  m.def("bf16_gemm_amx_available", &bf16_gemm_amx_available,
        "whether bf16_gemm can run on AMX tiles here (built with AMX-BF16, and Linux lent the tile state)");
  m.def("bf16_gemm_is_vectorised", &bf16_gemm_is_vectorised, "whether bf16_gemm was built with AVX512-BF16");
  m.def("f32_bf16w_gemm", &f32_bf16w_gemm,
        "float32 x @ w.T for bf16 w packed by pack_bf16_f32 (AVX2 + FMA; layout in cpu_kernels.cpp)");
  m.def("f32_bf16w_gemm_is_vectorised", &f32_bf16w_gemm_is_vectorised,
        "whether f32_bf16w_gemm was built with AVX2 and FMA");
  m.def("q8_0_gemm", &q8_0_gemm, "x @ w.T for int8 w with a float scale per 32 inputs (GGUF Q8_0)");
  m.def("gguf_gemm", &gguf_gemm, "x @ w.T from GGUF blocks (K-quants as stored, 32-input blocks repacked four "
        "to a group by pack_gguf_x4); a row range per shard, meta [S, 4]: type, rows, bytes per row, offset "
        "(layout in cpu_kernels.cpp)", py::arg("x"), py::arg("buf"), py::arg("meta"), py::arg("N"));
  m.def("gguf_gemm_isa", &gguf_gemm_isa, "the instruction set gguf_gemm was built for: avx512-vnni, avx2 or scalar");
}

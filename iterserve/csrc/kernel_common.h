// What several kernel files use beside the lanes: a tensor's data pointer, cache prefetches, and the
// GEMMs' shared prefetch distance and work split.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "lanes.h"

namespace iterserve {

// a tensor's data as T (bf16 as its uint16_t bits)
template <typename T>
const T* ptr(const at::Tensor& t) { return reinterpret_cast<const T*>(t.const_data_ptr()); }

// A [T, heads, D] tensor as a kernel that walks its rows `stride(0)` apart reads it: itself where each
// row's heads are dense (its rows may be strided: q, k and v are views of the fused QKV output, read
// in place), else a contiguous copy.
inline at::Tensor dense_heads(const at::Tensor& t) {
  return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
}

// How far ahead of a weight stream prefetch_stream asks, in bytes: 4096 until the engine has timed
// the loaded model's one-row projections at a few distances and set the fastest (set_stream_ahead,
// platform/stream_ahead.py). A process-wide setting, read once a call: the best distance moved with
// the host (2048 read the 1B's and 8B's weights 8-14 % faster than 4096 on a 2-core AMX Xeon).
inline std::atomic<int64_t> g_stream_ahead{4096};
inline int64_t stream_ahead() { return g_stream_ahead.load(std::memory_order_relaxed); }

#if defined(__AVX512F__) || ISV_AVX2_FMA
// Asks for `bytes` from p into cache, a 64-byte line at a time.
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}

// A weight stream read `bytes` at a time from p asks for the lines `ahead` bytes further on
// (none at or past `end`). Asking for whole rows 16 rows ahead, as the other GEMMs do, put the
// request 74 KB ahead for a 4.6 KB row (a 1B's Q4_K down projection, K = 8192), out of L1 before
// its use, and sent a row's 18-72 requests at once (docs/profile.md: 1.32-1.43x at one activation
// row on the down projections, 1.04-1.26x on the others). A reader that goes on elsewhere (gguf_gemm
// over K in chunks: the next weight row) says how far ahead its next bytes are.
// One test against `end` a call where the whole span is before it (bytes is a constant of the block
// type: the loop unrolls), not one a line.
inline void prefetch_stream(const uint8_t* p, int64_t bytes, const uint8_t* end, int64_t ahead) {
  const uint8_t* a = p + ahead;
  if (a + bytes + 63 <= end) {
    for (int64_t off = 0; off < bytes + 63; off += 64) _mm_prefetch(reinterpret_cast<const char*>(a + off), _MM_HINT_T0);
    return;
  }
  for (int64_t off = 0; off < bytes + 63 && a + off < end; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(a + off), _MM_HINT_T0);
}
#endif

// Rows of a quantised weight are a few hundred bytes: the GEMMs ask for the row this many
// ahead, or each row's loads wait on memory (120 projections at 1 row: 3.9 vs 5.1 ms, Zen 4).
constexpr int64_t kPrefetchRows = 16;
constexpr int64_t kRanges = 16;  // a GEMM's output rows, split for the work pool

// Whether Linux lends this process AMX's tile data (arch_prctl ARCH_REQ_XCOMP_PERM), asked once a
// process: the bf16 GEMM's and the K-quant int8 GEMM's AMX paths both need it. False off Linux.
inline bool amx_tiles_granted() {
#if defined(__linux__)
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h, the AMX tile data
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

}  // namespace iterserve

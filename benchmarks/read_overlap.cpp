// Whether a core's reads from memory hide behind its work, in the GGUF AMX kernel's read pattern: row
// groups of 16 weight rows (a row's bytes contiguous, row_bytes apart), one super-block (144 bytes,
// Q4_K) of each row a unit, each row's bytes asked for into L2 `ahead` units early (as
// gemm_gguf_amx.cpp asks), and `work` FMAs a unit on registers (8 independent chains) in place of
// the kernel's unpacking and scaling. Prints ns a unit per thread for the weights from memory (300 MB
// of them) and with the same work on weights that stay in L2, and the read alone (work 0): on the
// 2-core AMX Xeon (2026-12-06, docs/profile.md, "The 1B's 16-row decode step") a core read at most ~13-14 GB/s, and
// 1,536 FMAs a unit took 210 ns in L2, the read alone ~170, both 303-324: 35-42 % of the read hidden
// (768 FMAs: 75 %). AVX2 + FMA, so it runs on every x86 host kind here.
//
//     g++ -O2 -mavx2 -mfma -pthread benchmarks/read_overlap.cpp -o /tmp/read_overlap
//     /tmp/read_overlap [threads=1] [work=1536] [ahead=3] [K=2048]
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kBlock = 144;  // a Q4_K super-block's bytes

// ns a unit on each of `threads` threads over `groups` row groups (each thread its share), best of
// `reps` passes
double ns_a_unit(const uint8_t* w, int64_t groups, int64_t K, int threads, int64_t work, int64_t ahead, int reps) {
  const int64_t nb = K / 256, rb = nb * kBlock, bytes = groups * 16 * rb;
  double best = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    std::vector<double> ns(threads);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        const int64_t g0 = t * groups / threads, g1 = (t + 1) * groups / threads;
        // eight chains, each its own start so that the compiler cannot fold them into one
        __m256 a0 = _mm256_set1_ps(0.f), a1 = _mm256_set1_ps(1.f), a2 = _mm256_set1_ps(2.f), a3 = _mm256_set1_ps(3.f),
               a4 = _mm256_set1_ps(4.f), a5 = _mm256_set1_ps(5.f), a6 = _mm256_set1_ps(6.f), a7 = _mm256_set1_ps(7.f);
        const __m256 x = _mm256_set1_ps(1.0001f);
        __m256i sum = _mm256_setzero_si256();
        const auto start = std::chrono::steady_clock::now();
        for (int64_t g = g0; g < g1; ++g) {
          const uint8_t* wg = w + g * 16 * rb;
          for (int64_t sb = 0; sb < nb; ++sb)
            for (int f = 0; f < 16; ++f) {
              const uint8_t* src = wg + f * rb + sb * kBlock;
              const uint8_t* next = sb + ahead < nb ? src + ahead * kBlock : wg + (16 + f) * rb + (sb + ahead - nb) * kBlock;
              if (ahead > 0 && next + kBlock <= w + bytes)
                for (int l = 0; l < kBlock + 63; l += 64) _mm_prefetch(reinterpret_cast<const char*>(next + l), _MM_HINT_T1);
              for (int o = 0; o < kBlock; o += 56)  // 32 bytes at 0, 56, 112: every line the block lies in
                sum = _mm256_add_epi32(sum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + o)));
              for (int64_t i = 0; i < work / 128; ++i) {  // 8 FMAs an iteration, 16 rows a unit
                a0 = _mm256_fmadd_ps(a0, x, x), a1 = _mm256_fmadd_ps(a1, x, x), a2 = _mm256_fmadd_ps(a2, x, x);
                a3 = _mm256_fmadd_ps(a3, x, x), a4 = _mm256_fmadd_ps(a4, x, x), a5 = _mm256_fmadd_ps(a5, x, x);
                a6 = _mm256_fmadd_ps(a6, x, x), a7 = _mm256_fmadd_ps(a7, x, x);
              }
            }
        }
        ns[t] = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() /
                static_cast<double>((g1 - g0) * nb);
        alignas(32) float f[8];
        alignas(32) int32_t q[8];
        _mm256_store_ps(f, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                         _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7))));
        _mm256_store_si256(reinterpret_cast<__m256i*>(q), sum);
        if (f[0] == 1.2345f && q[0] == 12345) std::puts("");  // keeps the work
      });
    for (auto& th : pool) th.join();
    best = std::min(best, *std::max_element(ns.begin(), ns.end()));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  const int64_t work = argc > 2 ? std::atol(argv[2]) : 1536, ahead = argc > 3 ? std::atol(argv[3]) : 3,
                K = argc > 4 ? std::atol(argv[4]) : 2048;
  if (threads < 1 || work < 0 || ahead < 0 || K < 256 || K % 256) {
    std::fprintf(stderr, "usage: read_overlap [threads>=1] [work>=0] [ahead>=0] [K: a multiple of 256]\n");
    return 2;
  }
  const int64_t rb = K / 256 * kBlock, cold_groups = (300LL << 20) / (16 * rb),
                warm_groups = std::max<int64_t>(threads, (threads * (512LL << 10)) / (16 * rb));  // 512 KiB a thread
  auto* w = static_cast<uint8_t*>(std::aligned_alloc(4096, cold_groups * 16 * rb));
  std::memset(w, 1, cold_groups * 16 * rb);
  const int64_t unit_bytes = 16 * kBlock;
  const double read = ns_a_unit(w, cold_groups, K, threads, 0, ahead, 3);
  const double cold = ns_a_unit(w, cold_groups, K, threads, work, ahead, 3);
  const double warm = ns_a_unit(w, warm_groups, K, threads, work, ahead, 200);
  std::printf("threads %d, K %ld, %ld FMAs a unit of %ld bytes, asked %ld units ahead\n", threads, static_cast<long>(K),
              static_cast<long>(work), static_cast<long>(unit_bytes), static_cast<long>(ahead));
  std::printf("read alone      %6.0f ns a unit (%.1f GB/s a thread)\n", read, unit_bytes / read);
  std::printf("work in L2      %6.0f ns a unit\n", warm);
  std::printf("work + memory   %6.0f ns a unit (hidden: %.0f %% of the read)\n", cold,
              100.0 * std::clamp((warm + read - cold) / std::min(warm, read), 0.0, 1.0));
  std::free(w);
  return 0;
}

// The kernels Python calls, one declaration each, grouped by the file that defines them; bindings.cpp
// exposes them (names, argument names and defaults there). Each file's header says what its kernels
// do and why; the arguments' shapes and layouts are documented at each definition.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <string>
#include <vector>

namespace iterserve {

// attention_decode.cpp
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t window, double softcap);

// attention_prefill.cpp
at::Tensor paged_prefill_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, int64_t ctx, double scale, int64_t window,
                                   double softcap);

// argmax.cpp
at::Tensor first_argmax(const at::Tensor& x);

// kv_write.cpp
void kv_write(const at::Tensor& x_in, at::Tensor& cache, const at::Tensor& slot_mapping);

// gemm_quant.cpp
at::Tensor q8_0_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales);
at::Tensor q4_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mn);
bool q4_gemm_is_vectorised();

// gemm_gguf.cpp
at::Tensor gguf_gemm(const at::Tensor& x, const at::Tensor& buf, const at::Tensor& meta, int64_t N, bool int8,
                     bool amx);
bool gguf_gemm_amx_available();
int64_t gguf_gemm_amx_calls();
bool gguf_gemm_int8_supported();
at::Tensor gguf_moe_gemm(const at::Tensor& x, const at::Tensor& buf, const at::Tensor& meta, const at::Tensor& experts,
                         const at::Tensor& offsets, int64_t N, const c10::optional<at::Tensor>& rows_in);
std::string gguf_gemm_isa();

// gguf_dequant.cpp
at::Tensor gguf_dequant(const at::Tensor& buf, const at::Tensor& meta, int64_t K, const at::Tensor& rows,
                        bool bf16, bool tiled, const c10::optional<at::Tensor>& into);

// gemm_bf16.cpp
at::Tensor bf16_gemm(const at::Tensor& x_in, const at::Tensor& w, int64_t N, int64_t amx_min_rows);
bool bf16_gemm_amx_available();
bool bf16_gemm_is_vectorised();

// gemm_f32_bf16w.cpp
at::Tensor f32_bf16w_gemm(const at::Tensor& x_in, const at::Tensor& w, int64_t N);
bool f32_bf16w_gemm_is_vectorised();

// gemm_f32.cpp
at::Tensor f32_gemm(const at::Tensor& x_in, const at::Tensor& w);
bool f32_gemm_is_vectorised();

// norm.cpp
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps, bool unit_offset);
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& a_in, const at::Tensor& w,
                                     double eps, bool unit_offset);

// elementwise.cpp
at::Tensor silu_and_mul(const at::Tensor& x_in);
at::Tensor permute_columns(const at::Tensor& y_in, const at::Tensor& order_in);
at::Tensor widen_bf16(const at::Tensor& x);
at::Tensor rope(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in);
at::Tensor moe_combine(const at::Tensor& h_in, const at::Tensor& w_in, const at::Tensor& tokens_in, int64_t T);

// lora.cpp
void lora_sgmv(const at::Tensor& x_in, const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& row_slot_in,
               const std::vector<int64_t>& bounds, at::Tensor& out);

}  // namespace iterserve

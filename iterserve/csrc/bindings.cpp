// The extension's Python module: one m.def per kernel, the kernels themselves in their family's file
// (declared in kernels.h). The names, signatures and defaults here are what Python calls.
#include <torch/extension.h>

#include "kernel_common.h"
#include "kernels.h"
#include "lanes.h"
#include "work_pool.h"

using namespace iterserve;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_sgmv", &lora_sgmv, "out[r] += B[s] (A[s] x[r]) for each row's adapter slot s = row_slot[r] >= 0, "
        "in place, from the diagonal blocks of B only (layout in lora.cpp)");
  m.def("lanes_isa", [] { return std::string(kLanesIsa); },
        "the vector lanes this build's kernels run on (lanes.h): avx512, avx2 or scalar; what a test of a "
        "variant build (load_cpu_kernels(variant=...)) checks it really runs");
  m.def("first_argmax", &first_argmax, "x [T, V] float32 -> [T] int64: each row's argmax as torch.argmax gives it "
        "(the first of equal maxima; the first NaN where a row has one)");
  m.def("pool_threads", [] { return WorkPool::instance().num_threads(); }, "threads of the kernels' work pool");
  m.def("read_ahead", [](const at::Tensor& t, int64_t bytes) { WorkPool::instance().read_ahead(t, bytes); },
        "the first `bytes` of t's data for an idle pool worker to read into cache before the next kernel "
        "reads them (work_pool.h)", py::arg("t"), py::arg("bytes"));
  m.def("read_ahead_bytes", [] { return WorkPool::instance().read_ahead_bytes(); },
        "bytes the pool's workers have read ahead so far");
  m.def("set_stream_ahead", [](int64_t bytes) {
          TORCH_CHECK(bytes >= 0 && bytes <= (1 << 20), "stream ahead: 0 to 1 MiB, got ", bytes);
          g_stream_ahead.store(bytes);
        }, "how many bytes ahead of a weight stream the GGUF GEMMs ask for lines (kernel_common.h; "
        "platform/stream_ahead.py times the model's one-row projections to choose it)", py::arg("bytes"));
  m.def("stream_ahead", &stream_ahead, "the GGUF GEMMs' prefetch distance now (set_stream_ahead)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query per sequence against its paged K/V, read in place; window and softcap 0: off (see attention_decode.cpp)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "a chunk's queries, causal, against its sequence's paged K/V (bf16, AVX512-BF16); window and softcap 0: "
        "off (see attention_prefill.cpp)", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("ctx"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("kv_write", &kv_write, "x [T, kv_heads, D] into a float32, bf16 or q8_0 KV cache's slots, in place "
        "(the bytes of attention/kv_cache_dtype.py's quantise; see kv_write.cpp)", py::arg("x"), py::arg("cache"),
        py::arg("slot_mapping"));
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 or float32 rows in Hugging Face's order of rounding; unit_offset: Gemma's "
        "(1 + w) form (see norm.cpp)", py::arg("x"), py::arg("w"), py::arg("eps"),
        py::arg("unit_offset") = false);
  m.def("add_rms_norm", &add_rms_norm, "(x + a, rms_norm(x + a)) of bf16 or float32 rows: a residual add and the norm after "
        "it in one pass (see norm.cpp)", py::arg("x"), py::arg("a"), py::arg("w"), py::arg("eps"),
        py::arg("unit_offset") = false);
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :F]) * x[:, F:] of x [T, 2F] (float32 or bf16) in torch's order "
        "of rounding (see elementwise.cpp)", py::arg("x"));
  m.def("widen_bf16", &widen_bf16, "x [T, N] bf16 -> a new float32 [T, N] of its values, rows over the pool");
  m.def("permute_columns", &permute_columns, "y [T, N] with its columns in `order` ([N] int64, a permutation): "
        "out[t, j] = y[t, order[j]], torch.gather's values (see elementwise.cpp)", py::arg("y"), py::arg("order"));
  m.def("moe_combine", &moe_combine, "a MoE layer's output: h [P, H] times w [P], added into row tokens[i] of a "
        "zero [T, H] in pair order (torch's mul, to and index_add_ bits)", py::arg("h"), py::arg("w"),
        py::arg("tokens"), py::arg("T"));
  m.def("rope", &rope, "rotate-half RoPE of x [T, heads, D] by cos, sin [T, rd] (partial when rd < D) in torch's "
        "order of rounding; a new contiguous tensor (see elementwise.cpp)", py::arg("x"), py::arg("cos"), py::arg("sin"));
  m.def("q4_gemm", &q4_gemm, "x @ w.T for 4-bit w (GGUF Q4_1 levels; layout in gemm_quant.cpp)");
  m.def("q4_gemm_is_vectorised", &q4_gemm_is_vectorised, "whether q4_gemm was built with AVX512-VNNI or AVX2 + FMA");
  m.def("bf16_gemm", &bf16_gemm, "x @ w.T for bf16 w packed by pack_bf16 (layout in gemm_bf16.cpp); steps of "
        ">= amx_min_rows (> 0) rows on AMX tiles where available", py::arg("x"), py::arg("w"), py::arg("N"),
        py::arg("amx_min_rows") = 0);
  m.def("bf16_gemm_amx_available", &bf16_gemm_amx_available,
        "whether bf16_gemm can run on AMX tiles here (built with AMX-BF16, and Linux lent the tile state)");
  m.def("bf16_gemm_is_vectorised", &bf16_gemm_is_vectorised, "whether bf16_gemm was built with AVX512-BF16");
  m.def("f32_bf16w_gemm", &f32_bf16w_gemm,
        "float32 x @ w.T for bf16 w packed by pack_bf16_f32 (AVX2 + FMA; layout in gemm_f32_bf16w.cpp)");
  m.def("f32_bf16w_gemm_is_vectorised", &f32_bf16w_gemm_is_vectorised,
        "whether f32_bf16w_gemm was built with AVX2 and FMA");
  m.def("f32_gemm", &f32_gemm, "float32 x @ w.T for float32 w [N, K], each output's sum in one order at every M "
        "(gemm_f32.cpp)", py::arg("x"), py::arg("w"));
  m.def("f32_gemm_is_vectorised", &f32_gemm_is_vectorised, "whether f32_gemm runs on vector lanes (AVX2 or AVX-512)");
  m.def("q8_0_gemm", &q8_0_gemm, "x @ w.T for int8 w with a float scale per 32 inputs (GGUF Q8_0)");
  m.def("gguf_gemm", &gguf_gemm, "x @ w.T from GGUF blocks (K-quants as stored, 32-input blocks repacked four "
        "to a group by pack_gguf_x4); a row range per shard, meta [S, 4]: type, rows, bytes per row, offset "
        "(layout in gemm_gguf.cpp); int8: the K-quant shards on int8 activations per 256 inputs (llama.cpp's "
        "Q8_K) instead of int16 per row; amx: the K-quant shards on AMX-INT8 tiles from 16 rows where available "
        "(gguf_gemm_amx_available): int8 the interleaved kernel's numbers, int16 within its bound", py::arg("x"), py::arg("buf"), py::arg("meta"),
        py::arg("N"), py::arg("int8") = false, py::arg("amx") = false);
  m.def("gguf_gemm_amx_available", &gguf_gemm_amx_available,
        "whether gguf_gemm(amx=True) runs K-quant shards of 16+ rows on AMX-INT8 tiles here (build and OS)");
  m.def("gguf_gemm_amx_calls", &gguf_gemm_amx_calls, "how many gguf_gemm calls ran K-quant shards on AMX tiles so far");
  m.def("gguf_gemm_int8_supported", &gguf_gemm_int8_supported, "whether gguf_gemm(int8=True) runs in this build");
  m.def("gguf_moe_gemm", &gguf_moe_gemm, "llama.cpp's mul_mat_id from GGUF blocks: rows offsets[u] .. offsets[u + 1] "
        "of x (or of x[rows]) through expert experts[u], whose shards are meta[e] ([E, S, 4], as gguf_gemm's) in "
        "buf; one call a layer", py::arg("x"), py::arg("buf"), py::arg("meta"), py::arg("experts"), py::arg("offsets"),
        py::arg("N"), py::arg("rows") = py::none());
  m.def("gguf_gemm_isa", &gguf_gemm_isa, "the instruction set gguf_gemm was built for: avx512-vnni, avx2 or scalar");
  m.def("gguf_dequant", &gguf_dequant, "rows of gguf_gemm's blocks (buf, meta) as gguf-py dequantises them: "
        "[R, K] float32, or bf16, or bf16 tiles for bf16_gemm (tiled)", py::arg("buf"), py::arg("meta"), py::arg("K"),
        py::arg("rows"), py::arg("bf16") = false, py::arg("tiled") = false, py::arg("into") = py::none());
}


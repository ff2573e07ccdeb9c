// The Python module of the compiled CPU kernels (see kernels.h).
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over a paged KV cache (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "Residual add, then RMSNorm (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (CPU)");
  m.def("argmax_rows", &argmax_rows, "Per-row argmax of float32/bfloat16 logits (CPU)");
  m.def("rotary_embedding", &rotary_embedding, "Rotary embedding from a cos/sin cache (CPU)");
  m.def("reshape_and_cache", &reshape_and_cache, "Write keys/values into paged caches (CPU)");
  m.def("int8_linear", &int8_linear, "Matmul with a per-channel int8 weight (CPU)");
  m.def("packed_linear", &packed_linear, "x W^T + b on a weight packed for oneDNN (CPU)");
  m.def("packed_gemv_applies", &packed_gemv_applies,
        "Whether packed_linear runs its matrix-vector kernel on these operands (CPU)");
  m.def("set_packed_gemv_max_rows", &set_packed_gemv_max_rows,
        "Set the most rows of a dtype's step packed_linear runs its kernel for (CPU)");
  m.def("packed_gemv_max_rows", &packed_gemv_max_rows,
        "The most rows of a dtype's step packed_linear runs its kernel for (CPU)");
  m.def("amx_gemm_applies", &amx_gemm_applies,
        "Whether packed_linear runs AMX tiles on these operands (CPU)");
  m.def("set_amx_gemm_max_rows", &set_amx_gemm_max_rows,
        "Set the most rows packed_linear runs AMX tiles for (CPU)");
  m.def("amx_gemm_max_rows", &amx_gemm_max_rows,
        "The most rows packed_linear runs AMX tiles for (CPU)");
  m.def("packed_block_width", &packed_block_width,
        "Block width (64, 32) of a packed bf16/fp32 weight's layout, 0 for another (CPU)");
  m.def("block_width_of", &block_width_of,
        "Block width (64, 32) of the layout a plain tensor holds a weight in, 0 for another");
  m.def("blocked_linear", &blocked_linear, "x W^T + b on a weight in Ember's blocked layout (CPU)");
  m.def("lora_shrink", &lora_shrink, "Per-row LoRA shrink h = scale * A[slot] x (CPU, float32)");
  m.def("lora_expand", &lora_expand, "Per-row LoRA expand y += B[slot] h (CPU, float32)");
  m.def("moe_experts", &moe_experts, "Routed MoE experts of a few tokens, stacked weights (CPU)");
  m.def("moe_topk_softmax", &moe_topk_softmax, "Softmax top-k routing, optionally renormalized (CPU)");
  m.def("w8a8_linear", &w8a8_linear, "int8 x int8 matmul, activations quantized per row (CPU)");
  pybind11::class_<DecoderStack>(m, "DecoderStack", "Pre-norm decoder layers in one call (CPU)")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, at::Tensor, bool>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("set_weight_scales", &DecoderStack::set_weight_scales)
      .def("set_lora", &DecoderStack::set_lora)
      .def("set_timed", &DecoderStack::set_timed)
      .def("phase_seconds", &DecoderStack::phase_seconds)
      .def("forward", &DecoderStack::forward, pybind11::arg("hidden_states"),
           pybind11::arg("residual"), pybind11::arg("positions"), pybind11::arg("slot_mapping"),
           pybind11::arg("block_table"), pybind11::arg("query_start_loc"),
           pybind11::arg("seq_lens"), pybind11::arg("lora_slots") = pybind11::none(),
           pybind11::arg("lora_grouped") = false,
           pybind11::call_guard<pybind11::gil_scoped_release>());
}

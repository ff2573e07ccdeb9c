// The compiled CPU kernels bound in bindings.cpp (arguments are checked by the Python wrappers in
// cpu_ops/__init__.py; the kernels check only what they rely on).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

void paged_attention(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_table, const at::Tensor& query_start_loc,
    const at::Tensor& seq_lens, double scale, int64_t sliding_window, double soft_cap,
    at::Tensor& out);

// The element-wise kernels allocate and return their outputs (contiguous).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps);

at::Tensor silu_and_mul(const at::Tensor& x);
// Per-row argmax (int64) of float32 or bfloat16 logits [rows, vocab] with contiguous rows: the
// first index of the largest value, or of the first NaN (numpy's answer), read in place.
at::Tensor argmax_rows(const at::Tensor& logits);

std::tuple<at::Tensor, std::optional<at::Tensor>> rotary_embedding(
    const at::Tensor& positions, const at::Tensor& query, const std::optional<at::Tensor>& key,
    const at::Tensor& cos_sin_cache, bool is_neox_style);

// y = x (q * scales)^T + bias for an int8 weight q [N, K] with float32 scales [N, G], one per
// K / G consecutive inputs of each output channel (or [N]: one per channel); x [M, K]
// float32/bfloat16/float16, y [M, N] in x's dtype, summed in float32 (above 4 rows, over the
// weight dequantized to x's dtype).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias);
// ValueError unless weight is int8 [N, K] and scales float32 [N] or [N, G] with G dividing K: the
// layouts int8_linear takes.
void check_int8_scales(const at::Tensor& weight, const at::Tensor& scales);

// y = x W^T + bias for a weight packed for oneDNN (ember_kernels.packed_linear): bfloat16 and
// float32 steps of up to packed_gemv_max_rows(dtype) rows (a decode batch) stream the packed
// weight through AVX512-BF16 dot products or AVX-512 multiply-adds where the CPU has them and
// oneDNN's layout is one of the two blocked ones the kernel reads (packed_layout.cpp); with AMX,
// bfloat16 steps above that and up to amx_gemm_max_rows() stream it into AMX tiles
// (amx_gemm.cpp); larger ones (prefill) run oneDNN's matmul. Summed in float32 and rounded once
// to x's dtype on every path.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias);
// Whether packed_linear runs the matrix-vector kernel for these operands.
bool packed_gemv_applies(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias);
// The most rows of a bfloat16 or float32 step packed_linear runs the kernel for: 0 (none) until
// told, which the Python side does at load from what the CPU offers
// (ember_kernels.cpu_features.packed_gemv_max_rows); ValueError for another dtype.
void set_packed_gemv_max_rows(int64_t rows, at::ScalarType dtype);
int64_t packed_gemv_max_rows(at::ScalarType dtype);
// Whether packed_linear runs AMX tiles for these operands (amx_gemm.cpp): steps above
// packed_gemv_max_rows() rows and up to amx_gemm_max_rows() (0 until told, at most 32), on a CPU
// whose tiles this process may use, a weight oneDNN packed 32 channels a block, whole tile steps.
bool amx_gemm_applies(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias);
void set_amx_gemm_max_rows(int64_t rows);
int64_t amx_gemm_max_rows();
// The block width (64 or 32) of the layout a packed bfloat16 or float32 weight's bytes are in, 0
// for any other layout, CPU or tensor.
int64_t packed_block_width(const at::Tensor& weight);
// The same check on plain tensors: the block width (64 or 32) of the layout `stored` holds
// `weight` [N, K]'s values in, 0 for another or where several layouts fit the values.
int64_t block_width_of(const at::Tensor& weight, const at::Tensor& stored);
// The kernel on a plain bfloat16 weight [N / W, K / 2, W, 2] (W 64 or 32), any number of rows.
at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias);

// Per-row LoRA (float32, float16 or bfloat16, summed in float32): out[t] = scale *
// lora_a[slots[t]] x[t] (zeros for slot -1), and y[t, y_offset:] += lora_b[slots[t]]
// h[t, h_offset:] (``lora_a [S, R, K]`` contiguous, ``lora_b [S, N, R]`` contiguous or the
// transpose of a contiguous [S, R, N]; x, h, y, out with contiguous rows; slots int64).
void lora_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& slots,
                 double scale, at::Tensor& out);
void lora_expand(at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                 const at::Tensor& slots, int64_t y_offset, int64_t h_offset);
// A step's LoRA rows: each token's slot and, for ``grouped`` steps (many tokens per adapter, as
// in a prefill), the tokens of each slot present, in row order (undefined: every token, one
// slot), for one matmul per adapter as ember_kernels.torch_ops.lora runs them.
struct LoRARows {
  at::Tensor slots;  // int64 [tokens], -1: none; undefined: no adapter in the step
  bool grouped = false;
  std::vector<std::pair<int64_t, at::Tensor>> groups;
};
LoRARows lora_rows(const at::Tensor& slots, bool grouped);
// y plus each row's adapter delta, in place: one shrink by ``lora_a [S, n * R, K]`` for the n
// slices, one expand per ``lora_b [S, N_i, R]`` into its columns of y; per row (lora_shrink and
// lora_expand) or per group (matmuls), with the numbers of the matching Python path.
void lora_add(const at::Tensor& x, at::Tensor& y, const at::Tensor& lora_a,
              const std::vector<at::Tensor>& lora_b, const LoRARows& rows);
// The routed experts of a few tokens: out[t] = sum_j topk_weights[t, j] * expert_{local_ids[t, j]}(
// hidden[t]) over stacked w13 [E, 2I, H] (gate rows, then up) and w2 [E, H, I]; ids outside
// [0, E) add nothing (experts held elsewhere). Float32 sums; float32, bfloat16 or float16.
at::Tensor moe_experts(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                       const at::Tensor& topk_weights, const at::Tensor& local_ids);
// Softmax routing: each token's top_k experts by softmax(logits) in descending order and their
// probabilities (float32 weights, int64 ids [tokens, top_k]), renormalized to sum 1 if asked.
std::tuple<at::Tensor, at::Tensor> moe_topk_softmax(const at::Tensor& logits, int64_t top_k,
                                                    bool renormalize);
// W8A8: x [M, K] quantized to int8 per row (symmetric, one float32 scale each), times an int8
// weight [N, K] with float32 scales [N] in int32, scaled back and + bias; y [M, N] in x's dtype.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& weight_scales, const std::optional<at::Tensor>& bias);

void reshape_and_cache(
    const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
    at::Tensor& value_cache, const at::Tensor& slot_mapping);

// A stack of pre-norm decoder layers (the Llama family: fused q/k/v and gate/up projections,
// optional q/k/v and MLP biases, optional per-head q/k RMSNorm, rotary embedding from a cos/sin
// cache, paged attention with an optional sliding window per layer, SwiGLU) run in one call, with
// the same kernels and matmuls as the per-operation path: a small step is made of some twenty
// short operations per layer, and each one called from Python cost more than its own work.
// Weights are held, never copied; linear weights are [out, in] tensors as torch's linear takes.
class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_size, double rms_norm_eps,
               double scale, at::Tensor cos_sin_cache, bool is_neox_style);

  void add_layer(at::Tensor input_norm, at::Tensor qkv, std::optional<at::Tensor> qkv_bias,
                 std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                 at::Tensor o_proj, std::optional<at::Tensor> o_bias, at::Tensor post_norm,
                 at::Tensor gate_up, std::optional<at::Tensor> gate_up_bias, at::Tensor down,
                 std::optional<at::Tensor> down_bias, at::Tensor key_cache,
                 at::Tensor value_cache, int64_t sliding_window);

  // The scales of the last added layer's int8 weights: weight-only (int8_linear: per channel or
  // per group), or with quantize_activations W8A8 (w8a8_linear: per channel); none for a
  // projection left in floating point.
  void set_weight_scales(std::optional<at::Tensor> qkv, std::optional<at::Tensor> o_proj,
                         std::optional<at::Tensor> gate_up, std::optional<at::Tensor> down,
                         bool quantize_activations);

  // LoRA adapter slots of one projection of the last added layer (0 qkv, 1 o_proj, 2 gate_up,
  // 3 down): ``lora_a [slots, n * rank, in]`` and one ``lora_b [slots, out_i, rank]`` per slice
  // of the output (n slices side by side), as lora_shrink/lora_expand take them. Held, not
  // copied: slots written later are seen.
  void set_lora(int64_t projection, at::Tensor lora_a, std::vector<at::Tensor> lora_b);

  // (hidden_states, residual) after every layer; ``residual`` None before the first layer.
  // ``lora_slots [tokens]`` (-1: none) adds each token's adapter to the projections that have
  // LoRA slots (``lora_add``; ``lora_grouped``: one matmul per adapter), after the matmul and
  // before a row-parallel projection's bias, as the per-operation path adds it.
  std::tuple<at::Tensor, at::Tensor> forward(
      at::Tensor hidden_states, std::optional<at::Tensor> residual, const at::Tensor& positions,
      const at::Tensor& slot_mapping, const at::Tensor& block_table,
      const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
      std::optional<at::Tensor> lora_slots, bool lora_grouped) const;

  // The phases of a layer, in order, that ``phase_seconds`` reports (each matmul's phase holds
  // its parallel region's start and end, a step's time outside the weight streaming is the rest):
  // the enum indexes the names, so the two are declared here side by side.
  enum Phase { NORMS, QKV, QK_NORM_ROPE_CACHE, ATTENTION, O_PROJ, GATE_UP, SILU_AND_MUL, DOWN,
               NUM_PHASES };
  static constexpr const char* PHASES[] = {"norms",  "qkv",     "qk_norm_rope_cache",
                                           "attention", "o_proj", "gate_up",
                                           "silu_and_mul", "down"};
  static_assert(sizeof(PHASES) / sizeof(PHASES[0]) == NUM_PHASES, "one name per phase");
  // Whether forward adds each phase's wall-clock seconds, summed over layers and steps, to
  // ``phase_seconds`` (off: no clock is read). Turning it on zeroes the sums.
  void set_timed(bool timed);
  // {phase: seconds} summed since timing was turned on (a profiling aid: bench_decode --split).
  std::vector<std::pair<std::string, double>> phase_seconds() const;

 private:
  struct LoRA {
    at::Tensor a;                // undefined: no adapter slots on this projection
    std::vector<at::Tensor> b;  // one per output slice
  };
  struct Layer {
    at::Tensor input_norm, qkv, qkv_bias, q_norm, k_norm, o_proj, o_bias, post_norm, gate_up,
        gate_up_bias, down, down_bias, key_cache, value_cache;
    int64_t sliding_window;
    at::Tensor qkv_scale, o_scale, gate_up_scale, down_scale;  // undefined: float weights
    bool quantize_activations = false;                         // W8A8
    LoRA lora[4];                                              // qkv, o_proj, gate_up, down
  };
  int64_t num_heads_, num_kv_heads_, head_size_;
  double eps_, scale_;
  at::Tensor cos_sin_cache_;
  // The cache in the layers' dtype (that of the first layer's norm), converted once rather than
  // at every step.
  at::Tensor cos_sin_in_dtype_;
  bool is_neox_style_;
  std::vector<Layer> layers_;
  bool timed_ = false;
  mutable double phase_seconds_[NUM_PHASES] = {};
};

// DecoderStack (kernels.h): each layer does what the per-operation path does, in the same order
// and with the same kernels and matmuls, so the two give the same numbers.

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>

#include "kernels.h"

#include <algorithm>
#include <chrono>
#include <iterator>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

at::Tensor held(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

// y = x W^T (+ b), with the bias inside the matmul (column-parallel projections). A weight
// packed for oneDNN (ember_kernels.packed_linear) goes through packed_linear, as its ``linear``
// does, an int8 one with its scales through int8_linear (or w8a8_linear with
// quantize_activations), a plain one through at::linear, as in the per-operation path.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                  const at::Tensor& scales, bool quantize_activations) {
  if (weight.scalar_type() == at::kChar) {
    const auto held_bias = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
    return quantize_activations ? w8a8_linear(x, weight, scales, held_bias)
                                : int8_linear(x, weight, scales, held_bias);
  }
  if (weight.is_mkldnn()) {
    return packed_linear(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
  }
  return bias.defined() ? at::linear(x, weight, bias) : at::linear(x, weight);
}

// y = x W^T (+ LoRA), then + b (row-parallel projections add their bias after the partial sums
// and the adapter's delta).
at::Tensor linear_then_bias(const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& scales,
                            bool quantize_activations, const at::Tensor& lora_a,
                            const std::vector<at::Tensor>& lora_b, const LoRARows& rows) {
  at::Tensor y = linear(x, weight, at::Tensor(), scales, quantize_activations);
  lora_add(x, y, lora_a, lora_b, rows);
  return bias.defined() ? y + bias : y;
}

// Adds the seconds since the last mark to one phase's sum, where the stack is timed.
class PhaseClock {
 public:
  explicit PhaseClock(double* sums) : sums_(sums) {
    if (sums_ != nullptr) last_ = std::chrono::steady_clock::now();
  }
  void mark(DecoderStack::Phase phase) {
    if (sums_ == nullptr) return;
    const auto now = std::chrono::steady_clock::now();
    sums_[phase] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  double* sums_;
  std::chrono::steady_clock::time_point last_;
};

// Per-head RMSNorm of [tokens, heads, head_size] (a strided view of the q/k/v projection).
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm(x.reshape({-1, x.size(2)}), weight, eps).view(x.sizes());
}

}  // namespace

DecoderStack::DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                           double rms_norm_eps, double scale, at::Tensor cos_sin_cache,
                           bool is_neox_style)
    : num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_size_(head_size),
      eps_(rms_norm_eps),
      scale_(scale),
      cos_sin_cache_(cos_sin_cache.contiguous()),
      is_neox_style_(is_neox_style) {
  TORCH_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
                    "num_heads: expected a positive multiple of num_kv_heads, got ", num_heads,
                    " and ", num_kv_heads);
}

void DecoderStack::add_layer(at::Tensor input_norm, at::Tensor qkv,
                             std::optional<at::Tensor> qkv_bias, std::optional<at::Tensor> q_norm,
                             std::optional<at::Tensor> k_norm, at::Tensor o_proj,
                             std::optional<at::Tensor> o_bias, at::Tensor post_norm,
                             at::Tensor gate_up, std::optional<at::Tensor> gate_up_bias,
                             at::Tensor down, std::optional<at::Tensor> down_bias,
                             at::Tensor key_cache, at::Tensor value_cache,
                             int64_t sliding_window) {
  const int64_t q_size = num_heads_ * head_size_, kv_size = num_kv_heads_ * head_size_;
  TORCH_CHECK_VALUE(qkv.dim() == 2 && qkv.size(0) == q_size + 2 * kv_size,
                    "qkv: expected [", q_size + 2 * kv_size, ", hidden], got ", qkv.sizes());
  TORCH_CHECK_VALUE(q_norm.has_value() == k_norm.has_value(),
                    "q_norm/k_norm: give both or neither");
  TORCH_CHECK_VALUE(key_cache.is_contiguous() && value_cache.is_contiguous() &&
                        key_cache.dim() == 4 && key_cache.size(2) == num_kv_heads_ &&
                        key_cache.size(3) == head_size_,
                    "key_cache/value_cache: expected contiguous [blocks, block_size, ",
                    num_kv_heads_, ", ", head_size_, "] tensors");
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(0) % 2 == 0 &&
                        down.size(1) == gate_up.size(0) / 2,
                    "gate_up/down: expected [2 * intermediate, hidden] and [hidden, intermediate]");
  if (layers_.empty()) cos_sin_in_dtype_ = cos_sin_cache_.to(input_norm.scalar_type());
  layers_.push_back(Layer{input_norm.contiguous(), qkv, held(qkv_bias),
                          q_norm ? q_norm->contiguous() : at::Tensor(),
                          k_norm ? k_norm->contiguous() : at::Tensor(), o_proj, held(o_bias),
                          post_norm.contiguous(), gate_up, held(gate_up_bias), down,
                          held(down_bias), key_cache, value_cache, sliding_window});
}

void DecoderStack::set_weight_scales(std::optional<at::Tensor> qkv,
                                     std::optional<at::Tensor> o_proj,
                                     std::optional<at::Tensor> gate_up,
                                     std::optional<at::Tensor> down, bool quantize_activations) {
  TORCH_CHECK_VALUE(!layers_.empty(), "set_weight_scales: add a layer first");
  Layer& layer = layers_.back();
  const std::pair<const at::Tensor*, const std::optional<at::Tensor>*> pairs[] = {
      {&layer.qkv, &qkv}, {&layer.o_proj, &o_proj}, {&layer.gate_up, &gate_up}, {&layer.down, &down}};
  for (const auto& [weight, scales] : pairs) {
    if (!scales->has_value()) {  // a projection left in floating point
      TORCH_CHECK_VALUE(weight->scalar_type() != at::kChar,
                        "set_weight_scales: an int8 weight needs its scales");
      continue;
    }
    check_int8_scales(*weight, **scales);
    TORCH_CHECK_VALUE(!quantize_activations || (*scales)->dim() == 1,
                      "set_weight_scales: W8A8 takes one scale per output channel");
  }
  const auto dense = [](const std::optional<at::Tensor>& t) {
    return t.has_value() ? t->contiguous() : at::Tensor();
  };
  layer.qkv_scale = dense(qkv);
  layer.o_scale = dense(o_proj);
  layer.gate_up_scale = dense(gate_up);
  layer.down_scale = dense(down);
  layer.quantize_activations = quantize_activations;
}

void DecoderStack::set_lora(int64_t projection, at::Tensor lora_a,
                            std::vector<at::Tensor> lora_b) {
  TORCH_CHECK_VALUE(!layers_.empty(), "set_lora: add a layer first");
  TORCH_CHECK_VALUE(projection >= 0 && projection < 4,
                    "projection: expected 0 (qkv), 1 (o_proj), 2 (gate_up) or 3 (down), got ",
                    projection);
  TORCH_CHECK_VALUE(!lora_b.empty() && lora_a.dim() == 3 && lora_a.is_contiguous(),
                    "lora_a: expected a contiguous [slots, slices * rank, in] tensor and one "
                    "lora_b per slice");
  const int64_t rank = lora_b.front().dim() == 3 ? lora_b.front().size(2) : 0;
  TORCH_CHECK_VALUE(lora_a.size(1) == rank * static_cast<int64_t>(lora_b.size()),
                    "lora_a: expected ", rank * static_cast<int64_t>(lora_b.size()),
                    " rows per slot (rank ", rank, " for each of ", lora_b.size(), " slices), got ",
                    lora_a.size(1));
  for (const at::Tensor& b : lora_b) {
    TORCH_CHECK_VALUE(b.dim() == 3 && b.size(0) == lora_a.size(0) && b.size(2) == rank &&
                          b.scalar_type() == lora_a.scalar_type(),
                      "lora_b: expected [", lora_a.size(0), ", out, ", rank, "] tensors of ",
                      lora_a.scalar_type());
  }
  layers_.back().lora[projection] = LoRA{lora_a, std::move(lora_b)};
}

std::tuple<at::Tensor, at::Tensor> DecoderStack::forward(
    at::Tensor hidden, std::optional<at::Tensor> residual_in, const at::Tensor& positions,
    const at::Tensor& slot_mapping, const at::Tensor& block_table,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
    std::optional<at::Tensor> lora_slots, bool lora_grouped) const {
  TORCH_CHECK_VALUE(hidden.dim() == 2, "hidden_states: expected [num_tokens, hidden]");
  const int64_t tokens = hidden.size(0);
  TORCH_CHECK_VALUE(!lora_slots || (lora_slots->dim() == 1 && lora_slots->size(0) == tokens),
                    "lora_slots: expected one slot index per token");
  const LoRARows lora = lora_rows(lora_slots ? *lora_slots : at::Tensor(), lora_grouped);
  const int64_t q_size = num_heads_ * head_size_, kv_size = num_kv_heads_ * head_size_;
  const at::Tensor positions64 = positions.to(at::kLong).contiguous();
  const at::Tensor slots64 = slot_mapping.to(at::kLong).contiguous();
  const at::Tensor table32 = block_table.to(at::kInt);
  const at::Tensor starts32 = query_start_loc.to(at::kInt).contiguous();
  const at::Tensor lens32 = seq_lens.to(at::kInt).contiguous();
  const at::Tensor cos_sin = cos_sin_in_dtype_.defined() &&
                                     cos_sin_in_dtype_.scalar_type() == hidden.scalar_type()
                                 ? cos_sin_in_dtype_
                                 : cos_sin_cache_.to(hidden.scalar_type());
  PhaseClock clock(timed_ ? phase_seconds_ : nullptr);
  at::Tensor residual = held(residual_in);
  for (const Layer& layer : layers_) {
    if (!residual.defined()) {
      residual = hidden;
      hidden = rms_norm(hidden, layer.input_norm, eps_);
    } else {
      std::tie(hidden, residual) = fused_add_rms_norm(hidden, residual, layer.input_norm, eps_);
    }
    clock.mark(NORMS);
    at::Tensor qkv = linear(hidden, layer.qkv, layer.qkv_bias, layer.qkv_scale,
                            layer.quantize_activations);
    lora_add(hidden, qkv, layer.lora[0].a, layer.lora[0].b, lora);
    clock.mark(QKV);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_size_});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads_, head_size_});
    const at::Tensor v =
        qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_size_});
    if (layer.q_norm.defined()) {
      q = head_norm(q, layer.q_norm, eps_);
      k = head_norm(k, layer.k_norm, eps_);
    }
    std::optional<at::Tensor> rotated_k;
    std::tie(q, rotated_k) = rotary_embedding(positions64, q, k, cos_sin, is_neox_style_);
    k = *rotated_k;
    at::Tensor key_cache = layer.key_cache, value_cache = layer.value_cache;
    reshape_and_cache(k, v, key_cache, value_cache, slots64);
    clock.mark(QK_NORM_ROPE_CACHE);
    at::Tensor attended = at::empty_like(q);
    paged_attention(q, key_cache, value_cache, table32, starts32, lens32, scale_,
                    layer.sliding_window, 0.0, attended);
    clock.mark(ATTENTION);
    hidden = linear_then_bias(attended.view({tokens, q_size}), layer.o_proj, layer.o_bias,
                              layer.o_scale, layer.quantize_activations, layer.lora[1].a,
                              layer.lora[1].b, lora);
    clock.mark(O_PROJ);
    std::tie(hidden, residual) = fused_add_rms_norm(hidden, residual, layer.post_norm, eps_);
    clock.mark(NORMS);
    at::Tensor gate_up = linear(hidden, layer.gate_up, layer.gate_up_bias, layer.gate_up_scale,
                                layer.quantize_activations);
    lora_add(hidden, gate_up, layer.lora[2].a, layer.lora[2].b, lora);
    clock.mark(GATE_UP);
    const at::Tensor activated = silu_and_mul(gate_up);
    clock.mark(SILU_AND_MUL);
    hidden = linear_then_bias(activated, layer.down, layer.down_bias, layer.down_scale,
                              layer.quantize_activations, layer.lora[3].a, layer.lora[3].b, lora);
    clock.mark(DOWN);
  }
  return {hidden, residual};
}

void DecoderStack::set_timed(bool timed) {
  timed_ = timed;
  if (timed) std::fill(std::begin(phase_seconds_), std::end(phase_seconds_), 0.0);
}

std::vector<std::pair<std::string, double>> DecoderStack::phase_seconds() const {
  std::vector<std::pair<std::string, double>> sums;
  for (int phase = 0; phase < NUM_PHASES; ++phase) {
    sums.emplace_back(PHASES[phase], phase_seconds_[phase]);
  }
  return sums;
}
